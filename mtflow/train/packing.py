"""Packing samples into fixed-length rows without padding each sample to the longest.

A row of length ``row_len`` holds whole samples one after another (a sample is never split across
rows or batches), each as ``prompt_ids + completion_ids`` with

* ``position_ids`` restarting at 0 for every sample (what flash-attention's varlen path and TRL's
  padding-free collator take: positions and the sequence boundaries ``cu_seqlens``);
* ``loss_mask``: 0 on the prompt, the sample's own mask on its completion, 0 on padding;
* ``sample_index``: which sample each position belongs to (``-1``: padding), so an attention mask
  that keeps samples apart (:func:`block_causal_mask`, for SDPA or eager attention, where position
  ids alone do not) and per-token values (advantages, rollout logprobs) are built from it;
* ``advantages`` and ``logprobs``: each sample's advantage (its ``token_advantages`` when set) and
  rollout logprobs on its trained completion tokens (0 elsewhere);
* ``has_logprobs``: 1 on the completion tokens of a sample that has rollout logprobs, 0 elsewhere:
  a sample without them (the contract clears logprobs that do not cover its trained tokens) has
  no behaviour policy to correct against, and its ``logprobs`` 0.0 are no logprob (a loss reads
  ``has_logprobs`` to train it without the importance correction, :mod:`mtflow.train.loop`).

:func:`pack` fills rows first-fit in the samples' order; :func:`pad` is the padded layout (one
sample per row, right-padded to the longest). Both are plain lists; :func:`to_tensors` makes
torch tensors (torch imported then).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence

from mtflow.train.samples import Sample

__all__ = ['PackedRow', 'pack', 'pad', 'to_tensors', 'block_causal_mask', 'unpack', 'token_advantages_of']


@dataclass
class PackedRow:
    """One row of a batch (every list has the row's length)."""
    input_ids: List[int] = field(default_factory=list)
    position_ids: List[int] = field(default_factory=list)
    loss_mask: List[int] = field(default_factory=list)
    sample_index: List[int] = field(default_factory=list)
    advantages: List[float] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    #: 1 where ``logprobs`` holds a rollout logprob (a completion token of a sample that has them)
    has_logprobs: List[int] = field(default_factory=list)
    #: the indices (into the packed list) of the samples in this row, in order
    samples: List[int] = field(default_factory=list)
    #: the boundaries of the samples in the row: ``[0, len_1, len_1 + len_2, ...]`` (padding excluded)
    cu_seqlens: List[int] = field(default_factory=lambda: [0])

    def __len__(self) -> int:
        return len(self.input_ids)

    def add(self, index: int, sample: Sample) -> None:
        prompt, completion = sample.prompt_ids, sample.completion_ids
        n = len(prompt) + len(completion)
        self.input_ids += prompt + completion
        self.position_ids += list(range(n))
        self.loss_mask += [0] * len(prompt) + list(sample.loss_mask)
        self.sample_index += [index] * n
        self.advantages += [0.0] * len(prompt) + token_advantages_of(sample)
        known = sample.logprobs is not None
        self.logprobs += [0.0] * len(prompt) + (list(sample.logprobs) if known else [0.0] * len(completion))
        self.has_logprobs += [0] * len(prompt) + [int(known)] * len(completion)
        self.samples.append(index)
        self.cu_seqlens.append(self.cu_seqlens[-1] + n)

    def fill(self, length: int, pad_id: int) -> None:
        extra = length - len(self.input_ids)
        self.input_ids += [pad_id] * extra
        self.position_ids += [0] * extra
        self.loss_mask += [0] * extra
        self.sample_index += [-1] * extra
        self.advantages += [0.0] * extra
        self.logprobs += [0.0] * extra
        self.has_logprobs += [0] * extra


def token_advantages_of(sample: Sample) -> List[float]:
    """Each completion token's advantage: its ``token_advantages`` when set, else the sample's
    ``advantage`` (0 when unset); 0 wherever the loss mask is 0."""
    if sample.token_advantages is not None:
        return [float(a) if m else 0.0 for a, m in zip(sample.token_advantages, sample.loss_mask)]
    advantage = float(sample.advantage) if sample.advantage is not None else 0.0
    return [advantage if m else 0.0 for m in sample.loss_mask]


def _length(sample: Sample) -> int:
    return len(sample.prompt_ids) + len(sample.completion_ids)


def pack(samples: Sequence[Sample], row_len: int, pad_id: int = 0) -> List[PackedRow]:
    """Rows of exactly ``row_len`` tokens, each sample whole in the first row with room for it.
    A sample longer than ``row_len`` is an error naming it."""
    if row_len < 1:
        raise ValueError(f'row_len must be >= 1, not {row_len!r}')
    rows: List[PackedRow] = []
    for index, sample in enumerate(samples):
        n = _length(sample)
        if n > row_len:
            raise ValueError(f'request {sample.uuid}, segment {sample.segment}: {n} tokens do not fit a row of '
                             f'{row_len} (a sample is never split)')
        row = next((r for r in rows if len(r) + n <= row_len), None)
        if row is None:
            row = PackedRow()
            rows.append(row)
        row.add(index, sample)
    for row in rows:
        row.fill(row_len, pad_id)
    return rows


def pad(samples: Sequence[Sample], pad_id: int = 0) -> List[PackedRow]:
    """One sample per row, right-padded to the longest sample."""
    width = max((_length(s) for s in samples), default=0)
    rows = []
    for index, sample in enumerate(samples):
        row = PackedRow()
        row.add(index, sample)
        row.fill(width, pad_id)
        rows.append(row)
    return rows


def unpack(row: PackedRow) -> Dict[int, Dict[str, List[Any]]]:
    """Each sample's own stretch of ``row`` (``input_ids``, ``position_ids``, ``loss_mask``), by index."""
    out: Dict[int, Dict[str, List[Any]]] = {}
    for k, index in enumerate(row.sample_index):
        if index < 0:
            continue
        part = out.setdefault(index, {'input_ids': [], 'position_ids': [], 'loss_mask': []})
        part['input_ids'].append(row.input_ids[k])
        part['position_ids'].append(row.position_ids[k])
        part['loss_mask'].append(row.loss_mask[k])
    return out


def to_tensors(rows: Sequence[PackedRow]) -> Dict[str, Any]:
    """The rows as ``[rows, row_len]`` torch tensors, named as the row's fields."""
    import torch

    def stack(name: str, dtype: Any) -> Any:
        return torch.tensor([getattr(r, name) for r in rows], dtype=dtype)

    return {'input_ids': stack('input_ids', torch.long), 'position_ids': stack('position_ids', torch.long),
            'loss_mask': stack('loss_mask', torch.float32), 'sample_index': stack('sample_index', torch.long),
            'advantages': stack('advantages', torch.float32), 'logprobs': stack('logprobs', torch.float32),
            'has_logprobs': stack('has_logprobs', torch.bool)}


def block_causal_mask(sample_index: Any) -> Any:
    """``[rows, 1, T, T]`` boolean attention mask: a position attends to the earlier positions of
    its own sample only (padding attends to itself, so no row of the softmax is empty)."""
    import torch

    same = sample_index[:, :, None] == sample_index[:, None, :]
    causal = torch.ones(sample_index.shape[-1], sample_index.shape[-1], dtype=torch.bool).tril()
    eye = torch.eye(sample_index.shape[-1], dtype=torch.bool)
    return ((same & causal) | eye)[:, None]
