"""What the views show, computed once from a :class:`~mtflow.core.trace.Trace`.

Both the terminal and the HTML views read these plain objects, so they always agree on what a
request did in each turn and on the batch figures.

How trace events map onto turns (the executor's recording, ``docs/trace-format.md``): the event
that enters ``generating``/``continuing`` from ``pending`` opens turn ``e.turn``; the one that
leaves ``tool_step`` belongs to the step of turn ``e.turn`` (its ``duration_s`` and ``extra``) and
opens turn ``e.turn + 1``; ``run_step``, ``finish`` and ``fail`` close turn ``e.turn``.
"""
from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mtflow.core.machine import (COMPACTING, CONTINUING, ERROR, FINISHED, FORK, GENERATING, PENDING, TOOL_STEP,
                                 WAITING_STATES, reason_kind)
from mtflow.core.trace import Trace, TraceEvent

#: One-letter marks of the states in a turn cell.
MARKS = {GENERATING: 'G', CONTINUING: 'C', TOOL_STEP: 'T', PENDING: '.', FINISHED: '#'}
COMPACTED_MARK = 'K'  # the context was compacted after the turn (docs/context.md)
OK_MARK, ERROR_MARK, TOOL_ERROR_MARK = '✓', '✗', '!'


@dataclass
class ToolError:
    uuid: str
    turn: int
    message: str


@dataclass
class TurnCell:
    """What one request did in one turn."""
    turn: int
    wait: Optional[str] = None  # 'generating' | 'continuing' (None: failed before waiting)
    stepped: bool = False  # went through tool_step
    tokens: Optional[int] = None  # completion tokens of this turn's output
    step_s: Optional[float] = None  # wall time of the step
    step_extra: Optional[Dict[str, Any]] = None  # the step's trace_info
    tool_calls: List[str] = field(default_factory=list)
    tool_errors: List[str] = field(default_factory=list)
    finished: Optional[str] = None  # the finish reason when the request finished in this turn
    error: Optional[Dict[str, Any]] = None  # the failure (type, message, phase) when it failed here
    #: the context was compacted after this turn (``compacting`` -> ``generating``): what it recorded
    compaction: Optional[Dict[str, Any]] = None
    #: a run with a context budget: this turn's tokens against it, as the event that sent the turn
    #: recorded them (``extra['context']``: ``prompt_tokens``, ``max_tokens``, ``context_length``, ...)
    budget: Optional[Dict[str, Any]] = None

    def marks(self) -> str:
        """The cell as text: ``G``/``C`` waited, ``T`` stepped (``T!`` with tool errors), ``K``
        compacted, then ``✓`` finished or ``✗`` failed, e.g. ``GT``, ``CT!``, ``GTK``, ``G✓``, ``GT✗``."""
        s = MARKS.get(self.wait, '') if self.wait else '.'
        if self.stepped:
            s += 'T' + (TOOL_ERROR_MARK if self.tool_errors else '')
        if self.compaction is not None:
            s += COMPACTED_MARK
        if self.finished is not None:
            s += ERROR_MARK if reason_kind(self.finished) == 'error' else OK_MARK
        return s


@dataclass
class RequestView:
    """One request across its turns."""
    uuid: str
    index: int
    rank: int
    events: List[TraceEvent]
    cells: List[TurnCell]
    reason: Optional[str]  # None: the trace ends before the request finished
    tokens: int
    path: str
    #: a branched run (``docs/branching.md``): the request it was forked from, and its children
    parent: Optional[str] = None
    children: List[str] = field(default_factory=list)

    @property
    def turns(self) -> int:
        return len(self.cells)

    @property
    def states(self) -> List[str]:
        return [self.events[0].src] + [e.dst for e in self.events] if self.events else []

    @property
    def tool_errors(self) -> List[ToolError]:
        return [ToolError(self.uuid, c.turn, m) for c in self.cells for m in c.tool_errors]

    @property
    def error(self) -> Optional[Dict[str, Any]]:
        return next((c.error for c in self.cells if c.error), None)

    def timeline(self) -> str:
        return ' '.join(c.marks() for c in self.cells)

    @property
    def compactions(self) -> int:
        return sum(1 for c in self.cells if c.compaction is not None)


@dataclass
class SlowStep:
    uuid: str
    turn: int
    duration_s: float
    tools: List[str]


