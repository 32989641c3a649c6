"""Traces: one event per state transition of every request.

The executor appends one small tuple per transition to a :class:`TraceRecorder` (that is all the
hot path pays); :class:`Trace` turns them into :class:`TraceEvent` objects when someone looks.
A trace never feeds back into the outputs.

JSONL format (one event per line, see ``docs/trace-format.md``)::

    {"uuid": "r3", "index": 3, "rank": 0, "turn": 2, "from": "generating", "to": "tool_step",
     "trigger": "run_step", "reason": null, "tokens": 17, "duration_s": null, "t": 0.0123,
     "extra": null}
"""
from __future__ import annotations

import copy
import gzip
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import IO, Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from mtflow.core.machine import FINISHED

#: The fields of one event, in JSONL key order.
EVENT_FIELDS = ('uuid', 'index', 'rank', 'turn', 'from', 'to', 'trigger', 'reason', 'tokens', 'duration_s', 't',
                'extra')


_ATOMS = (str, int, float, bool, type(None))


def _copy_value(value: Any) -> Any:
    """What ``dataclasses.asdict`` makes of a field's value (a deep copy; dataclasses become dicts),
    with a fast path for the JSON-like values an event's ``extra`` holds."""
    if isinstance(value, _ATOMS):
        return value
    if type(value) is dict:
        return {k: _copy_value(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_copy_value(v) for v in value)
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return copy.deepcopy(value)


@dataclass(slots=True)
class TraceEvent:
    """One transition of one request."""
    uuid: str
    index: int
    rank: int
    turn: int
    src: str
    dst: str
    trigger: str
    reason: Optional[str] = None  # set when dst is 'finished'
    tokens: Optional[int] = None  # completion tokens of the output this transition applied
    duration_s: Optional[float] = None  # wall time of the hook/step that led to this transition
    t: Optional[float] = None  # seconds since the run started
    extra: Optional[Dict[str, Any]] = None  # scheduler-provided details (tool calls, errors, ...)

    def to_dict(self) -> Dict[str, Any]:
        # built field by field: ``dataclasses.asdict`` walks ``extra`` generically (a quarter of a
        # replay's time); :func:`_copy_value` makes the same deep copy of JSON-like values faster
        return {'uuid': self.uuid, 'index': self.index, 'rank': self.rank, 'turn': self.turn, 'from': self.src,
                'to': self.dst, 'trigger': self.trigger, 'reason': self.reason, 'tokens': self.tokens,
                'duration_s': self.duration_s, 't': self.t, 'extra': _copy_value(self.extra)}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> 'TraceEvent':
        if not isinstance(d, dict):
            raise ValueError(f'expected a JSON object, got {type(d).__name__}')
        missing = [k for k in ('uuid', 'turn', 'from', 'to', 'trigger') if k not in d]
        if missing:
            raise ValueError(f'trace event is missing {", ".join(missing)}')
        for key in ('from', 'to', 'trigger'):
            if not isinstance(d[key], str):
                raise ValueError(f'field {key!r} must be a string, got {d[key]!r}')
        extra = d.get('extra')
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"field 'extra' must be an object or null, got {type(extra).__name__}")
        return cls(
            uuid=str(d['uuid']),
            index=int(d.get('index', -1)),
            rank=int(d.get('rank', 0)),
            turn=int(d['turn']),
            src=d['from'],
            dst=d['to'],
            trigger=d['trigger'],
            reason=d.get('reason'),
            tokens=d.get('tokens'),
            duration_s=d.get('duration_s'),
            t=d.get('t'),
            extra=d.get('extra'))

    def __str__(self) -> str:
        reason = f'({self.reason})' if self.reason else ''
        return f'{self.uuid} t{self.turn}: {self.src} -[{self.trigger}]-> {self.dst}{reason}'


RawEvent = Tuple[int, int, str, str, str, Optional[str], Optional[int], Optional[float], float, Optional[dict]]


class TraceRecorder:
    """Collects raw transition tuples during a run. Cheap by design: one ``list.append`` each."""
    __slots__ = ('rank', 'raw', 'uuids', 't0')

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.raw: List[RawEvent] = []
        self.uuids: List[str] = []
        self.t0 = time.perf_counter()

    def trace(self) -> 'Trace':
        uuids, rank = self.uuids, self.rank
        return Trace([
            TraceEvent(uuids[i], i, rank, turn, src, dst, trig, reason, tokens, dur, t, extra)
            for (i, turn, src, dst, trig, reason, tokens, dur, t, extra) in self.raw
        ])


