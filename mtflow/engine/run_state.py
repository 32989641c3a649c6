"""The state of one :meth:`mtflow.Executor.run` call, shared by the pieces that carry it out.

Both drivers (lockstep, async) compose a :class:`RunState`: the handlers, the moves and the
outputs read and write it, so the two drivers run the same code on the same data. It is built per
call, so an executor can be reused and nothing leaks from one batch into the next.
"""
from __future__ import annotations

import asyncio
import traceback
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from mtflow.core.calls import RAISED, TIMED_OUT, Caller
from mtflow.core.errors import RequestFailure, StepTimeout
from mtflow.core.machine import MAX_TURNS, TURN_CAP, RequestRecord, StateGraph
from mtflow.core.protocol import OutputBuilder, RolloutOutput
from mtflow.core.scheduler import HookSet
from mtflow.core.trace import TraceRecorder
from mtflow.core.types import Accounting, GatherFn, RolloutFn
from mtflow.engine.options import ExecutorOptions

__all__ = ['RunSettings', 'RunState', 'failure_of', 'uuid_of']


@dataclass(frozen=True)
class RunSettings:
    """What every run of one executor reads: the options, the scheduler's hooks and state graph,
    the model call, and the defaults resolved against the scheduler (built once, by the executor)."""
    options: ExecutorOptions
    hooks: HookSet
    graph: StateGraph
    rollout_fn: RolloutFn
    request_config: Any
    accounting: Accounting
    gather_fn: GatherFn
    unique_uuids: bool
    turn_bound: Optional[int]
    #: the context budget resolved against the backend (``mtflow.engine.context.ResolvedContext``)
    context: Optional[Any] = None
    #: the most requests started and not finished, when the scheduler opens an environment
    #: session per request and ``admission.env_sessions`` bounds them (``mtflow.engine.admission``)
    session_bound: Optional[int] = None
    #: the sessions one prompt may hold at once under that bound (a branched run: its tree's leaf
    #: budget; :func:`mtflow.engine.admission.sessions_per_prompt`)
    prompt_sessions: int = 1
    #: where requests fork (``mtflow.engine.branching.Branching``), or ``None``: no forks
    branching: Optional[Any] = None


def uuid_of(request: Any, index: int) -> str:
    """A request's uuid, or ``#<index>`` for a request without one (the trace names it so)."""
    uuid = getattr(request, 'uuid', None)
    return str(uuid) if uuid else f'#{index}'


def failure_of(rec: RequestRecord, turn: int, phase: str, exc: BaseException) -> RequestFailure:
    """The failure record of ``exc`` for one request, with its formatted traceback."""
    return RequestFailure(rec.index, rec.uuid, turn, phase, exc,
                          ''.join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


class RunState:
    """One run's records (one per request, input order), failures, trace recorder and counters,
    with the settings they are driven by."""

    def __init__(self, settings: RunSettings, loop: asyncio.AbstractEventLoop, requests: List[Any],
                 first_turn_outputs: Optional[Sequence[Any]] = None) -> None:
        options = settings.options
        self.settings = settings
        self.options = options
        self.graph = settings.graph
        self.hooks = settings.hooks
        self.accounting = settings.accounting
        self.loop = loop
        self.caller = Caller(loop, eager=options.eager_coroutines)
        #: the caller's list: its entries are replaced by the requests that steps return
        self.requests = requests
        self.first_turn_outputs = first_turn_outputs
        self.records = [RequestRecord(i, uuid_of(req, i), req) for i, req in enumerate(requests)]
        self.failures: List[RequestFailure] = []
        self.recorder = TraceRecorder(options.rank) if options.trace else None
        if self.recorder is not None:
            self.recorder.uuids = [r.uuid for r in self.records]
            if options.on_finished is not None:  # on_finished hands each request its own events
                for rec in self.records:
                    rec.events = []
        self.limit = settings.turn_bound or options.turn_cap
        self.limit_reason = MAX_TURNS if settings.turn_bound else TURN_CAP
        self.rollout_calls = 0
        self.loops = 0  # turns in which some rank had live requests (RunResult.turns)
        self.turn = 1
        self.ended = False  # on_trajectory_end ran
        if options.output_cls is not None:
            self.output_cls = options.output_cls
        elif first_turn_outputs:  # an ms-swift caller gets ms-swift's output class back
            self.output_cls = type(first_turn_outputs[0])
        else:
            self.output_cls = RolloutOutput
        self.builder = OutputBuilder(self.output_cls)
        #: the context budget's per-request state (``mtflow.engine.context.ContextRun``), or ``None``
        self.context: Optional[Any] = settings.context.start() if settings.context is not None else None
        self.branching = settings.branching
        #: the index the next record made during the run gets (a fork's child; a stream's member)
        self.next_index = len(self.records)
        #: ``records`` holds every record of the run (a stream keeps only its records in flight, on
        #: its groups, and sets this to ``False``)
        self.keeps_records = True
        #: records that entered the run since the driver last looked (:meth:`take_entering`)
        self.entering: List[RequestRecord] = []

    def take_index(self) -> int:
        """The index of a record made during the run (a fork's child, a stream's member): one
        counter for all of them, so no two records of the run share an index."""
        index = self.next_index
        self.next_index += 1
        return index

    def add_records(self, records: List[RequestRecord]) -> None:
        """New records (a fork's children) enter the run: kept with the others (and their requests
        appended to the caller's list, so that ``outputs[i]`` answers ``requests[i]``), named in the
        trace, in their parent's stream group (delivered when they finish too), and handed to the
        driver by :meth:`take_entering`."""
        for rec in records:
            if rec.group is not None:
                rec.group.records.append(rec)
            if self.keeps_records:
                self.records.append(rec)
                if self.recorder is not None:
                    self.recorder.uuids.append(rec.uuid)
                if isinstance(self.requests, list):
                    self.requests.append(rec.request)
            if self.recorder is not None and rec.events is None and (
                    not self.keeps_records or self.options.on_finished is not None):
                rec.events = []  # its own events (a stream's groups, on_finished), as its parent's
        self.entering.extend(records)

    def take_entering(self) -> List[RequestRecord]:
        """The records that entered the run since the last call (the driver admits them as it
        admits any record: lockstep into the turn, async and streams into the queue)."""
        entering, self.entering = self.entering, []
        return entering

    def await_value(self, awaitable: Any) -> Any:
        """The value of an awaitable a sync-looking hook returned, on the run's private loop,
        under ``step_timeout_s``; its exception (or a :class:`StepTimeout`) is raised."""
        outcome = self.caller.awaited(awaitable, self.options.step_timeout_s)
        if outcome.kind == RAISED:
            raise outcome.value
        if outcome.kind == TIMED_OUT:
            raise StepTimeout(f'did not return within {outcome.value:g} s')
        return outcome.value
