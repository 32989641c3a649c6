"""The trainer's side of bounded staleness: what becomes of tokens sampled by weights too old.

A stream (``Executor.stream``) stamps every turn with the version that sampled it; its own
``max_staleness`` restarts or drops whole groups before delivery. Both throw work away, and
dropping starves the slow problems (their groups are the ones that go stale), so the trainer may
prefer to keep a stale group and decide at training time, against the version it is about to
update, with :class:`StalePolicy` (run the stream with ``max_staleness=None`` then):

* ``'withhold'``: a stale sample stays in the batch with its trained tokens masked out (loss mask
  0), so its reward still moves its group's baseline (:func:`mtflow.train.advantages.assign_advantages`
  sees it) while no gradient flows through tokens the current policy is too far from;
* ``'drop'``: a stale sample leaves the batch (its reward leaves the baseline too);
* ``'keep'``: trained as it is (the importance weights of :mod:`mtflow.train.weights` correct it).

A token is stale when ``current_version - its version > max_staleness``; with
``granularity='sample'`` (default) a sample is stale when any of its trained tokens is (the
stream's rule: the oldest turn counts), with ``'token'`` only its stale tokens are withheld (the
later turns of a long trajectory, sampled by newer weights, still train). :attr:`StalePolicy.counts`
adds up what was withheld, dropped and kept, for the trainer's summary.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence

from mtflow.train.errors import SampleError
from mtflow.train.samples import Sample

__all__ = ['STALE_POLICIES', 'GRANULARITIES', 'StaleCounts', 'StalePolicy', 'stale_positions']

STALE_POLICIES = ('withhold', 'drop', 'keep')
GRANULARITIES = ('sample', 'token')


@dataclass
class StaleCounts:
    """What a stale policy did, summed over its calls."""
    samples: int = 0
    stale_samples: int = 0
    withheld_samples: int = 0
    withheld_tokens: int = 0
    dropped_samples: int = 0
    dropped_tokens: int = 0
    kept_stale_samples: int = 0

    def to_dict(self) -> Dict[str, int]:
        return asdict(self)


def stale_positions(sample: Sample, current_version: int, max_staleness: int) -> List[int]:
    """The positions of ``sample``'s trained tokens that are more than ``max_staleness`` versions
    behind ``current_version``."""
    if sample.versions is None:
        raise SampleError('no policy versions were stamped on its turns, so its staleness is unknown (call '
                          'executor.set_policy_version, or use a stream)', uuid=sample.uuid, turn=sample.turns[0],
                          field='policy_versions')
    return [k for k, (m, v) in enumerate(zip(sample.loss_mask, sample.versions))
            if m and v is not None and current_version - v > max_staleness]


class StalePolicy:
    """``max_staleness`` and what to do beyond it (see the module docstring)."""

    def __init__(self, max_staleness: int, stale: str = 'withhold', granularity: str = 'sample') -> None:
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f'max_staleness must be an int >= 0, not {max_staleness!r}')
        if stale not in STALE_POLICIES:
            raise ValueError(f'stale must be one of {STALE_POLICIES}, not {stale!r}')
        if granularity not in GRANULARITIES:
            raise ValueError(f'granularity must be one of {GRANULARITIES}, not {granularity!r}')
        if granularity == 'token' and stale != 'withhold':
            raise ValueError("granularity='token' is for stale='withhold' (a sample is dropped or kept whole)")
        self.max_staleness = max_staleness
        self.stale = stale
        self.granularity = granularity
        self.counts = StaleCounts()

    def apply(self, samples: Sequence[Sample], current_version: int) -> List[Sample]:
        """The batch to train on at ``current_version``: stale samples withheld (new copies with
        their masks zeroed), dropped or kept; the others unchanged."""
        out: List[Sample] = []
        c = self.counts
        for s in samples:
            c.samples += 1
            stale = stale_positions(s, current_version, self.max_staleness)
            if not stale:
                out.append(s)
                continue
            c.stale_samples += 1
            if self.stale == 'keep':
                c.kept_stale_samples += 1
                out.append(s)
            elif self.stale == 'drop':
                c.dropped_samples += 1
                c.dropped_tokens += s.trained_tokens
            else:
                cut = set(stale) if self.granularity == 'token' else {k for k, m in enumerate(s.loss_mask) if m}
                keep = [0 if k in cut else m for k, m in enumerate(s.loss_mask)]
                c.withheld_samples += 1
                c.withheld_tokens += len(cut)
                out.append(s.masked(keep, len(cut)))
        return out
