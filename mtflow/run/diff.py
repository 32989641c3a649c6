"""Comparing two runs request by request, turn by turn, in constant memory (``mtflow diff``).

Requests are matched by ``uuid``. For each pair the first turn where they differ is found, with
what differs there: the model's ``text``, its ``token_ids`` (with the first differing position),
the ``observation`` that followed it (the tool, user or environment messages before the next
model turn), the step's ``reward`` (an environment's per-step ``rewards``); and, over the whole
request, the ``finish_reason``, the number of turns (``num_turns``), the final ``reward``, what a
trainer gets (``trained``: ``response_token_ids``, ``response_loss_mask``, ``rollout_logprobs``;
shown as digests, with the first differing id) and the backend's exact-id ``token_record``
(``rollout_infos.token_record``: the prompt ids each turn was generated from).

Memory: run B is indexed once (uuid -> byte offset of its line), run A streamed; a line of B is
read back when its uuid comes up, so only one pair of trajectories and the index are held, and
the per-group reward sums (``num_generations`` copies share ``<uuid>#<k>``'s prefix).

Rewards are read through :func:`reward_of`, the one place that knows where a line keeps them.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from mtflow.run.files import TRAJECTORIES
from mtflow.run.turn_log import expand_turns

__all__ = ['FIELDS', 'index_lines', 'RequestDiff', 'DiffTotals', 'DiffRun', 'compare', 'trajectories_file', 'reward_of', 'turn_views',
           'group_of']

#: what can differ, in the order they are checked within a turn, then over the request
TURN_FIELDS = ('text', 'token_ids', 'observation', 'reward')
REQUEST_FIELDS = ('finish_reason', 'num_turns', 'final_reward', 'trained', 'token_record')
FIELDS = TURN_FIELDS + REQUEST_FIELDS


def reward_of(line: Dict[str, Any]) -> Optional[float]:
    """The reward of a trajectory line (today ``rollout_infos['reward']``), ``None`` without one."""
    value = (line.get('rollout_infos') or {}).get('reward')
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def step_rewards(line: Dict[str, Any]) -> List[Any]:
    """An environment's reward of each step (``rollout_infos['rewards']``), ``[]`` without."""
    value = (line.get('rollout_infos') or {}).get('rewards')
    return list(value) if isinstance(value, list) else []


def group_of(uuid: str) -> str:
    """The GRPO group of a uuid: ``p#2`` belongs to ``p`` (``docs/cli.md``)."""
    return uuid.rsplit('#', 1)[0] if '#' in uuid[1:] else uuid


def trajectories_file(path: Union[str, Path]) -> Path:
    """A run directory's ``trajectories.jsonl``, or the file itself."""
    p = Path(path)
    if p.is_dir():
        p = p / TRAJECTORIES
    if not p.is_file():
        raise FileNotFoundError(2, 'No such run directory or trajectories file', str(path))
    return p