@dataclass
class Summary:
    """The batch figures."""
    requests: int
    events: int
    ranks: List[int]
    max_turn: int
    live_per_turn: Dict[int, int]
    turns_per_request: Dict[int, int]
    finish_reasons: Dict[str, int]
    tool_calls: int
    tool_errors: List[ToolError]
    errors: List[Dict[str, Any]]
    slowest_steps: List[SlowStep]
    tokens: int
    unfinished: List[str]
    tool_error_kinds: Dict[str, int] = field(default_factory=dict)  # error_kind -> failed calls
    #: compactions per request (uuid -> count), requests with at least one (docs/context.md)
    compactions: Dict[str, int] = field(default_factory=dict)
    #: wall time per state across the requests (empty when the events carry no times)
    time_per_state: Dict[str, 'StateTime'] = field(default_factory=dict)
    wall_s: Optional[float] = None  # from the first event to the last


@dataclass
class Span:
    """A request in one state from ``start`` to ``end`` (seconds since the run started, the
    events' ``t``); ``turn`` is the turn of the event that entered it."""
    state: str
    start: float
    end: float
    turn: int

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class StateTime:
    """Wall time spent in one state, summed over requests, with the mean and the largest single
    request's share (a straggler shows as a large ``max_s`` against ``mean_s``)."""
    state: str
    total_s: float
    requests: int
    mean_s: float
    max_s: float
    max_uuid: str


def state_spans(events: Sequence[TraceEvent], t0: Optional[float] = None) -> List[Span]:
    """The time a request spent in each state, from its events' ``t``: a state lasts from the
    event that entered it to the next one. ``pending`` starts at ``t0`` (the run's first event)
    when given. Events without times give no spans."""
    spans: List[Span] = []
    timed = [e for e in events if e.t is not None]
    if not timed:
        return spans
    first_event = timed[0]
    if t0 is not None and first_event.src == PENDING and first_event.t > t0:
        spans.append(Span(PENDING, t0, first_event.t, first_event.turn))
    for e, nxt in zip(timed, timed[1:]):
        # the event leaving tool_step carries its step's turn and opens the next one
        turn = e.turn + 1 if e.src == TOOL_STEP and e.dst in WAITING_STATES else e.turn
        spans.append(Span(e.dst, e.t, nxt.t, turn))
    return spans


def time_per_state(views: Sequence['RequestView'], t0: Optional[float] = None) -> Dict[str, StateTime]:
    """Per state (in the graph's order), the wall time requests spent in it."""
    per: Dict[str, Dict[int, float]] = {}  # state -> view number -> seconds (a uuid may recur across runs)
    for k, v in enumerate(views):
        for sp in state_spans(v.events, t0):
            per.setdefault(sp.state, {}).setdefault(k, 0.0)
            per[sp.state][k] += sp.seconds
    order = [PENDING, GENERATING, CONTINUING, TOOL_STEP]
    out: Dict[str, StateTime] = {}
    for state in order + sorted(set(per) - set(order)):
        if state not in per:
            continue
        by_req = per[state]
        top = max(by_req, key=by_req.get)
        total = sum(by_req.values())
        out[state] = StateTime(state, total, len(by_req), total / len(by_req), by_req[top], views[top].uuid)
    return out


def trace_t0(events: Sequence[TraceEvent]) -> Optional[float]:
    return min((e.t for e in events if e.t is not None), default=None)


def turn_windows(views: Sequence['RequestView']) -> Dict[int, tuple]:
    """Per turn, ``(first, last, n)``: when the first and the last request applied that turn's
    output (``t`` of the events leaving ``generating``/``continuing``), and how many did. In a
    lockstep run every request applies a turn's output at the same moment (the turn barrier: the
    window is a line); in async mode the window spreads over the run."""
    seen: Dict[int, List[float]] = {}
    for v in views:
        for e in v.events:
            if e.src in WAITING_STATES and e.t is not None:
                seen.setdefault(e.turn, []).append(e.t)
    return {turn: (min(ts), max(ts), len(ts)) for turn, ts in sorted(seen.items())}


