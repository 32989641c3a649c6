"""Comparing two runs request by request, turn by turn, in constant memory (``mtflow diff``).

Requests are matched by ``uuid``. Two lines of one uuid that started from another ``prompt``
(the messages before the first model turn) or another ``reference`` (the dataset's answer) are
not the same request: that is their difference, counted apart (``different_input``) and reported
first, with their first differing turn beside it (``then``). For every other pair the first turn where they differ is
found, with what differs there: the model's ``text``, its ``token_ids`` (with the first differing position),
the ``observation`` that followed it (the tool, user or environment messages before the next
model turn), the step's ``reward`` (an environment's per-step ``rewards``); and, over the whole
request, the ``finish_reason``, the number of turns (``num_turns``), the final ``reward``, what a
trainer gets (``trained``: ``response_token_ids``, ``response_loss_mask``, ``rollout_logprobs``;
shown as digests, with the first differing id; logprobs agree within :data:`LOGPROB_TOL`, as the
same model in batches of another shape rounds its last digits otherwise) and the backend's
exact-id ``token_record``
(``rollout_infos.token_record``: the prompt ids each turn was generated from).

Memory: run B is indexed once (uuid -> byte offset of its line), run A streamed; a line of B is
read back when its uuid comes up. The index, A's uuids and the per-group reward sums
(``num_generations`` copies share ``<uuid>#<k>``'s prefix) live in a temporary SQLite file
(:class:`DiskIndex`), so memory holds one pair of trajectories and SQLite's bounded page cache,
whatever the size of the runs; only the groups whose mean reward changed are kept for the report.

Rewards are read through :func:`reward_of`, the one place that knows where a line keeps them.
"""
from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from mtflow.run.files import TRAJECTORIES
from mtflow.run.turn_log import expand_turns

__all__ = ['FIELDS', 'INPUT_FIELDS', 'prompt_of', 'index_lines', 'iter_offsets', 'iter_raw', 'DiskIndex', 'RequestDiff', 'DiffTotals', 'DiffRun', 'compare', 'trajectories_file', 'reward_of', 'turn_views',
           'group_of']

#: what can differ, in the order they are checked: what the request started from, then within a
#: turn, then over the request
INPUT_FIELDS = ('prompt', 'reference')
TURN_FIELDS = ('text', 'token_ids', 'observation', 'reward')
REQUEST_FIELDS = ('finish_reason', 'num_turns', 'final_reward', 'trained', 'token_record')
FIELDS = INPUT_FIELDS + TURN_FIELDS + REQUEST_FIELDS
#: logprobs closer than this are the same (float rounding of another batch shape: ~1e-6 on CPU)
LOGPROB_TOL = 1e-4


def reward_of(line: Dict[str, Any]) -> Optional[float]:
    """The reward of a trajectory line: its top-level ``reward``, or ``rollout_infos['reward']`` in a
    file written before that field; ``None`` without one."""
    value = line['reward'] if 'reward' in line else (line.get('rollout_infos') or {}).get('reward')
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


