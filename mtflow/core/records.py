"""Small named records the executor hands around: to callers (:class:`FinishedRequest`) and
between the phases of a turn (:class:`Move`, :class:`TurnMoves`).

They are slotted: cheap to build once per request-turn, and each field named, so a phase's
result says what it holds.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from mtflow.core.errors import RequestFailure
from mtflow.core.machine import RequestRecord
from mtflow.core.trace import TraceEvent

__all__ = ['FinishedRequest', 'Move', 'TurnMoves', 'Wait']


@dataclass(slots=True)
class FinishedRequest:
    """One request whose output is final, handed to ``Executor(on_finished=...)`` the moment it
    is (in the driver's thread), on every finish path: a normal stop, an error, a timeout, an
    interrupt.

    ``events`` are that request's own trace events (``[]`` with ``trace=False``), so a writer
    (e.g. a crash-safe run directory) can store the trajectory and its trace together without
    waiting for the batch."""
    index: int
    uuid: str
    output: Any
    finish_reason: str
    failure: Optional[RequestFailure] = None
    events: List[TraceEvent] = field(default_factory=list)
    #: a branched run (``docs/branching.md``): the uuid of the request it was forked from
    #: (``None``: a root), and the index of its tree's root among the run's inputs
    parent: Optional[str] = None
    root_index: Optional[int] = None


@dataclass(slots=True)
class Move:
    """What a handler returns for one request: the trigger to fire, with what the trace records
    about it, and, for moves into ``finished``, the reason (and the failure, if any).

    The handler decides; :func:`mtflow.engine.moves.apply_moves` carries the moves out (builds
    the outputs of finishing requests, moves them through the graph, runs the finish hooks), so
    a handler never changes a state itself."""
    record: RequestRecord
    trigger: str
    turn: int
    tokens: Optional[int] = None
    duration: Optional[float] = None
    extra: Optional[dict] = None
    reason: Optional[str] = None
    failure: Optional[RequestFailure] = None


class Wait:
    """What a ``step`` returns when its request must wait for *other requests of the run* before
    it can go on (a role of a multi-agent episode waiting for the others, ``docs/multi-agent.md``),
    instead of awaiting them inside the step.

    A step that awaited another request's turn would hold its own: the lockstep driver runs a
    turn's steps together and cannot start the turn the other request waits for. So the step
    answers at once with ``Wait(until)``, ``until`` an ``asyncio.Future`` of the run's loop (made
    inside an ``async def`` step: ``asyncio.get_running_loop().create_future()``) that whatever
    the request waits for resolves: with the step's real result (any step result, another
    :class:`Wait` included), or with an exception that fails the request (phase ``step``). Until
    then the request *rests* in ``tool_step``: no move, no model call, no slot of
    ``max_concurrency``; every driver takes it up again when ``until`` is done, through the same
    ``tool_step`` handler, under the step's deadline (``step_timeout_s``, counted from the
    step's start). A request resting while nothing else of the run can act fails with a
    :class:`mtflow.core.errors.DeadlockError` naming ``why``: a wait is ended by the steps of other
    requests of the same run (on the same rank); a step that waits for something outside the run
    (an HTTP call, a gateway session's next call) awaits it inside the step instead.

    ``why``: what it waits for, in words ("episode e1, turn 3: player_1 waits for player_0")."""
    __slots__ = ('until', 'why', 'started')

    def __init__(self, until: Any, why: str = '') -> None:
        if not (callable(getattr(until, 'done', None)) and callable(getattr(until, 'result', None))):
            raise TypeError(f'Wait needs a future (done() and result()), got {type(until).__name__}')
        self.until = until
        self.why = why
        self.started = 0.0  # perf_counter() when its step began (set by the engine)

    def __repr__(self) -> str:
        return f'Wait({self.why or self.until!r})'


class TurnMoves(Sequence):
    """A handler's moves for a batch of records: one :class:`Move` per record, in order, kept as
    columns (``triggers[k]``, ``tokens[k]``, ... for ``records[k]``; a ``None`` column: ``None``
    for each).

    Most moves of a turn only change the state (into ``tool_step``, back into ``generating``), and
    columns let them go through the graph in one pass without an object per request and turn.
    The rare moves that end a request are kept whole in ``ending`` (position -> :class:`Move`).
    Indexing or iterating builds the :class:`Move` of each position."""
    __slots__ = ('records', 'triggers', 'turn', 'tokens', 'durations', 'extras', 'ending')

    def __init__(self, records: List[RequestRecord], triggers: List[str], turn: int,
                 tokens: Optional[List[Optional[int]]] = None, durations: Optional[List[Optional[float]]] = None,
                 extras: Optional[List[Optional[dict]]] = None, ending: Optional[Dict[int, Move]] = None) -> None:
        self.records = records
        self.triggers = triggers
        self.turn = turn
        self.tokens = tokens
        self.durations = durations
        self.extras = extras
        self.ending = ending

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, position: int) -> Move:  # type: ignore[override]
        if isinstance(position, slice):
            return [self[k] for k in range(*position.indices(len(self.records)))]  # type: ignore[return-value]
        if position < 0:
            position += len(self.records)
        if self.ending and position in self.ending:
            return self.ending[position]
        return Move(self.records[position], self.triggers[position], self.turn,
                    self.tokens[position] if self.tokens is not None else None,
                    self.durations[position] if self.durations is not None else None,
                    self.extras[position] if self.extras is not None else None)

    def __repr__(self) -> str:
        return f'TurnMoves({list(self)!r})'
