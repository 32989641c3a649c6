"""Importance weights between the policy that sampled a token (the rollout's ``logprobs``, the
*behaviour* policy) and the policy being trained (the trainer's logprobs of the same ids).

Rollout engines and trainers disagree on logprobs (other kernels, precision, a stale policy), so
``ratio_t = exp(current_t - behaviour_t)`` is not 1, and a policy gradient over rollout tokens is
biased without a correction. Three corrections, each a small function of logprob tensors of one
shape (``[tokens]`` or ``[rows, tokens]``), all detached (they weight the loss, they are not
trained through):

* :func:`truncated_is` (TIS, token level): ``w_t = min(ratio_t, cap)``;
* :func:`geometric_sequence_weight` (sequence level): ``w = exp(mean_{t in mask}(current_t -
  behaviour_t))``, the geometric mean of the ratios over the trained tokens of each row;
* :func:`keep_within` (masked IS): ``1`` where ``lower <= ratio_t <= upper``, else ``0``, to
  multiply into the loss mask (tokens too far off-policy are not trained at all).

torch is imported when a function runs, never with the module.
"""
from __future__ import annotations

from typing import Any, Optional

from mtflow.train.errors import SampleError

__all__ = ['LOSS_AGGREGATIONS', 'MISSING_LOGPROBS', 'ratios', 'truncated_is', 'geometric_sequence_weight', 'keep_within',
           'behaviour_logprobs', 'uncorrected_samples']

#: how a policy loss averages its tokens: every trained token alike, or each sample's mean averaged
LOSS_AGGREGATIONS = ('token-mean', 'sample-mean')
#: what a train step does with samples without rollout logprobs when a correction is asked:
#: train them without it (counted), or refuse the step naming the first
MISSING_LOGPROBS = ('uncorrected', 'refuse')


def _tensors(current: Any, behaviour: Any) -> Any:
    import torch

    cur = torch.as_tensor(current, dtype=torch.float32).detach()
    beh = torch.as_tensor(behaviour, dtype=torch.float32).detach()
    if cur.shape != beh.shape:
        raise ValueError(f'current logprobs have shape {tuple(cur.shape)}, behaviour {tuple(beh.shape)}')
    return cur, beh


def ratios(current: Any, behaviour: Any) -> Any:
    """``exp(current - behaviour)`` per token."""
    cur, beh = _tensors(current, behaviour)
    return (cur - beh).exp()


def truncated_is(current: Any, behaviour: Any, cap: float = 2.0) -> Any:
    """Token-level truncated importance weights ``min(ratio, cap)``."""
    if cap <= 0:
        raise ValueError(f'cap must be > 0, not {cap!r}')
    return ratios(current, behaviour).clamp(max=cap)


def geometric_sequence_weight(current: Any, behaviour: Any, mask: Any, sample_index: Any = None) -> Any:
    """The geometric mean of the ratios over the mask-1 tokens of each sequence (``1`` for one
    without any): one weight per row, or, with ``sample_index`` (packed rows: which sample each
    position holds, ``-1`` for padding), each position its own sample's weight."""
    import torch

    cur, beh = _tensors(current, behaviour)
    m = torch.as_tensor(mask, dtype=torch.float32)
    if m.shape != cur.shape:
        raise ValueError(f'mask has shape {tuple(m.shape)}, logprobs {tuple(cur.shape)}')
    log_ratio = (cur - beh) * m
    if sample_index is None:
        count = m.sum(-1)
        return torch.where(count > 0, (log_ratio.sum(-1) / count.clamp(min=1)).exp(), torch.ones_like(count))
    index = torch.as_tensor(sample_index, dtype=torch.long)
    slots = index.clamp(min=0).flatten()
    n = int(index.max().item()) + 1 if index.numel() else 0
    sums = torch.zeros(max(n, 1)).index_add(0, slots, log_ratio.flatten())
    count = torch.zeros(max(n, 1)).index_add(0, slots, m.flatten())
    per_sample = torch.where(count > 0, (sums / count.clamp(min=1)).exp(), torch.ones_like(count))
    return torch.where(index >= 0, per_sample[index.clamp(min=0)], torch.ones_like(cur))


def keep_within(current: Any, behaviour: Any, upper: float = 2.0, lower: Optional[float] = None) -> Any:
    """``1.0`` where the ratio is in ``[lower, upper]`` (``lower`` default ``1 / upper``), else ``0.0``."""
    lower = 1.0 / upper if lower is None else lower
    if not 0 <= lower <= upper:
        raise ValueError(f'need 0 <= lower <= upper, got lower={lower!r}, upper={upper!r}')
    r = ratios(current, behaviour)
    return ((r >= lower) & (r <= upper)).float()


def behaviour_logprobs(logp: Any, batch: Any) -> Any:
    """The rollout's logprob of each token where its sample has them (``batch['has_logprobs']``),
    else the trainer's own, detached: every correction then gives such a token ratio 1, so a
    sample without rollout logprobs is trained without the correction rather than weighted
    against the 0.0 its row holds (``exp(logp - 0)``: its own probability)."""
    import torch

    known = batch.get('has_logprobs')
    if known is None:  # a batch built by hand, without the flag: every logprob is a rollout's
        return batch['logprobs']
    return torch.where(known.bool(), batch['logprobs'], logp.detach())


def uncorrected_samples(samples: Any, corrects: bool, missing_logprobs: str) -> list:
    """The samples with trained tokens and no rollout logprobs (trained without the correction);
    with ``missing_logprobs='refuse'`` and a correction asked (``corrects``), a step holding one is
    refused (:class:`~mtflow.train.errors.SampleError` naming the first and the count)."""
    if missing_logprobs not in MISSING_LOGPROBS:
        raise ValueError(f'missing_logprobs must be one of {MISSING_LOGPROBS}, not {missing_logprobs!r}')
    uncorrected = [s for s in samples if s.logprobs is None and s.trained_tokens]
    if uncorrected and corrects and missing_logprobs == 'refuse':
        first = uncorrected[0]
        raise SampleError(f'no rollout logprobs ({len(uncorrected)} of {len(samples)} samples have none): the '
                          "importance correction asked for cannot be made (missing_logprobs='uncorrected' trains "
                          'them without it)', uuid=first.uuid, turn=first.turns[0], field='rollout_logprobs')
    return uncorrected