def prompt_of(line: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The messages a request started from: those before its first assistant message (role,
    content, tool calls), as the first model call was given them."""
    out = []
    for m in line.get('messages') or []:
        if not isinstance(m, dict):
            continue
        if m.get('role') == 'assistant':
            break
        out.append({k: m[k] for k in ('role', 'content', 'tool_calls') if m.get(k) is not None})
    return out


def _input_difference(a: Dict[str, Any], b: Dict[str, Any], fields: Sequence[str]) -> Optional['RequestDiff']:
    """How two lines of one uuid started from another prompt or reference (turn 0), else ``None``:
    the prompt's first differing message, with its index in ``detail``."""
    diff = RequestDiff(str(a.get('uuid')), 0, [])
    if 'prompt' in fields:
        pa, pb = prompt_of(a), prompt_of(b)
        if pa != pb:
            k = next((i for i, (x, y) in enumerate(zip(pa, pb)) if x != y), min(len(pa), len(pb)))
            diff.fields.append('prompt')
            diff.a['prompt'] = _short(pa[k]) if k < len(pa) else None
            diff.b['prompt'] = _short(pb[k]) if k < len(pb) else None
            diff.detail['prompt_message'] = k
    if 'reference' in fields and a.get('reference') != b.get('reference'):
        diff.fields.append('reference')
        diff.a['reference'], diff.b['reference'] = _short(a.get('reference')), _short(b.get('reference'))
    return diff if diff.fields else None


@dataclass
class RequestDiff:
    """The first difference of one request: ``turn`` (from 1; for a request-level field, the
    last turn both have, or the one after it when their numbers of turns differ; 0: the request
    started from another ``prompt`` or ``reference``, :attr:`is_input`) and each field that
    differs there, with both values."""
    uuid: str
    turn: int
    fields: List[str]
    a: Dict[str, Any] = field(default_factory=dict)
    b: Dict[str, Any] = field(default_factory=dict)
    detail: Dict[str, Any] = field(default_factory=dict)
    #: of a request that started from another input: its first differing turn after that
    then: Optional['RequestDiff'] = None

    @property
    def is_input(self) -> bool:
        """The two lines started from another prompt or reference: not the same request."""
        return any(f in INPUT_FIELDS for f in self.fields)

    def to_dict(self) -> Dict[str, Any]:
        then = self.then.to_dict() if self.then is not None else None
        return {'uuid': self.uuid, 'turn': self.turn, 'fields': self.fields, 'a': self.a, 'b': self.b,
                **({'detail': self.detail} if self.detail else {}),
                **({'then': {k: v for k, v in then.items() if k != 'uuid'}} if then else {})}


@dataclass
class DiffTotals:
    #: pairs that started from another prompt or reference (their turns are not compared)
    different_input: int = 0
    identical: int = 0
    different: int = 0
    only_in_a: int = 0
    only_in_b: int = 0
    #: group -> [sum A, count A, sum B, count B] of the final rewards of pairs
    groups: Dict[str, List[float]] = field(default_factory=dict)

    @property
    def same(self) -> bool:
        return not (self.different_input or self.different or self.only_in_a or self.only_in_b)

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
        return {'different_input': self.different_input, 'identical': self.identical, 'different': self.different, 'only_in_a': self.only_in_a,
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


def compare(a: Dict[str, Any], b: Dict[str, Any], fields: Sequence[str] = FIELDS,
            logprob_tol: float = LOGPROB_TOL) -> Optional[RequestDiff]:
    """The first difference of two lines of one request, ``None`` when they agree on ``fields``
    (``rollout_logprobs`` within ``logprob_tol``; 0: exactly). Lines that started from another
    prompt or reference differ there first (turn 0), their first differing turn after it in
    ``then``."""
    started = _input_difference(a, b, fields)
    if started is None:
        return _turn_difference(a, b, fields, logprob_tol)
    then = _turn_difference(a, b, fields, logprob_tol)
    if then is not None:
        started.then = then
    return started


def _turn_difference(a: Dict[str, Any], b: Dict[str, Any], fields: Sequence[str],
                     logprob_tol: float) -> Optional[RequestDiff]:
    """The first difference of two lines after what they started from (:func:`compare`)."""
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
              'trained': (_trained(a), _trained(b)),
              'token_record': (_token_record(a), _token_record(b))}
    differ = [f for f in REQUEST_FIELDS if f in fields and not _same(f, *values[f], logprob_tol)]
    for f in ('trained', 'token_record'):  # long: shown as digests
        values[f] = (_digest(values[f][0]), _digest(values[f][1]))
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


def _same(field: str, a: Any, b: Any, logprob_tol: float) -> bool:
    if a == b:
        return True
    if field != 'trained' or not logprob_tol:
        return False
    if a[:2] != b[:2]:  # ids and loss masks: exactly
        return False
    lps_a, lps_b = a[2] or [], b[2] or []
    if len(lps_a) != len(lps_b) or any(len(x or []) != len(y or []) for x, y in zip(lps_a, lps_b)):
        return False
    return all(abs(p - q) <= logprob_tol for x, y in zip(lps_a, lps_b) for p, q in zip(x or [], y or []))


def _token_record(line: Dict[str, Any]) -> Any:
    infos = line.get('rollout_infos')
    return infos.get('token_record') if isinstance(infos, dict) else None


def _digest(value: Any) -> Optional[str]:
    """12 hex digits standing for a long value (``None`` stays ``None``)."""
    if value is None:
        return None
    raw = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(raw.encode('utf-8')).hexdigest()[:12]


def _parse(raw: bytes, path: Path, no: Optional[int]) -> Dict[str, Any]:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ValueError(f'{path}:{no or "?"}: not a JSON line: {exc}') from None


def _uuid_of(raw: bytes, decoder: json.JSONDecoder) -> Optional[str]:
    start = raw.find(b'"uuid": ')
    if start >= 0:  # our own writer: the uuid is the first key; no need to parse the line
        try:
            uuid, _ = decoder.raw_decode(raw[start + 8:].decode('utf-8'))
        except ValueError:
            uuid = None
        if isinstance(uuid, str):
            return uuid
    try:
        return str(json.loads(raw)['uuid'])
    except (ValueError, KeyError, TypeError):
        return None


def iter_raw(path: Path) -> Iterator[Tuple[int, str, int, bytes]]:
    """``(line number, uuid, byte offset, raw line)`` of each line of a trajectories file."""
    offset = 0
    decoder = json.JSONDecoder()
    with open(path, 'rb') as f:
        for no, raw in enumerate(f, 1):
            if raw.strip():
                uuid = _uuid_of(raw, decoder)
                if uuid is None:
                    raise ValueError(f'{path}:{no}: not a trajectory line (no uuid)')
                yield no, uuid, offset, raw
            offset += len(raw)


def iter_offsets(path: Path) -> Iterator[Tuple[str, int]]:
    """``(uuid, byte offset)`` of each line of a trajectories file, in file order."""
    for _, uuid, offset, _ in iter_raw(path):
        yield uuid, offset


def index_lines(path: Path) -> Dict[str, int]:
    """uuid -> byte offset of its line (a later line with the same uuid wins, as in
    :func:`mtflow.run.trajectories.read_trajectories`)."""
    return dict(iter_offsets(path))


class DiskIndex:
    """What a diff must remember, in a temporary SQLite file rather than in memory, so a diff's
    memory does not grow with the runs: B's uuid -> byte offset (and whether A had it), A's uuids
    (a uuid written twice counts once), and the per-group reward sums. SQLite's page cache is
    bounded (``CACHE_KIB``); the file is deleted when the diff ends."""

    #: SQLite's page cache, KiB
    CACHE_KIB = 8192

    def __init__(self, path_b: Path) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix='mtflow-diff-')
        self.db = sqlite3.connect(os.path.join(self._dir.name, 'index.sqlite'), isolation_level=None)
        for pragma in ('journal_mode=OFF', 'synchronous=OFF', f'cache_size=-{self.CACHE_KIB}', 'temp_store=FILE'):
            self.db.execute(f'PRAGMA {pragma}')
        self.db.execute('BEGIN')
        self.db.execute('CREATE TABLE b (uuid TEXT PRIMARY KEY, off INTEGER, seen INTEGER DEFAULT 0) WITHOUT ROWID')
        self.db.execute('CREATE TABLE a (uuid TEXT PRIMARY KEY) WITHOUT ROWID')
        self.db.execute('CREATE TABLE g (grp TEXT PRIMARY KEY, sa REAL, na INTEGER, sb REAL, nb INTEGER) WITHOUT ROWID')
        # a later line with the same uuid wins, as in read_trajectories
        self.db.executemany('INSERT OR REPLACE INTO b (uuid, off) VALUES (?, ?)', iter_offsets(path_b))

    def first_in_a(self, uuid: str) -> bool:
        """Whether this is the first line of A with this uuid (and remember it)."""
        return self.db.execute('INSERT OR IGNORE INTO a VALUES (?)', (uuid, )).rowcount == 1

    def offset_in_b(self, uuid: str) -> Optional[int]:
        """B's line of ``uuid`` (``None``: only in A), marked as paired."""
        row = self.db.execute('SELECT off FROM b WHERE uuid = ?', (uuid, )).fetchone()
        if row is None:
            return None
        self.db.execute('UPDATE b SET seen = 1 WHERE uuid = ?', (uuid, ))
        return int(row[0])

    def add_rewards(self, group: str, a: Optional[float], b: Optional[float]) -> None:
        row = (group, a or 0.0, int(a is not None), b or 0.0, int(b is not None))
        self.db.execute('INSERT INTO g VALUES (?, ?, ?, ?, ?) ON CONFLICT (grp) DO UPDATE SET sa = sa + excluded.sa, '
                        'na = na + excluded.na, sb = sb + excluded.sb, nb = nb + excluded.nb', row)

    def only_in_b(self) -> Iterator[str]:
        for (uuid, ) in self.db.execute('SELECT uuid FROM b WHERE seen = 0 ORDER BY off'):
            yield uuid

    def groups(self) -> Iterator[Tuple[str, List[float]]]:
        for grp, sa, na, sb, nb in self.db.execute('SELECT grp, sa, na, sb, nb FROM g ORDER BY grp'):
            yield grp, [sa, na, sb, nb]

    def close(self) -> None:
        self.db.close()
        self._dir.cleanup()