def turn_views(line: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One dict per model turn: ``text``, ``token_ids``, ``observation`` (the contents of the
    messages after it and before the next model turn, as a list) and ``reward`` (the step's).

    From the line's ``turns`` when it has them (``mtflow/run/turn_log.py``), else from its
    assistant messages and token segments (one each per turn)."""
    messages = line.get('messages') or []
    assistant = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get('role') == 'assistant']
    turns = expand_turns(line)
    rewards = step_rewards(line)
    if not turns:
        segments = line.get('response_token_ids') or []
        turns = [{'text': messages[i].get('content'), 'token_ids': segments[k] if k < len(segments) else None}
                 for k, i in enumerate(assistant)]
    views = []
    for k, turn in enumerate(turns):
        if k < len(assistant):
            end = assistant[k + 1] if k + 1 < len(assistant) else len(messages)
            observation = [m.get('content') for m in messages[assistant[k] + 1:end] if isinstance(m, dict)]
        else:
            observation = []
        views.append({'text': turn.get('text'), 'token_ids': turn.get('token_ids'), 'observation': observation,
                      'reward': rewards[k] if k < len(rewards) else None})
    return views


@dataclass
class RequestDiff:
    """The first difference of one request: ``turn`` (from 1; for a request-level field, the
    last turn both have, or the one after it when their numbers of turns differ) and each field
    that differs there, with both values."""
    uuid: str
    turn: int
    fields: List[str]
    a: Dict[str, Any] = field(default_factory=dict)
    b: Dict[str, Any] = field(default_factory=dict)
    detail: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return {'uuid': self.uuid, 'turn': self.turn, 'fields': self.fields, 'a': self.a, 'b': self.b,
                **({'detail': self.detail} if self.detail else {})}


@dataclass
class DiffTotals:
    identical: int = 0
    different: int = 0
    only_in_a: int = 0
    only_in_b: int = 0
    #: group -> [sum A, count A, sum B, count B] of the final rewards of pairs
    groups: Dict[str, List[float]] = field(default_factory=dict)

    @property
    def same(self) -> bool:
        return not (self.different or self.only_in_a or self.only_in_b)

    def reward_changes(self) -> Dict[str, Dict[str, float]]:
        """Groups whose mean reward (over the members each run has) changed:
        ``{group: {a, b, change}}``."""
        out = {}
        for group, (sa, na, sb, nb) in sorted(self.groups.items()):
            if not na and not nb:
                continue
            ma, mb = (sa / na if na else 0.0), (sb / nb if nb else 0.0)
            if abs(ma - mb) > 1e-12:
                out[group] = {'a': round(ma, 6), 'b': round(mb, 6), 'change': round(mb - ma, 6)}
        return out

    def to_dict(self) -> Dict[str, Any]:
        return {'identical': self.identical, 'different': self.different, 'only_in_a': self.only_in_a,
                'only_in_b': self.only_in_b, 'reward_change_per_group': self.reward_changes()}


def _first_token_difference(a: Optional[Sequence[int]], b: Optional[Sequence[int]]) -> Dict[str, Any]:
    a, b = list(a or []), list(b or [])
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return {'position': i, 'a': x, 'b': y}
    return {'position': min(len(a), len(b)), 'a': a[len(b)] if len(a) > len(b) else None,
            'b': b[len(a)] if len(b) > len(a) else None}


def _short(value: Any, limit: int = 200) -> Any:
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + '...'
    if isinstance(value, list) and len(value) > 32:
        return value[:32] + ['...']
    return value


def compare(a: Dict[str, Any], b: Dict[str, Any], fields: Sequence[str] = FIELDS) -> Optional[RequestDiff]:
    """The first difference of two lines of one request, ``None`` when they agree on ``fields``."""
    uuid = str(a.get('uuid'))
    va, vb = turn_views(a), turn_views(b)
    turn_fields = [f for f in TURN_FIELDS if f in fields]
    for k in range(min(len(va), len(vb))):
        differ = [f for f in turn_fields if va[k][f] != vb[k][f]]
        if differ:
            diff = RequestDiff(uuid, k + 1, differ, {f: _short(va[k][f]) for f in differ},
                               {f: _short(vb[k][f]) for f in differ})
            if 'token_ids' in differ:
                diff.detail['first_token'] = _first_token_difference(va[k]['token_ids'], vb[k]['token_ids'])
            return diff
    values = {'finish_reason': (a.get('finish_reason'), b.get('finish_reason')),
              'num_turns': (a.get('num_turns'), b.get('num_turns')),
              'final_reward': (reward_of(a), reward_of(b)),
              'trained': (_digest(_trained(a)), _digest(_trained(b))),
              'token_record': (_digest(_token_record(a)), _digest(_token_record(b)))}
    differ = [f for f in REQUEST_FIELDS if f in fields and values[f][0] != values[f][1]]
    if len(va) != len(vb) and 'num_turns' in fields and 'num_turns' not in differ:
        differ.append('num_turns')
        values['num_turns'] = (len(va), len(vb))
    if not differ:
        return None
    diff = RequestDiff(uuid, min(len(va), len(vb)) + (1 if len(va) != len(vb) else 0) or 1, differ,
                       {f: values[f][0] for f in differ}, {f: values[f][1] for f in differ})
    if 'trained' in differ:
        ids_a, ids_b = (sum(line.get('response_token_ids') or [], []) for line in (a, b))
        if ids_a != ids_b:
            diff.detail['first_token'] = _first_token_difference(ids_a, ids_b)
    return diff


def _trained(line: Dict[str, Any]) -> List[Any]:
    return [line.get('response_token_ids'), line.get('response_loss_mask'), line.get('rollout_logprobs')]


def _token_record(line: Dict[str, Any]) -> Any:
    infos = line.get('rollout_infos')
    return infos.get('token_record') if isinstance(infos, dict) else None


def _digest(value: Any) -> Optional[str]:
    """12 hex digits standing for a long value (``None`` stays ``None``)."""
    if value is None:
        return None
    raw = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(raw.encode('utf-8')).hexdigest()[:12]


def _lines(path: Path) -> Iterator[Tuple[int, Dict[str, Any]]]:
    with open(path, 'rb') as f:
        for no, raw in enumerate(f, 1):
            if raw.strip():
                try:
                    yield no, json.loads(raw)
                except ValueError as exc:
                    raise ValueError(f'{path}:{no}: not a JSON line: {exc}') from None


def index_lines(path: Path) -> Dict[str, int]:
    """uuid -> byte offset of its line (a later line with the same uuid wins, as in
    :func:`mtflow.run.trajectories.read_trajectories`)."""
    index: Dict[str, int] = {}
    offset = 0
    with open(path, 'rb') as f:
        for no, raw in enumerate(f, 1):
            if raw.strip():
                start = raw.find(b'"uuid": ')
                uuid = None
                if start >= 0:  # our own writer: the uuid is the first key; no need to parse the line
                    try:
                        uuid, _ = json.JSONDecoder().raw_decode(raw[start + 8:].decode('utf-8'))
                    except ValueError:
                        uuid = None
                if not isinstance(uuid, str):
                    try:
                        uuid = str(json.loads(raw)['uuid'])
                    except (ValueError, KeyError, TypeError):
                        raise ValueError(f'{path}:{no}: not a trajectory line (no uuid)') from None
                index[uuid] = offset
            offset += len(raw)
    return index


class DiffRun:
    """``for item in DiffRun(a, b)``: a :class:`RequestDiff` per differing request (in A's
    order), then ``('only_in_a', uuid)`` / ``('only_in_b', uuid)``; :attr:`totals` is complete
    once the iteration is. ``fields`` limits what is compared (:data:`FIELDS`)."""

    def __init__(self, run_a: Union[str, Path], run_b: Union[str, Path], fields: Sequence[str] = FIELDS) -> None:
        unknown = [f for f in fields if f not in FIELDS]
        if unknown:
            raise ValueError(f'unknown field(s) {", ".join(unknown)}; known: {", ".join(FIELDS)}')
        self.path_a, self.path_b = trajectories_file(run_a), trajectories_file(run_b)
        self.fields = tuple(fields)
        self.totals = DiffTotals()

    def _group(self, uuid: str, a: Optional[float], b: Optional[float]) -> None:
        g = self.totals.groups.setdefault(group_of(uuid), [0.0, 0, 0.0, 0])
        if a is not None:
            g[0] += a
            g[1] += 1
        if b is not None:
            g[2] += b
            g[3] += 1

    def __iter__(self) -> Iterator[Union[RequestDiff, Tuple[str, str]]]:
        index = index_lines(self.path_b)
        seen = set()
        totals = self.totals
        with open(self.path_b, 'rb') as fb:
            for _, a in _lines(self.path_a):
                uuid = str(a.get('uuid'))
                if uuid in seen:
                    continue  # a uuid written twice (not by mtflow run): its first line counts
                seen.add(uuid)
                offset = index.get(uuid)
                if offset is None:
                    totals.only_in_a += 1
                    self._group(uuid, reward_of(a), None)
                    yield ('only_in_a', uuid)
                    continue
                fb.seek(offset)
                b = json.loads(fb.readline())
                self._group(uuid, reward_of(a), reward_of(b))
                d = compare(a, b, self.fields)
                if d is None:
                    totals.identical += 1
                else:
                    totals.different += 1
                    yield d
        for uuid in index:
            if uuid not in seen:
                totals.only_in_b += 1
                yield ('only_in_b', uuid)
