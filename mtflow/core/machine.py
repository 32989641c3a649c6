"""The per-request state machine: states, triggers, finish reasons, and the declared graph.

The graph is declared once with the ``transitions`` library (see :class:`StateGraph`) and compiled
into a plain ``{state: {trigger: dest}}`` table. Requests do not become ``transitions`` models:
attaching thousands of models to a ``Machine`` is quadratic and costs kilobytes per model. Each
request is a :class:`RequestRecord` (``__slots__``) whose ``state`` moves only through
:meth:`StateGraph.move`, which consults the compiled table and raises
:class:`IllegalTransition` for any move the declaration does not allow. What a request does in
each state is its handler's (``mtflow.engine.handlers.STATE_HANDLERS``, one per state).

The same declaration feeds validation, the executor's legal moves and the diagrams
(:meth:`StateGraph.mermaid`), so they cannot drift apart.
"""
from __future__ import annotations

from time import perf_counter
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mtflow.core.errors import IllegalTransition

# States (plain interned strings: cheap to compare and to write into traces).
PENDING = 'pending'
GENERATING = 'generating'
CONTINUING = 'continuing'
TOOL_STEP = 'tool_step'
COMPACTING = 'compacting'  # the next prompt does not fit the context budget: stop, or compact it
FINISHED = 'finished'
STATES: Tuple[str, ...] = (PENDING, GENERATING, CONTINUING, TOOL_STEP, COMPACTING, FINISHED)
WAITING_STATES = frozenset((GENERATING, CONTINUING))  # waiting for the model's output
#: states only some runs enter (``compacting``: a run with a context budget); a trace's drawing
#: leaves them out when the trace never entered them
OPTIONAL_STATES = frozenset((COMPACTING, ))

# Triggers.
GENERATE = 'generate'  # the next request adds a message: a new assistant message follows
CONTINUE = 'continue_message'  # the next request ends with an assistant message: continue it
RUN_STEP = 'run_step'  # the output is applied and the request goes on: the scheduler's step runs (from
# ``pending``: a request that opens in its step, e.g. a role that waits for the others before its first turn)
FINISH = 'finish'  # the output is applied and the request stops
FAIL = 'fail'  # a hook, a step or rollout_fn failed (or missed its deadline) for this request
INTERRUPT = 'interrupt'  # the run was interrupted (Ctrl-C) before this request finished
COMPACT = 'compact'  # the next prompt would not fit the context budget (``docs/context.md``)
FORK = 'fork'  # the record is copied into children that share its history; every one stays where it is

# Finish reasons (a stop rule of a declarative scheduler adds ``stop_rule:<name>``).
DONE_BY_HOOK = 'done_by_hook'
CHECK_FINISHED = 'check_finished'
MAX_TURNS = 'max_turns'
LENGTH = 'length'
ERROR = 'error'
TIMEOUT = 'timeout'
INTERRUPTED = 'interrupted'
TURN_CAP = 'turn_cap'
REPLAY_DIVERGED = 'replay_diverged'
CONTEXT_FULL = 'context_full'
LENGTH_TOTAL = 'length_total'
CLIENT_FINISHED = 'client_finished'
IDLE_TIMEOUT = 'idle_timeout'
AGENT_TIMEOUT = 'agent_timeout'
EPISODE_DONE = 'episode_done'
ROLE_FAILED = 'role_failed'