class DiffRun:
    """``for item in DiffRun(a, b)``: a :class:`RequestDiff` per differing request (in A's
    order), then ``('only_in_a', uuid)`` / ``('only_in_b', uuid)``; :attr:`totals` is complete
    once the iteration is. ``fields`` limits what is compared (:data:`FIELDS`)."""

    def __init__(self, run_a: Union[str, Path], run_b: Union[str, Path], fields: Sequence[str] = FIELDS,
                 logprob_tol: float = LOGPROB_TOL) -> None:
        unknown = [f for f in fields if f not in FIELDS]
        if unknown:
            raise ValueError(f'unknown field(s) {", ".join(unknown)}; known: {", ".join(FIELDS)}')
        self.path_a, self.path_b = trajectories_file(run_a), trajectories_file(run_b)
        self.fields = tuple(fields)
        self.logprob_tol = logprob_tol
        self.totals = DiffTotals()

    def __iter__(self) -> Iterator[Union[RequestDiff, Tuple[str, str]]]:
        index = DiskIndex(self.path_b)
        totals = self.totals
        try:
            with open(self.path_b, 'rb') as fb:
                for no, uuid, _, raw_a in iter_raw(self.path_a):
                    if not index.first_in_a(uuid):
                        continue  # a uuid written twice (not by mtflow run): its first line counts
                    a = _parse(raw_a, self.path_a, no)
                    offset = index.offset_in_b(uuid)
                    if offset is None:
                        totals.only_in_a += 1
                        index.add_rewards(group_of(uuid), reward_of(a), None)
                        yield ('only_in_a', uuid)
                        continue
                    fb.seek(offset)
                    raw_b = fb.readline()
                    if raw_b.rstrip(b'\r\n') == raw_a.rstrip(b'\r\n'):  # the same bytes: identical, parsed once
                        index.add_rewards(group_of(uuid), reward_of(a), reward_of(a))
                        totals.identical += 1
                        continue
                    b = _parse(raw_b, self.path_b, None)
                    index.add_rewards(group_of(uuid), reward_of(a), reward_of(b))
                    d = compare(a, b, self.fields, self.logprob_tol)
                    if d is None:
                        totals.identical += 1
                    elif d.is_input:
                        totals.different_input += 1
                        yield d
                    else:
                        totals.different += 1
                        yield d
            for uuid in index.only_in_b():
                totals.only_in_b += 1
                yield ('only_in_b', uuid)
            # only the groups whose mean changed are kept (what reward_changes reports)
            for group, sums in index.groups():
                if _mean_changed(sums):
                    totals.groups[group] = sums
        finally:
            index.close()


def _mean_changed(sums: List[float]) -> bool:
    sa, na, sb, nb = sums
    if not na and not nb:
        return False
    return abs((sa / na if na else 0.0) - (sb / nb if nb else 0.0)) > 1e-12
