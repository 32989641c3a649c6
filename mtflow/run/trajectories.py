"""Trajectory files: the companion of a trace file, one JSON line per finished request.

A trace (``mtflow/core/trace.py``) says *which states* each request went through; it deliberately
carries no messages or tokens (it must stay cheap enough to record always). The viewer's detail
view needs the conversation and the token-level loss mask, so ``mtflow run`` (and anyone else)
writes them here, keyed by the same ``uuid`` as the trace. Format: ``docs/trace-format.md``.

Writing::

    result = Executor(scheduler, rollout_fn).run(requests)
    result.trace.write_jsonl('trace.jsonl')
    write_trajectories('trajectories.jsonl', trajectories_from_result(result, requests))

Reading: :func:`read_trajectories` returns ``{uuid: Trajectory}``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from mtflow.core.trace import open_text
from mtflow.data.sources import group_of

#: Keys of one line, in the order they are written. ``reward``, ``group`` and ``reference`` come
#: first after the ids so that a reader (``head``, ``jq``, the viewer) finds them without digging
#: into ``rollout_infos``; every ms-swift field follows unchanged.
TRAJECTORY_FIELDS = ('uuid', 'index', 'rank', 'finish_reason', 'num_turns', 'reward', 'group', 'reference',
                     'messages', 'response_token_ids', 'response_loss_mask', 'rollout_logprobs', 'rollout_infos')

#: ``data_dict`` keys read as the reference answer when the scheduler names none (its YAML
#: ``answer.field``), first found wins: reasoning-gym's ``answer``, the answer section's default
#: ``solution``, the guess-the-number game's ``target``, and the names verl and TRL datasets use.
REFERENCE_KEYS = ('answer', 'solution', 'target', 'reference', 'ground_truth')


def reward_of(infos: Any) -> Optional[float]:
    """The request's reward: ``rollout_infos['reward']`` when it is a number (a bool is not)."""
    reward = infos.get('reward') if isinstance(infos, dict) else None
    if isinstance(reward, (int, float)) and not isinstance(reward, bool):
        return float(reward)
    return None


def reference_field(scheduler: Any) -> Optional[str]:
    """The ``data_dict`` key a scheduler compares answers with (a YAML scheduler's
    ``answer.field``), or ``None``."""
    config = getattr(getattr(scheduler, 'answers', None), 'config', None)
    field_name = getattr(config, 'field', None)
    return field_name if isinstance(field_name, str) else None


def reference_of(request: Any, field_name: Optional[str] = None) -> Any:
    """The dataset's reference answer for one request: ``data_dict[field_name]``, else the first
    of :data:`REFERENCE_KEYS` it has, else ``None``. A ``field_name`` that holds a mapping is what
    a verifier reads, not the answer (reasoning-gym's ``answer.field: reasoning_gym``, the task
    spec ``score_answer`` regenerates the task from): a :data:`REFERENCE_KEYS` key goes first then."""
    data = getattr(request, 'data_dict', None) or {}
    if not isinstance(data, dict):
        return None
    named = (field_name, ) if field_name and field_name in data else ()
    structured = bool(named) and isinstance(data[field_name], dict)
    keys = (REFERENCE_KEYS + named) if structured else (named + REFERENCE_KEYS)
    for key in keys:
        if key in data:
            return data[key]
    return None