#: Every core finish reason, once: ``(reason, kind, when)``. ``kind`` is how the viewer colours
#: it (``ok``: the scheduler stopped it; ``limit``: a bound stopped it; ``error``: it failed);
#: ``when`` is its documentation (``docs/state-machine.md`` is checked against it). Adding a
#: finish reason is one line here.
FINISH_REASON_TABLE: Tuple[Tuple[str, str, str], ...] = (
    (DONE_BY_HOOK, 'ok', '`on_turn_end` (or a `step`) returned a truthy `done` (a hook may name its own reason with '
     'the mtflow extension key `finish_reason`, e.g. a YAML stop rule\'s `stop_rule:<name>`)'),
    (CHECK_FINISHED, 'ok', 'the scheduler\'s own `check_finished` returned true (and `on_turn_end` had no `done` key)'),
    (MAX_TURNS, 'limit', 'a turn bound was reached: the executor\'s `max_turns`, or the scheduler\'s own '
     '`max_turns` (native API: whatever hooks it overrides; `run_multi_turn`: through the default `check_finished`)'),
    (LENGTH, 'limit', 'the default `check_finished` stopped because the output\'s `finish_reason` was `\'length\'`'),
    (ERROR, 'error', 'the request failed; the failure (phase, turn, exception) is kept, see `docs/executor.md`'),
    (TIMEOUT, 'error', 'a step ran past `step_timeout_s`, or the `rollout_fn` call serving it past `rollout_timeout_s`'),
    (TURN_CAP, 'limit', 'the run had no turn bound anywhere and reached the executor\'s safety cap `turn_cap` '
     '(a warning says so)'),
    (INTERRUPTED, 'limit', 'the run was interrupted (Ctrl-C, `SystemExit`) before the request finished; '
     '`RolloutInterrupted.result` holds its partial output'),
    (REPLAY_DIVERGED, 'limit', '`mtflow replay`: the prompt of this turn is not the one the recorded output answered '
     '(the environment, a tool or the scheduler answered differently), so the record cannot go on; the output '
     'of this turn is not applied (`docs/replay.md`)'),
    (CONTEXT_FULL, 'limit', 'the next prompt plus its `max_tokens` would not fit the context budget and the '
     'compaction policy stopped it (`stop`) or could not make it fit (`docs/context.md`)'),
    (LENGTH_TOTAL, 'limit', 'the trajectory\'s total response-token budget (`context.total_response_tokens`) was '
     'used up: the last turn, its `max_tokens` cut to what was left, ended on `length`, or nothing was left for the '
     'next turn (`docs/context.md`)'),
    (CLIENT_FINISHED, 'ok', 'a gateway session\'s client ended it (`POST /s/<session>/finish`, or `mtflow run`\'s '
     '`agent:` once the agent exited): its `step` returned `done` (`docs/gateway.md`)'),
    (IDLE_TIMEOUT, 'limit', 'a gateway session made no call and no finish for `gateway.idle_timeout_s`: the deadline '
     'of its `tool_step` (`docs/gateway.md`)'),
    (AGENT_TIMEOUT, 'limit', '`mtflow run`\'s `agent:` killed the agent (its whole process tree) at '
     '`agent.timeout_s`; the verifier still gives its reward (`docs/gateway.md`)'),
    (EPISODE_DONE, 'ok', 'the environment of a multi-agent episode ended it: every role still playing finishes '
     'with it, its reward the one the environment gave that role (`docs/multi-agent.md`)'),
    (ROLE_FAILED, 'limit', 'another role of the same multi-agent episode failed, timed out or stopped early, which '
     'ended the episode; this role\'s trajectory is kept as it was, and `rollout_infos.episode.ended_by` names the '
     'role and why (`docs/multi-agent.md`)'),
)
FINISH_REASONS: Tuple[str, ...] = tuple(row[0] for row in FINISH_REASON_TABLE)
FAILURE_REASONS = frozenset(row[0] for row in FINISH_REASON_TABLE if row[1] == 'error')
STOP_RULE_PREFIX = 'stop_rule:'
_REASON_KINDS: Dict[str, str] = {row[0]: row[1] for row in FINISH_REASON_TABLE}


def finish_reasons_markdown() -> str:
    """The finish-reason table of ``docs/state-machine.md``, generated from
    :data:`FINISH_REASON_TABLE` (a test keeps the page equal to it)."""
    rows = ['| reason | kind | set when |', '|---|---|---|']
    rows += [f'| `{reason}` | {kind} | {when} |' for reason, kind, when in FINISH_REASON_TABLE]
    rows.append(f'| `{STOP_RULE_PREFIX}<name>` | ok | a declarative scheduler\'s stop rule matched (see '
                '`docs/declarative.md`) |')
    return '\n'.join(rows) + '\n'


