"""The policy version of every token of a sample, from the per-turn stamps of a trajectory.

The drivers stamp each generated turn with the version that sampled it
(``rollout_infos['policy_versions']``, one int per turn; a generation cut by an update and
resumed also has ``rollout_infos['policy_version_segments']``: ``[start, end, version]`` spans
within the turn's sampled ids). A trainer that withholds or reweights stale tokens needs them per
token, which needs to know where each turn's tokens are in the sample:

* one assistant message per turn (no continuations): message ``k`` is turn ``first + k``, every id
  of it sampled by that turn;
* continuations (several turns in one message, observations between them with mask 0): when all
  those turns share one version, every trained token has it; otherwise each maximal run of trained
  tokens is one turn, which holds only when there are exactly as many runs as turns.

Anything else is refused (:class:`~mtflow.train.errors.SampleError` naming the request and the
segment's first turn) rather than guessed. Glue and untrained observation ids get ``None``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from mtflow.train.errors import SampleError

__all__ = ['token_versions']


def _message_ranges(messages: Sequence[Sequence[int]], glue: Sequence[Sequence[int]]) -> List[Tuple[int, int]]:
    """``[start, end)`` of each assistant message in the flattened completion (glue between)."""
    ranges, offset = [], 0
    for k, ids in enumerate(messages):
        ranges.append((offset, offset + len(ids)))
        offset += len(ids) + (len(glue[k]) if k < len(glue) else 0)
    return ranges


def _trained_runs(mask: Sequence[int], ranges: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """Maximal runs of mask-1 tokens, never across a message boundary."""
    runs = []
    for start, end in ranges:
        k = start
        while k < end:
            if mask[k]:
                j = k
                while j < end and mask[j]:
                    j += 1
                runs.append((k, j))
                k = j
            else:
                k += 1
    return runs


def token_versions(segment: Dict[str, Any], loss_mask: Sequence[int], infos: Dict[str, Any], uuid: str,
                   turns: Tuple[int, int]) -> Optional[List[Optional[int]]]:
    """Per-token versions of one context ``segment`` (the ``segments_of`` dict), aligned with its
    flattened completion; ``None`` when the turns were not stamped (no version was set, or a turn
    came in as a ``first_turn_outputs`` entry)."""
    stamps = infos.get('policy_versions')
    first, last = turns
    if not stamps or len(stamps) < last:
        return None
    versions_here = [int(v) for v in stamps[first - 1:last]]
    resumed = {int(e['turn']): e['segments'] for e in infos.get('policy_version_segments') or []}
    messages = segment.get('response_token_ids') or []
    ranges = _message_ranges(messages, segment.get('glue_ids') or [])
    out: List[Optional[int]] = [None] * len(loss_mask)
    if len(messages) == len(versions_here):
        spans = ranges
        mask_only = False
    elif len(set(versions_here)) == 1 and not any(first <= t <= last for t in resumed):
        for start, end in ranges:
            for k in range(start, end):
                if loss_mask[k]:
                    out[k] = versions_here[0]
        return out
    else:
        spans = _trained_runs(loss_mask, ranges)
        mask_only = True
        if len(spans) != len(versions_here):
            raise SampleError(
                f'turns {first}-{last} were sampled by versions {versions_here} but share assistant messages, and '
                f'their trained tokens form {len(spans)} runs, not one per turn: the version of each token cannot '
                'be placed', uuid=uuid, turn=first, field='policy_versions')
    for j, (start, end) in enumerate(spans):
        turn = first + j
        for k in range(start, end):
            if not mask_only or loss_mask[k]:
                out[k] = versions_here[j]
        for lo, hi, version in resumed.get(turn, ()):  # a resumed turn: each part's own version
            for k in range(start + int(lo), min(start + int(hi), end)):
                out[k] = int(version)
    return out