def _tool_info(extra: Optional[Dict[str, Any]]) -> tuple:
    """Tool call names and tool error messages of one step, from its ``trace_info``
    (``docs/trace-format.md``), in this order of preference:

    * ``calls``: ``[{name, ok, error_kind?, error?}]``, one per call of this step (what the
      declarative scheduler writes; its ``tool_calls``/``tool_errors`` numbers are then running
      totals of the request and are not counted again);
    * ``tool_calls``: names or ``{name | function: {name}, error?}`` objects, or a number of calls;
    * ``tool_errors``: messages or ``{name?, message | error}`` objects, or a number of errors.
    """
    if not isinstance(extra, dict):
        return [], []
    names: List[str] = []
    errors: List[str] = []
    calls = extra.get('calls')
    if isinstance(calls, list):
        for call in calls:
            if not isinstance(call, dict):
                names.append(str(call))
                continue
            name = str(call.get('name') or '?')
            names.append(name)
            if call.get('ok') is False or call.get('error'):
                kind = f'{call["error_kind"]}: ' if call.get('error_kind') else ''
                errors.append(f'{name}: {kind}{call.get("error") or "failed"}')
        return names, list(dict.fromkeys(errors))
    tool_calls = extra.get('tool_calls')
    if isinstance(tool_calls, bool):
        tool_calls = int(tool_calls)
    if isinstance(tool_calls, int):
        names.extend(['?'] * max(0, tool_calls))
    elif isinstance(tool_calls, list):
        for call in tool_calls:
            if isinstance(call, dict):
                fn = call.get('function')
                name = str(call.get('name') or (fn.get('name') if isinstance(fn, dict) else None) or '?')
                names.append(name)
                if call.get('error'):
                    errors.append(f'{name}: {call["error"]}')
            else:
                names.append(str(call))
    tool_errors = extra.get('tool_errors')
    if isinstance(tool_errors, int) and not isinstance(tool_errors, bool):
        if tool_errors > len(errors):
            errors.extend([f'tool error {k + 1} (no message recorded)' for k in range(len(errors), tool_errors)])
    elif isinstance(tool_errors, list):
        for err in tool_errors:
            if isinstance(err, dict):
                msg = err.get('message') or err.get('error') or err
                errors.append(f'{err["name"]}: {msg}' if err.get('name') else str(msg))
            else:
                errors.append(str(err))
    return names, list(dict.fromkeys(errors))


def _budget_of(e: TraceEvent) -> Optional[Dict[str, Any]]:
    """The context-budget counts a turn was sent with (``docs/context.md``), when the run had a budget."""
    counts = e.extra.get('context') if e.extra else None
    return dict(counts) if isinstance(counts, dict) else None


def _step_done(c: TurnCell, e: TraceEvent) -> None:
    """The step of ``c``'s turn ended with ``e``: its time, its trace info and its tool calls."""
    c.step_s, c.step_extra = e.duration_s, e.extra
    c.tool_calls, c.tool_errors = _tool_info(e.extra)


def _fork_links(events: List[TraceEvent]) -> Tuple[Optional[str], List[str]]:
    """A branched request's parent (``None``: a root) and children, from its ``fork`` events."""
    forks = [e.extra or {} for e in events if e.trigger == FORK]
    parent = next((f['parent'] for f in forks if 'parent' in f), None)
    return parent, [c for f in forks for c in f.get('children') or ()]


def request_view(uuid: str, events: List[TraceEvent]) -> RequestView:
    cells: Dict[int, TurnCell] = {}

    def cell(turn: int) -> TurnCell:
        c = cells.get(turn)
        if c is None:
            c = cells[turn] = TurnCell(turn)
        return c

    reason: Optional[str] = None
    tokens = 0
    compact_from: Optional[str] = None  # the state the last compact move left
    for e in events:
        if e.trigger == FORK:  # no turn of its own; a child born waiting for the model opens its first turn
            if 'parent' in (e.extra or {}) and e.dst in WAITING_STATES:
                cell(e.turn).wait = e.dst
            continue
        if e.dst == COMPACTING:
            compact_from = e.src
            if e.src == TOOL_STEP:
                _step_done(cell(e.turn), e)
        elif e.src == COMPACTING and e.dst in WAITING_STATES:
            cell(e.turn).compaction = dict((e.extra or {}).get('compaction') or {})
            opened = cell(e.turn + 1 if compact_from == TOOL_STEP else e.turn)
            opened.wait = e.dst
            opened.budget = _budget_of(e)
        elif e.dst in WAITING_STATES:
            if e.src == TOOL_STEP:
                _step_done(cell(e.turn), e)
                opened = cell(e.turn + 1)
            else:
                opened = cell(e.turn)
            opened.wait = e.dst
            opened.budget = _budget_of(e)
        elif e.dst == TOOL_STEP:
            c = cell(e.turn)
            c.stepped = True
            c.tokens = e.tokens
        elif e.dst == FINISHED:
            c = cell(e.turn)
            c.finished = e.reason or ERROR
            reason = c.finished
            if e.tokens is not None:
                c.tokens = e.tokens
            if e.src == TOOL_STEP:
                c.stepped = True
            if e.extra and isinstance(e.extra.get('error'), dict):
                c.error = e.extra['error']
            elif reason_kind(c.finished) == 'error':
                c.error = {'message': 'no details recorded'}
        if e.dst in (TOOL_STEP, FINISHED) and e.tokens:
            tokens += e.tokens
    first_event = events[0]
    ordered = [cells[t] for t in sorted(cells)]
    states = [first_event.src] + [e.dst for e in events]
    if reason:
        states[-1] = f'{states[-1]}({reason})'
    return RequestView(uuid, first_event.index, first_event.rank, events, ordered, reason, tokens, ' -> '.join(states),
                       *_fork_links(events))