def reason_kind(reason: Optional[str]) -> str:
    """``'ok'``, ``'limit'`` or ``'error'`` for a finish reason (``stop_rule:*`` and any reason a
    scheduler adds are ``'ok'``), ``'none'`` for ``None`` (not finished)."""
    if reason is None:
        return 'none'
    return _REASON_KINDS.get(reason, 'ok')


#: The core declaration, in ``transitions``' own format.
CORE_TRANSITIONS: List[Dict[str, Any]] = [
    {'trigger': GENERATE, 'source': [PENDING, TOOL_STEP, COMPACTING], 'dest': GENERATING},
    {'trigger': CONTINUE, 'source': [PENDING, TOOL_STEP, COMPACTING], 'dest': CONTINUING},
    {'trigger': RUN_STEP, 'source': [PENDING, GENERATING, CONTINUING], 'dest': TOOL_STEP},
    {'trigger': COMPACT, 'source': [PENDING, TOOL_STEP], 'dest': COMPACTING},
    {'trigger': FINISH, 'source': [GENERATING, CONTINUING, TOOL_STEP, COMPACTING], 'dest': FINISHED},
    {'trigger': FAIL, 'source': [PENDING, GENERATING, CONTINUING, TOOL_STEP, COMPACTING], 'dest': FINISHED},
    {'trigger': INTERRUPT, 'source': [PENDING, GENERATING, CONTINUING, TOOL_STEP, COMPACTING], 'dest': FINISHED},
    # reflexive: the parent stays in its state, each child is born in it (``docs/branching.md``);
    # ``pending``: a copy of the prompt that tops a tree up to its leaf budget
    {'trigger': FORK, 'source': [PENDING, GENERATING, CONTINUING, TOOL_STEP], 'dest': '='},
]
#: the states a record may be forked in (the sources of ``fork``)
FORK_STATES = frozenset(next(t for t in CORE_TRANSITIONS if t['trigger'] == FORK)['source'])