class Trace:
    """All transitions of a run (or of several ranks' runs merged), with per-request views."""

    def __init__(self, events: Iterable[TraceEvent] = ()) -> None:
        self.events: List[TraceEvent] = list(events)

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(self.events)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Trace) and self.events == other.events

    def __repr__(self) -> str:
        return f'<Trace {len(self.events)} events, {len(self.uuids())} requests>'

    # ---- views -------------------------------------------------------------------------------
    def uuids(self) -> List[str]:
        """Request uuids in the order they first appear."""
        return list(dict.fromkeys(e.uuid for e in self.events))

    def for_request(self, uuid: str) -> List[TraceEvent]:
        return [e for e in self.events if e.uuid == uuid]

    def states(self, uuid: str) -> List[str]:
        """The states request ``uuid`` went through, in order, e.g.
        ``['pending', 'generating', 'tool_step', 'continuing', 'finished']``."""
        events = self.for_request(uuid)
        if not events:
            raise KeyError(f'no trace events for request {uuid!r}')
        return [events[0].src] + [e.dst for e in events]

    def path(self, uuid: str) -> str:
        """The states of one request as one line, the finish reason in brackets:
        ``'pending -> generating -> tool_step -> continuing -> finished(max_turns)'``."""
        events = self.for_request(uuid)
        states = self.states(uuid)
        reason = events[-1].reason if events[-1].dst == FINISHED else None
        if reason:
            states[-1] = f'{states[-1]}({reason})'
        return ' -> '.join(states)

    def finish_reason(self, uuid: str) -> Optional[str]:
        for e in reversed(self.for_request(uuid)):
            if e.dst == FINISHED:
                return e.reason
        return None

    def finish_reasons(self) -> Counter:
        return Counter(e.reason for e in self.events if e.dst == FINISHED)

    def live_per_turn(self) -> Dict[int, int]:
        """How many requests applied an output in each turn (were live in it)."""
        live: Dict[int, set] = {}
        for e in self.events:
            if e.src in ('generating', 'continuing'):
                live.setdefault(e.turn, set()).add(e.uuid)
        return {turn: len(u) for turn, u in sorted(live.items())}

    def filter(self, predicate: Callable[[TraceEvent], bool]) -> 'Trace':
        return Trace(e for e in self.events if predicate(e))

    def select(self, uuids: Sequence[str]) -> 'Trace':
        wanted = set(uuids)
        return self.filter(lambda e: e.uuid in wanted)

    @staticmethod
    def merge(traces: Iterable['Trace']) -> 'Trace':
        """One trace from several ranks' traces (events keep their rank)."""
        events: List[TraceEvent] = []
        for tr in traces:
            events.extend(tr.events)
        return Trace(events)

    # ---- JSONL -------------------------------------------------------------------------------
    def write_jsonl(self, dest: Union[str, Path, IO[str]]) -> None:
        """One JSON object per event (``docs/trace-format.md``); a path ending in ``.gz`` is gzipped.
        JSON values in ``extra`` round-trip exactly; anything else is written as its ``str``."""
        if isinstance(dest, (str, Path)):
            with open_text(dest, 'w') as f:
                self.write_jsonl(f)
            return
        for e in self.events:
            dest.write(json.dumps(e.to_dict(), ensure_ascii=False, default=str) + '\n')

    @classmethod
    def read_jsonl(cls, src: Union[str, Path, IO[str]]) -> 'Trace':
        """Read what :meth:`write_jsonl` wrote (plain or ``.gz``); a bad line raises
        ``ValueError('<file>:<line>: ...')``."""
        if isinstance(src, (str, Path)):
            with open_text(src, 'r') as f:
                return cls._read(f, str(src))
        return cls._read(src, getattr(src, 'name', '<stream>'))

    @classmethod
    def _read(cls, lines: Iterable[str], name: str) -> 'Trace':
        events = []
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                events.append(TraceEvent.from_dict(json.loads(line)))
            except (ValueError, TypeError) as exc:
                raise ValueError(f'{name}:{lineno}: not a trace event: {exc}') from exc
        return cls(events)


def open_text(path: Union[str, Path], mode: str) -> IO[str]:
    """Open a UTF-8 text file, through gzip when the name ends in ``.gz``."""
    if str(path).endswith('.gz'):
        return gzip.open(path, mode + 't', encoding='utf-8')  # type: ignore[return-value]
    return open(path, mode, encoding='utf-8')


# ---- listeners (the pytest plugin and the CLI subscribe here) ----------------------------------
_listeners: List[Callable[[Trace], None]] = []


def add_listener(fn: Callable[[Trace], None]) -> None:
    """Call ``fn(trace)`` after every executor run that recorded a trace."""
    _listeners.append(fn)


def remove_listener(fn: Callable[[Trace], None]) -> None:
    if fn in _listeners:
        _listeners.remove(fn)


def publish(trace: Trace) -> None:
    for fn in list(_listeners):
        fn(trace)


def has_listeners() -> bool:
    return bool(_listeners)
