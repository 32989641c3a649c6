"""Small named records the executor hands around: to callers (:class:`FinishedRequest`) and
between the phases of a turn.

They are plain slotted dataclasses: cheap to build once per request-turn, and self-describing
where the first version passed 6-field tuples between phases.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from mtflow.core.errors import RequestFailure
from mtflow.core.trace import TraceEvent

__all__ = ['FinishedRequest', 'Move']


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


@dataclass(slots=True)
class Move:
    """What a handler returns for one request: the trigger to fire, with what the trace records
    about it, and, for moves into ``finished``, the reason (and the failure, if any).

    The handler decides; :meth:`mtflow.engine.executor.BatchRun.apply` carries the moves out (builds the
    outputs of finishing requests, moves them through the graph, runs the finish hooks), so a
    handler never changes a state itself."""
    record: Any  # mtflow.core.machine.RequestRecord
    trigger: str
    turn: int
    tokens: Optional[int] = None
    duration: Optional[float] = None
    extra: Optional[dict] = None
    reason: Optional[str] = None
    failure: Optional[RequestFailure] = None