class StateGraph:
    """The declared state graph of one scheduler.

    Built once per executor (per scheduler), never per request. ``finish_reasons`` lists the
    reasons the scheduler can finish with (a declarative scheduler adds its stop rules); they
    label the ``finished`` state in diagrams and are checked when a request finishes.
    """

    def __init__(self, finish_reasons: Sequence[str] = FINISH_REASONS, name: str = 'mtflow') -> None:
        from transitions import Machine  # the declaration's single source of truth

        self.name = name
        self.finish_reasons: Tuple[str, ...] = tuple(dict.fromkeys(finish_reasons))
        self._machine = Machine(
            model=None, states=list(STATES), transitions=CORE_TRANSITIONS, initial=PENDING, auto_transitions=False)
        table: Dict[str, Dict[str, str]] = {state: {} for state in STATES}
        for trigger, event in self._machine.events.items():
            for source, transitions in event.transitions.items():
                table[source][trigger] = transitions[0].dest
        self.table = table

    @property
    def states(self) -> Tuple[str, ...]:
        return STATES

    def edges(self) -> List[Tuple[str, str, str]]:
        """``(source, trigger, dest)`` for every declared move."""
        return [(src, trig, dst) for src, moves in self.table.items() for trig, dst in moves.items()]

    def move(self, record: 'RequestRecord', trigger: str, turn: int, recorder: Any = None,
             tokens: Optional[int] = None, duration: Optional[float] = None, extra: Optional[dict] = None) -> str:
        """The one way a request changes state: move ``record`` by ``trigger`` (raising
        :class:`IllegalTransition` if the declaration does not allow it) and, when ``recorder``
        (a :class:`mtflow.core.trace.TraceRecorder`) is given, record the transition, also in the
        record's own event list when it keeps one. A move into ``finished`` carries the record's
        ``reason``."""
        src = record.state
        dest = self.table[src].get(trigger)
        if dest is None:
            raise IllegalTransition(record.uuid, src, trigger)
        record.state = dest
        if recorder is not None:
            event = (record.index, turn, src, dest, trigger, record.reason if dest == FINISHED else None, tokens,
                     duration, perf_counter() - recorder.t0, extra)
            recorder.raw.append(event)
            if record.events is not None:
                record.events.append(event)
        return dest

    def move_all(self, records: Sequence['RequestRecord'], triggers: Sequence[str], turn: int, recorder: Any = None,
                 tokens: Optional[Sequence[Optional[int]]] = None,
                 durations: Optional[Sequence[Optional[float]]] = None,
                 extras: Optional[Sequence[Optional[dict]]] = None) -> None:
        """:meth:`move` for each record in turn (``triggers[k]``, ``tokens[k]``, ... for
        ``records[k]``; ``None`` lists: ``None`` for each): the same checks, the same events in
        the same order, without a call per record (a handler's common moves,
        :class:`mtflow.core.records.TurnMoves`)."""
        table = self.table
        n = len(records)
        tokens = tokens if tokens is not None else (None, ) * n
        durations = durations if durations is not None else (None, ) * n
        extras = extras if extras is not None else (None, ) * n
        raw = recorder.raw if recorder is not None else None
        t0 = recorder.t0 if recorder is not None else 0.0
        for record, trigger, tok, dur, extra in zip(records, triggers, tokens, durations, extras):
            src = record.state
            dest = table[src].get(trigger)
            if dest is None:
                raise IllegalTransition(record.uuid, src, trigger)
            record.state = dest
            if raw is not None:
                event = (record.index, turn, src, dest, trigger, record.reason if dest == FINISHED else None, tok, dur,
                         perf_counter() - t0, extra)
                raw.append(event)
                if record.events is not None:
                    record.events.append(event)

    def fork(self, record: 'RequestRecord', children: Sequence['RequestRecord'], turn: int, recorder: Any = None,
             extra: Optional[dict] = None, child_extras: Optional[Sequence[Optional[dict]]] = None,
             parent_event: bool = True) -> None:
        """The ``fork`` move: ``record`` stays in its state (raising :class:`IllegalTransition`
        when the declaration does not allow a fork there) and each of ``children`` (new records)
        is born in that state; one ``fork`` event for the parent (``extra``; none with
        ``parent_event=False``: a tree's prompt, which is no request of the run) and one for each
        child (``child_extras[k]``), recorded as :meth:`move` records them."""
        src = record.state
        dest = self.table[src].get(FORK)
        if dest is None:
            raise IllegalTransition(record.uuid, src, FORK)
        extras = child_extras if child_extras is not None else (None, ) * len(children)
        for child in children:
            child.state = dest
        if recorder is None:
            return
        for rec, rec_extra in ([(record, extra)] if parent_event else []) + list(zip(children, extras)):
            event = (rec.index, turn, src, dest, FORK, None, None, None, perf_counter() - recorder.t0, rec_extra)
            recorder.raw.append(event)
            if rec.events is not None:
                rec.events.append(event)

    def mermaid(self) -> str:
        """The graph as mermaid ``stateDiagram-v2`` text, drawn by ``transitions``' own mermaid engine
        from the same declaration, with the finish reasons noted on ``finished``."""
        from transitions.extensions.diagrams import GraphMachine

        graph = GraphMachine(
            states=list(STATES),
            transitions=CORE_TRANSITIONS,
            initial=PENDING,
            auto_transitions=False,
            graph_engine='mermaid',
            title=self.name,
            show_state_attributes=False)
        text = graph.get_graph().draw(None)
        # transitions marks the model's current (initial) state as active; a declaration has none.
        text = text.replace(f'Class {PENDING} s_active', f'Class {PENDING} s_default')
        note = '\\n'.join(self.finish_reasons)
        return f'{text.rstrip()}\n  {FINISHED} --> [*]\n  note right of {FINISHED}\n    reasons: {note}\n  end note\n'


