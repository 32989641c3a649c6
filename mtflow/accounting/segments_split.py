"""Training segments: one trajectory that was compacted becomes several exact-id samples.

After a compaction the next prompt is no longer a prefix of the ids the model saw before, so
the trajectory cannot be one training sample: ``prompt_ids + response_ids`` would be a sequence
the model never conditioned on. Each stretch between compactions is its own *segment*: the
prompt ids it started from and the ids generated after them, exactly as the token record kept
them. :func:`cut_segment` closes the current segment when a compaction happens (the engine calls
it from the ``compacting`` state); the last segment is the output's own fields, unchanged, so a
trajectory that never compacted is the single sample it always was.

The earlier segments travel in ``rollout_infos['context_segments']`` (the output's shape per
segment: ``prompt_ids``, ``response_token_ids``, ``response_loss_mask``, ``rollout_logprobs``,
``glue_ids``); :func:`training_samples` turns an output (or a trajectory line) into one flat
sample per segment, linked by uuid and segment index and sharing the reward (``docs/context.md``).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

from mtflow.core.machine import RequestRecord
from mtflow.accounting.token_record import RECORD_ATTR, TokenRecord, record_of

__all__ = ['SEGMENTS_KEY', 'cut_segment', 'detach_record', 'segments_of', 'training_samples', 'flat_sample']

#: the ``rollout_infos`` key of the segments closed by compactions (all but the last)
SEGMENTS_KEY = 'context_segments'


def _record_segment(record: RequestRecord) -> Optional[Dict[str, Any]]:
    """The current segment from the request's token record, when it describes exactly the
    turns since the last cut (the rules of :class:`~mtflow.accounting.token_record.RecordAccounting`)."""
    rec = record_of(record.request)
    if rec is None or rec.restarted or not rec.turns:
        return None
    if len(rec.turns) != record.turns - record.segment_start:
        return None
    if record.choice is not None and list(record.choice.token_ids or []) != rec.turns[-1].sampled:
        return None
    ids, mask, logprobs, glue = rec.segments()
    if len(record.mask) == len(mask) and all(len(a) == len(b) for a, b in zip(record.mask, mask)):
        mask = [list(m) for m in record.mask]  # the scheduler said what to train
    return {'prompt_ids': rec.prompt_ids, 'response_token_ids': ids, 'response_loss_mask': mask,
            'rollout_logprobs': logprobs, 'glue_ids': glue, 'exact': rec.exact}


def cut_segment(record: RequestRecord, exact_ids: bool, ended_by: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Close the current segment of ``record`` (a compaction is about to rewrite its messages):
    its ids, mask and logprobs (from the token record when ``exact_ids`` and the record holds
    exactly these turns, else the accounting's own), kept in ``rollout_infos['context_segments']``;
    the record then starts a new segment (no ids yet; the request's token record emptied,
    :func:`detach_record`, so the backend renders the compacted prompt afresh instead of marking
    the record restarted).
    ``ended_by``: what ended the segment (a step's ``new_segment`` dict), kept under that key."""
    segments = record.infos.setdefault(SEGMENTS_KEY, [])
    index = len(segments)
    seg = _record_segment(record) if exact_ids else None
    if seg is None:
        seg = {'prompt_ids': None, 'response_token_ids': [list(s) for s in record.ids],
               'response_loss_mask': [list(s) for s in record.mask],
               'rollout_logprobs': [list(s) for s in record.logprobs], 'glue_ids': None, 'exact': False}
    seg = {'segment': index, 'turns': [record.segment_start + 1, record.turns], **seg,
           'messages': copy.deepcopy(list(record.request.messages))}
    if ended_by is not None:
        seg['ended_by'] = dict(ended_by)
    segments.append(seg)
    record.ids, record.mask, record.logprobs = [], [], []
    record.segment_start = record.turns
    detach_record(record.request, record.turns + 1)
    return seg


def detach_record(request: Any, first_turn: int = 1) -> None:
    """Give ``request`` an empty token record whose first turn is ``first_turn``: its next turn
    starts a new exact record, rendered from its messages (not matched against the record the
    backend keeps for its uuid, which a rewritten history could otherwise seem to extend, and mark
    restarted)."""
    try:
        setattr(request, RECORD_ATTR, TokenRecord(first_turn=first_turn))
    except (AttributeError, TypeError, ValueError):  # a frozen request: the backend renders from text
        pass


def segments_of(output: Any) -> List[Dict[str, Any]]:
    """Every segment of an output or a trajectory line (a dict), in order: the ones compactions
    closed, then the output's own fields as the last (``segment`` = their count)."""

    def get(name: str) -> Any:
        return output.get(name) if isinstance(output, dict) else getattr(output, name, None)

    infos = get('rollout_infos') or {}
    earlier = [dict(s) for s in infos.get(SEGMENTS_KEY) or []]
    summary = infos.get('token_record') or {}
    last = {'segment': len(earlier), 'turns': [earlier[-1]['turns'][1] + 1 if earlier else 1, infos.get('num_turns')],
            'prompt_ids': summary.get('prompt_ids'), 'response_token_ids': get('response_token_ids') or [],
            'response_loss_mask': get('response_loss_mask') or [], 'rollout_logprobs': get('rollout_logprobs') or [],
            'glue_ids': summary.get('glue_ids'), 'exact': bool(summary.get('exact', False)) if summary else False,
            'messages': get('messages')}
    return earlier + [last]


def flat_sample(segment: Dict[str, Any]) -> Dict[str, Any]:
    """One segment as a plain training sample: ``prompt_ids``, then ``response_ids`` (each
    assistant message's ids with the glue between them, exactly the sequence the model saw),
    ``loss_mask`` aligned with them (glue 0), and ``logprobs`` of the sampled (mask 1) tokens."""
    ids: List[int] = []
    mask: List[int] = []
    glue = segment.get('glue_ids') or []
    for k, (seg_ids, seg_mask) in enumerate(zip(segment['response_token_ids'], segment['response_loss_mask'])):
        ids += seg_ids
        mask += seg_mask
        if k < len(glue):
            ids += glue[k]
            mask += [0] * len(glue[k])
    logprobs = [v for seg in segment.get('rollout_logprobs') or [] for v in seg]
    return {'segment': segment['segment'], 'turns': segment['turns'], 'prompt_ids': segment.get('prompt_ids'),
            'response_ids': ids, 'loss_mask': mask, 'logprobs': logprobs, 'exact': segment.get('exact', False)}


def training_samples(output: Any, uuid: Optional[str] = None, reward: Any = None) -> List[Dict[str, Any]]:
    """The flat samples of every segment of ``output``, each with ``uuid``, ``segment``,
    ``segments`` (their count) and the trajectory's ``reward`` (shared by all of them)."""
    if isinstance(output, dict):
        uuid = uuid if uuid is not None else output.get('uuid')
        reward = reward if reward is not None else output.get('reward')
    segments = segments_of(output)
    return [{'uuid': uuid, 'segments': len(segments), 'reward': reward, **flat_sample(s)} for s in segments]
