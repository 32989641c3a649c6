"""Sampling in the HF backend with one random generator per request.

``model.generate(do_sample=True)`` draws every row of a batch from torch's one global generator,
so what a request samples depends on which requests shared its batch and in which order: the same
seed gave other trajectories with ``batch_size`` 4 than with 16. Here each row draws from its own
``torch.Generator`` seeded with the request's sampling seed
(:func:`mtflow.core.seeds.sampling_seed`): the last logits processor of a greedy ``generate``
applies transformers' own warpers (temperature, top-k, top-p, min-p, in ``generate``'s order),
samples each row from the result with its generator (``torch.multinomial``, as ``generate``
does), and leaves only the sampled token, which the greedy step then takes. Rows that are padding
in a batch change nothing for the others. The distribution sampled from is kept per step, for
``logprobs_mode='processed'``.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

__all__ = ['RowSampler', 'row_seeds']


def row_seeds(seeds: Optional[Sequence[Optional[int]]], rows: int) -> List[int]:
    """A seed per row: the given ones, and for a row without one a draw from torch's global
    generator (seeded once by ``HFBackend(seed=...)``, else not reproducible)."""
    import torch

    given = list(seeds) if seeds is not None else [None] * rows
    return [int(s) if s is not None else int(torch.randint(0, 2 ** 31 - 1, ()).item()) for s in given]


class RowSampler:
    """A ``LogitsProcessor`` that samples each row with its own generator (module docstring).

    Args:
        seeds: one per row of the batch.
        temperature, top_k, top_p, min_p: the sampling options (``top_k`` 0: off).
        keep: keep each step's log-distribution sampled from (:attr:`steps`).
    """

    def __init__(self, seeds: Sequence[int], temperature: float, top_k: int, top_p: float, min_p: float,
                 keep: bool = False) -> None:
        from transformers import LogitsProcessorList
        from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                            TopKLogitsWarper, TopPLogitsWarper)

        warpers: List[Any] = []
        if temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            warpers.append(TopKLogitsWarper(top_k=top_k))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=top_p))
        if min_p:
            warpers.append(MinPLogitsWarper(min_p=min_p))
        self.warpers = LogitsProcessorList(warpers)
        self.seeds = list(seeds)
        self.generators: Optional[List[Any]] = None  # made on the first step, on the logits' device
        self.keep = keep
        #: per step, the ``(rows, vocab)`` log-probabilities sampled from (``keep=True``)
        self.steps: List[Any] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        if self.generators is None:
            self.generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        logp = torch.log_softmax(self.warpers(input_ids, scores).float(), dim=-1)
        probs = logp.exp()
        chosen = torch.cat([torch.multinomial(probs[row], 1, generator=g) for row, g in enumerate(self.generators)])
        if self.keep:
            self.steps.append(logp)
        only = torch.full_like(scores, float('-inf'))
        return only.scatter_(1, chosen[:, None], 0.0)