class RequestRecord:
    """Everything the executor keeps for one request: small, flat, slotted.

    ``ids``/``mask``/``logprobs`` are the per-turn segments that become ``response_token_ids``,
    ``response_loss_mask`` and ``rollout_logprobs``; ``infos`` becomes ``rollout_infos``.
    """
    __slots__ = ('index', 'uuid', 'request', 'state', 'reason', 'turns', 'is_continuation', 'ids', 'mask', 'logprobs',
                 'infos', 'response', 'output', 'error', 'events', 'incoming', 'choice', 'tokens', 'turn_result',
                 'finalize_trace', 'segment_start', 'turn_rewards', 'step_outcome',
                 # what the drivers keep while the request is in flight (async mode, streams):
                 'admission', 'issued_version', 'sent_record', 'group', 'resume_from', 'resumed_spans',
                 # a context budget's count of it (engine/context.py's ContextUse), made when first needed:
                 'context_use',
                 # its place in a branched rollout's tree (``mtflow.engine.branching.Branch``), or None:
                 'branch',
                 # the wait its step answered with (``mtflow.core.records.Wait``) while it rests in tool_step:
                 'waiting')

    def __init__(self, index: int, uuid: str, request: Any) -> None:
        self.index = index
        self.uuid = uuid
        self.request = request
        self.state = PENDING
        self.reason: Optional[str] = None
        self.turns = 0
        self.is_continuation = False
        self.ids: List[List[int]] = []
        self.mask: List[List[int]] = []
        self.logprobs: List[List[float]] = []
        self.infos: Dict[str, Any] = {}
        self.response: Any = None
        self.output: Any = None
        self.error: Any = None
        self.events: Optional[list] = None  # this request's raw trace events (kept only for on_finished)
        # this turn's data, handed from phase to phase:
        self.incoming: Any = None  # the output rollout_fn returned for it (waiting)
        self.choice: Any = None  # the applied output's choice (tool_step, finishing)
        self.tokens = 0  # completion tokens of the applied output
        self.turn_result: Any = None  # what on_turn_end returned (validated)
        self.finalize_trace: Optional[Dict[str, Any]] = None  # finalize_output's trace_info, for the finish event
        self.segment_start = 0  # turns before the current training segment (a compaction starts one)
        #: the ``turn_reward`` hook's entries (the executor's; a scheduler's own are in ``infos``)
        self.turn_rewards: List[Dict[str, Any]] = []
        self.step_outcome: Any = None  # its step's outcome, when a driver ran the step as its own task
        # in flight under the async and stream drivers (forgetting a request is dropping its record):
        self.admission: Any = None  # its move into the model's turn, made at admission, carried out at its slot
        self.issued_version: Optional[int] = None  # the policy version its generation in flight was issued at
        self.sent_record: Any = None  # its token record when that generation was issued (restored if dropped)
        self.group: Any = None  # its stream group (``mtflow.engine.stream_groups.InFlightGroup``)
        self.resume_from: Any = None  # the segments of its turn cut by an update (``on_update='resume'``)
        self.resumed_spans: Any = None  # a merged turn's per-segment versions, until the turn is applied
        self.context_use: Any = None  # a context budget's count (``mtflow.engine.context.ContextUse``)
        self.branch: Any = None  # its tree, parent and leaf budget (``mtflow.engine.branching.Branch``)
        self.waiting: Any = None  # resting in tool_step: what its step waits for (``mtflow.core.records.Wait``)

    def __repr__(self) -> str:
        reason = f'({self.reason})' if self.reason else ''
        return f'<RequestRecord {self.uuid} {self.state}{reason} turns={self.turns}>'