def request_views(trace: Trace) -> List[RequestView]:
    """One view per request, in the order requests first appear in the trace.

    Several runs merged into one trace may reuse uuids (``'#0'`` when requests have none): a
    request is keyed by (rank, uuid), and an event leaving ``pending`` again starts a new one."""
    grouped: Dict[tuple, List[TraceEvent]] = {}
    current: Dict[tuple, tuple] = {}
    for e in trace.events:
        base = (e.rank, e.uuid)
        key = current.get(base)
        if key is None or (e.src == PENDING and grouped[key][-1].trigger != FORK):  # after its fork: born pending
            key = current[base] = (e.rank, e.uuid, len(grouped))
            grouped[key] = []
        grouped[key].append(e)
    return [request_view(key[1], evs) for key, evs in grouped.items()]


def summarize(views: Sequence[RequestView], n_events: Optional[int] = None, slowest: int = 5) -> Summary:
    live: Counter = Counter()
    for v in views:
        for c in v.cells:
            if c.wait is not None:
                live[c.turn] += 1
    steps = [
        SlowStep(v.uuid, c.turn, c.step_s, c.tool_calls) for v in views for c in v.cells if c.step_s is not None
    ]
    steps.sort(key=lambda s: -s.duration_s)
    errors = []
    for v in views:
        for c in v.cells:
            if c.error:
                errors.append({'uuid': v.uuid, 'turn': c.turn, **c.error})
    reasons = Counter(v.reason for v in views if v.reason)
    events = [e for v in views for e in v.events]
    t0 = trace_t0(events)
    t1 = max((e.t for e in events if e.t is not None), default=None)
    return Summary(
        requests=len(views),
        events=n_events if n_events is not None else sum(len(v.events) for v in views),
        ranks=sorted({v.rank for v in views}),
        max_turn=max((c.turn for v in views for c in v.cells), default=0),
        live_per_turn=dict(sorted(live.items())),
        turns_per_request=dict(sorted(Counter(v.turns for v in views).items())),
        finish_reasons=dict(reasons.most_common()),
        tool_calls=sum(len(c.tool_calls) for v in views for c in v.cells),
        tool_errors=[te for v in views for te in v.tool_errors],
        errors=errors,
        slowest_steps=steps[:slowest],
        tokens=sum(v.tokens for v in views),
        unfinished=[v.uuid for v in views if v.reason is None],
        tool_error_kinds=dict(Counter(kind for v in views for c in v.cells for kind in _error_kinds(c.step_extra))
                              .most_common()),
        time_per_state=time_per_state(views, t0),
        wall_s=None if t0 is None else t1 - t0,
        compactions={v.uuid: v.compactions for v in views if v.compactions})


def _error_kinds(extra: Optional[Dict[str, Any]]) -> List[str]:
    """The ``error_kind`` of each failed call of one step (its ``calls`` trace_info):
    ``timeout``, ``memory``, ``exit``, ``killed`` from the python sandbox, ``parse``..."""
    calls = extra.get('calls') if isinstance(extra, dict) else None
    if not isinstance(calls, list):
        return []
    return [str(c.get('error_kind') or 'error') for c in calls if isinstance(c, dict) and c.get('ok') is False]


def select_views(views: Sequence[RequestView], *, uuids: Sequence[str] = (), states: Sequence[str] = (),
                 reasons: Sequence[str] = (), ranks: Sequence[int] = ()) -> List[RequestView]:
    """The requests that match every given filter: uuid (shell patterns, e.g. ``r1*``), a state
    the request went through, a finish reason (patterns: ``stop_rule:*``; ``none`` for
    unfinished), a rank. Each filter may list several values (any of them matches)."""
    out = []
    for v in views:
        if uuids and not any(fnmatch.fnmatchcase(v.uuid, u) for u in uuids):
            continue
        if states and not set(states) & set(v.states):
            continue
        if reasons and not any(fnmatch.fnmatchcase(v.reason or 'none', r) for r in reasons):
            continue
        if ranks and v.rank not in ranks:
            continue
        out.append(v)
    return out