@dataclass
class Trajectory:
    """One finished request: its conversation and the token segments a trainer sees."""
    uuid: str
    index: int = -1
    rank: int = 0
    finish_reason: Optional[str] = None
    num_turns: Optional[int] = None
    #: ``rollout_infos['reward']`` when numeric (``None``: the scheduler gives none)
    reward: Optional[float] = None
    #: the prompt's id, shared by its ``num_generations`` copies (a GRPO group; verl's ``uid``)
    group: Optional[str] = None
    #: the dataset's answer for this prompt (:func:`reference_of`), or ``None``
    reference: Any = None
    messages: List[Dict[str, Any]] = field(default_factory=list)
    response_token_ids: List[List[int]] = field(default_factory=list)
    response_loss_mask: List[List[int]] = field(default_factory=list)
    rollout_logprobs: List[List[float]] = field(default_factory=list)
    rollout_infos: Dict[str, Any] = field(default_factory=dict)
    #: keys of the line this reader does not know (kept so that nothing is lost on a rewrite)
    extra: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        d = {k: getattr(self, k) for k in TRAJECTORY_FIELDS}
        d.update(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> 'Trajectory':
        if not isinstance(d, dict):
            raise ValueError(f'expected a JSON object, got {type(d).__name__}')
        if 'uuid' not in d:
            raise ValueError('trajectory is missing uuid')
        for key in ('response_token_ids', 'response_loss_mask', 'rollout_logprobs'):
            value = d.get(key)
            if value is not None and not (isinstance(value, list) and all(isinstance(s, list) for s in value)):
                raise ValueError(f'field {key!r} must be a list of segments (lists), got {value!r:.80}')
        messages = d.get('messages') or []
        if not isinstance(messages, list):
            raise ValueError(f"field 'messages' must be a list, got {type(messages).__name__}")
        infos = d.get('rollout_infos') or {}
        reward = d.get('reward') if 'reward' in d else reward_of(infos)  # files written before the field
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise ValueError(f"field 'reward' must be a number or null, got {reward!r:.80}")
        return cls(
            uuid=str(d['uuid']),
            index=int(d.get('index', -1) if d.get('index') is not None else -1),
            rank=int(d.get('rank') or 0),
            finish_reason=d.get('finish_reason'),
            num_turns=d.get('num_turns'),
            reward=reward,
            group=str(d['group']) if d.get('group') is not None else group_of(str(d['uuid'])),
            reference=d.get('reference'),
            messages=messages,
            response_token_ids=d.get('response_token_ids') or [],
            response_loss_mask=d.get('response_loss_mask') or [],
            rollout_logprobs=d.get('rollout_logprobs') or [],
            rollout_infos=infos,
            extra={k: v for k, v in d.items() if k not in TRAJECTORY_FIELDS})

    def masks(self) -> List[List[int]]:
        """The loss mask per segment; a missing mask means every token is trained (the contract)."""
        if self.response_loss_mask:
            return self.response_loss_mask
        return [[1] * len(seg) for seg in self.response_token_ids]


def trajectory_from_output(output: Any, uuid: str, *, index: int = -1, rank: int = 0,
                           finish_reason: Optional[str] = None, request: Any = None,
                           reference_key: Optional[str] = None) -> Trajectory:
    """A :class:`Trajectory` from one ``RolloutOutput`` (mtflow's or ms-swift's: read by attribute).
    ``request`` (the input request) gives the group and the reference answer from its
    ``data_dict`` (``reference_key``: the scheduler's answer field); without it the group is the
    uuid without its ``#k`` copy suffix."""
    infos = dict(getattr(output, 'rollout_infos', None) or {})
    messages = getattr(output, 'messages', None) or []
    data = getattr(request, 'data_dict', None) if request is not None else None
    return Trajectory(
        uuid=uuid,
        index=index,
        rank=rank,
        finish_reason=finish_reason,
        num_turns=infos.get('num_turns'),
        reward=reward_of(infos),
        group=group_of(uuid, data if isinstance(data, dict) else None),
        reference=reference_of(request, reference_key) if request is not None else None,
        messages=[dict(m) for m in messages],
        response_token_ids=[list(s) for s in getattr(output, 'response_token_ids', None) or []],
        response_loss_mask=[list(s) for s in getattr(output, 'response_loss_mask', None) or []],
        rollout_logprobs=[list(s) for s in getattr(output, 'rollout_logprobs', None) or []],
        rollout_infos=infos)


def finished_to_record(finished: Any, *, index: Optional[int] = None, rank: int = 0, t_offset: float = 0.0,
                       request: Any = None,
                       reference_key: Optional[str] = None) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """A trajectory dict and its trace-event dicts from one finished request (an
    ``mtflow.FinishedRequest``, or anything with ``uuid``, ``index``, ``output``,
    ``finish_reason`` and ``events``). ``index`` (default: the record's) replaces the batch
    index (a run numbers requests across batches by dataset position); ``t_offset`` is added to
    event times (seconds from the run's start to the batch's start); ``request`` (the input) and
    ``reference_key`` give the line its group and reference (:func:`trajectory_from_output`)."""
    idx = finished.index if index is None else index
    traj = trajectory_from_output(finished.output, str(finished.uuid), index=idx, rank=rank,
                                  finish_reason=finished.finish_reason, request=request,
                                  reference_key=reference_key)
    parent = getattr(finished, 'parent', None)
    if parent is not None:  # a fork's child (docs/branching.md): the line names the request it was forked from
        traj.extra['parent'] = parent
    events = []
    for e in getattr(finished, 'events', None) or ():
        d = e.to_dict() if not isinstance(e, dict) else dict(e)
        d['index'] = idx
        if d.get('t') is not None:
            d['t'] = round(d['t'] + t_offset, 6)
        events.append(d)
    return traj.to_dict(), events


def trajectories_from_result(result: Any, requests: Optional[Sequence[Any]] = None, *,
                             rank: Optional[int] = None) -> List[Trajectory]:
    """One :class:`Trajectory` per request of an :class:`mtflow.RunResult` (input order).

    The uuid of request ``i`` is taken from the run's trace when it has one (so the two files
    always agree), else from ``requests[i].uuid``, else ``'#i'`` (the executor's own fallback)."""
    by_index: Dict[int, str] = {}
    ranks: Dict[int, int] = {}
    trace = getattr(result, 'trace', None)
    if trace is not None:
        for e in trace.events:
            by_index.setdefault(e.index, e.uuid)
            ranks.setdefault(e.index, e.rank)
    out = []
    for i, (output, reason) in enumerate(zip(result.outputs, result.finish_reasons)):
        uuid = by_index.get(i)
        if uuid is None:
            req_uuid = getattr(requests[i], 'uuid', None) if requests is not None and i < len(requests) else None
            uuid = str(req_uuid) if req_uuid else f'#{i}'
        request = requests[i] if requests is not None and i < len(requests) else None
        out.append(trajectory_from_output(output, uuid, index=i, rank=ranks.get(i, 0) if rank is None else rank,
                                          finish_reason=reason, request=request))
    return out


def write_trajectories(dest: Union[str, Path, IO[str]], trajectories: Iterable[Trajectory]) -> int:
    """Write one JSON line per trajectory (a path ending in ``.gz`` is gzipped); return the count.
    Pass an open file (``open(p, 'a')``) to append batch after batch."""
    if isinstance(dest, (str, Path)):
        with open_text(dest, 'w') as f:
            return write_trajectories(f, trajectories)
    n = 0
    for traj in trajectories:
        dest.write(json.dumps(traj.to_dict(), ensure_ascii=False, default=str) + '\n')
        n += 1
    return n


def iter_trajectories(src: Union[str, Path, IO[str]]) -> Iterator[Trajectory]:
    """Read a trajectories file line by line; a bad line raises ``ValueError('<file>:<line>: ...')``."""
    if isinstance(src, (str, Path)):
        with open_text(src, 'r') as f:
            yield from _read(f, str(src))
        return
    yield from _read(src, getattr(src, 'name', '<stream>'))


def _read(lines: Iterable[str], name: str) -> Iterator[Trajectory]:
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield Trajectory.from_dict(json.loads(line))
        except (ValueError, TypeError) as exc:
            raise ValueError(f'{name}:{lineno}: not a trajectory: {exc}') from exc


def read_trajectories(src: Union[str, Path, IO[str]]) -> Dict[str, Trajectory]:
    """``{uuid: Trajectory}``, in file order (a later line with the same uuid wins)."""
    return {t.uuid: t for t in iter_trajectories(src)}
