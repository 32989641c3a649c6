"""Which turn sampled each token of a sample, and with which policy version.

A sample's completion is its assistant messages with the glue between them. A trainer that
credits turns (per-turn rewards, discounted returns) or withholds stale tokens needs each trained
token's turn, which needs to know where each turn's tokens are:

* one assistant message per turn (no continuations): message ``k`` is turn ``first + k``, every id
  of it sampled by that turn;
* continuations (several turns in one message, observations between them with mask 0): each
  maximal run of trained tokens is one turn, which holds only when there are exactly as many runs
  as turns.

Otherwise the turns cannot be placed (:func:`token_turns` returns ``None``). Versions come from
the per-turn stamps (``rollout_infos['policy_versions']``; a generation cut by an update and
resumed also has ``rollout_infos['policy_version_segments']``: ``[start, end, version]`` within
the turn's sampled ids); when the turns cannot be placed but all share one version, every trained
token has it, and otherwise :func:`token_versions` refuses
(:class:`~mtflow.train.errors.SampleError` naming the request and the segment's first turn) rather
than guess. Glue and untrained observation ids get ``None``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from mtflow.train.errors import SampleError

__all__ = ['token_turns', 'token_versions']


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


def token_turns(segment: Dict[str, Any], loss_mask: Sequence[int], turns: Tuple[int, int]) -> Optional[List[Optional[int]]]:
    """The turn of each token of one context ``segment`` (the ``segments_of`` dict), aligned with
    its flattened completion (``None`` on glue and untrained observations); ``None`` when the turns
    cannot be placed (see the module docstring)."""
    first, last = turns
    messages = segment.get('response_token_ids') or []
    ranges = _message_ranges(messages, segment.get('glue_ids') or [])
    if len(messages) == last - first + 1:
        spans, trained_only = ranges, False
    else:
        spans, trained_only = _trained_runs(loss_mask, ranges), True
        if len(spans) != last - first + 1:
            return None
    out: List[Optional[int]] = [None] * len(loss_mask)
    for j, (start, end) in enumerate(spans):
        for k in range(start, end):
            if not trained_only or loss_mask[k]:
                out[k] = first + j
    return out


def token_versions(segment: Dict[str, Any], loss_mask: Sequence[int], infos: Dict[str, Any], uuid: str,
                   turns: Tuple[int, int], placed: Optional[List[Optional[int]]]) -> Optional[List[Optional[int]]]:
    """Per-token versions of one context ``segment`` (``placed``: its :func:`token_turns`);
    ``None`` when the turns were not stamped (no version was set, or a turn came in as a
    ``first_turn_outputs`` entry)."""
    stamps = infos.get('policy_versions')
    first, last = turns
    if not stamps or len(stamps) < last:
        return None
    here = [int(v) for v in stamps[first - 1:last]]
    resumed = {int(e['turn']): e['segments'] for e in infos.get('policy_version_segments') or []}
    if placed is None:
        if len(set(here)) == 1 and not any(first <= t <= last for t in resumed):
            return [here[0] if m else None for m in loss_mask]
        runs = len(_trained_runs(loss_mask, _message_ranges(segment.get('response_token_ids') or [],
                                                            segment.get('glue_ids') or [])))
        raise SampleError(
            f'turns {first}-{last} were sampled by versions {here} but share assistant messages, and their trained '
            f'tokens form {runs} runs, not one per turn: the version of each token cannot be placed', uuid=uuid,
            turn=first, field='policy_versions')
    out = [None if t is None else int(stamps[t - 1]) for t in placed]
    for turn, parts in resumed.items():  # a resumed turn: each part's own version
        if not first <= turn <= last or turn not in placed:
            continue
        start = placed.index(turn)
        for lo, hi, version in parts:
            for k in range(start + int(lo), min(start + int(hi), len(out))):
                if placed[k] == turn:
                    out[k] = int(version)
    return out
