"""Records that rest in ``tool_step``: their step answered :class:`~mtflow.core.records.Wait`
(they wait for other requests of the run: a role of a multi-agent episode waiting for the
others, ``docs/multi-agent.md``).

A resting record has no move, no model call and no slot until its wait is done; then the driver
brings the wait's outcome as ``record.step_outcome`` and hands the record to the ``tool_step``
handler like any step that ran as its own task. What every driver shares about it is here: the
outcome of a wait (done, past its deadline, or not yet), how the async driver awaits one, and the
failure of records that rest while nothing else of the run can act (a deadlock).
"""
from __future__ import annotations

import asyncio
from time import perf_counter
from typing import Any, List, Optional

from mtflow.core.calls import OK, RAISED, TIMED_OUT, Outcome, within
from mtflow.core.errors import DeadlockError
from mtflow.core.machine import RequestRecord
from mtflow.core.records import Move, Wait
from mtflow.engine.moves import fail_move

__all__ = ['wait_outcome', 'awaited_wait', 'deadlock_moves', 'stuck_waits']


def wait_outcome(wait: Wait, timeout: Optional[float]) -> Optional[Outcome]:
    """The outcome of a record's wait when it has one: its future's result (the step's real result)
    or exception, or a timeout past ``timeout`` seconds from its step's start; ``None``: not yet."""
    until = wait.until
    elapsed = perf_counter() - wait.started
    if until.done():
        if getattr(until, 'cancelled', lambda: False)():
            return Outcome(RAISED, asyncio.CancelledError(f'the wait was cancelled: {wait.why}'), elapsed)
        exc = until.exception()
        return Outcome(OK, until.result(), elapsed) if exc is None else Outcome(RAISED, exc, elapsed)
    if timeout is not None and elapsed > timeout:
        return Outcome(TIMED_OUT, timeout, elapsed)
    return None


async def awaited_wait(wait: Wait, timeout: Optional[float]) -> Outcome:
    """The async driver's way to rest: await the wait's future (never cancelling it: it belongs to
    whatever the record waits for) within what is left of the step's deadline."""
    until = wait.until if asyncio.isfuture(wait.until) else asyncio.wrap_future(wait.until)
    left = None if timeout is None else max(timeout - (perf_counter() - wait.started), 0.0)
    outcome = await within(asyncio.shield(until), left, wait.started)
    if outcome.kind == TIMED_OUT:
        outcome.value = timeout
    return outcome


def stuck_waits(flight: Any, queue: Any) -> List[RequestRecord]:
    """The resting records of an async run whose waits nothing can end: every task in
    ``flight`` (:class:`~mtflow.engine.in_flight.InFlight`) is such a wait, none has ended, and
    nothing is queued or completed; their tasks are dropped (``[]``: none such)."""
    waking = flight.waking
    if not waking or len(waking) != len(flight.tasks) or flight.completions or queue:
        return []
    if any(rec.waiting is None or rec.waiting.until.done() for rec in waking.values()):
        return []  # a wait that ended, its task not run yet
    stuck = list(waking.values())
    for rec in stuck:
        flight.forget(rec)
    return stuck


def deadlock_moves(records: List[RequestRecord], turn: int) -> List[Move]:
    """The ``fail`` moves of records that rest while nothing else of the run can act: nothing
    would ever end their waits (phase ``step``, a :class:`DeadlockError` naming what each waits
    for)."""
    moves = []
    for rec in records:
        why = rec.waiting.why if rec.waiting is not None else ''
        err = DeadlockError(f'its step waits for other requests of the run ({why or "no reason given"}) and none of '
                            f'them can act any more', uuid=rec.uuid, turn=rec.turns or turn, field='step')
        rec.waiting = None
        moves.append(fail_move(rec, rec.turns or turn, 'step', err))
    return moves
