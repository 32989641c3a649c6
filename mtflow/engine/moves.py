"""Making and carrying out moves: the only place a request's state changes during a run.

A handler decides a :class:`~mtflow.core.records.Move` per request and changes nothing;
:func:`apply_moves` carries the moves out. A turn whose moves only change states (into
``tool_step``, back into ``generating``/``continuing``) goes through the graph in one pass
(:class:`~mtflow.core.records.TurnMoves`, :meth:`StateGraph.move_all`); a move that ends a
request first gets its output built, so that a failure there becomes its ``fail`` move instead of
a second move out of ``finished``.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from mtflow.core.calls import TIMED_OUT, Outcome
from mtflow.core.errors import SchedulerResultError, StepTimeout
from mtflow.core.machine import (COMPACTING, CONTINUE, ERROR, FAIL, FINISH, FINISHED, GENERATE, INTERRUPT,
                                 INTERRUPTED, TIMEOUT, TOOL_STEP, RequestRecord)
from mtflow.core.protocol import RolloutOutput
from mtflow.core.records import Move, TurnMoves
from mtflow.accounting.segments import is_continuation_of
from mtflow.engine.outputs import OutputFailed, detach_messages, finalized_output, notify_finished
from mtflow.engine.run_state import RunState, failure_of

__all__ = ['ENDING_TRIGGERS', 'fail_move', 'outcome_move', 'wait_move', 'apply_moves', 'interrupt_all']

#: the triggers into ``finished``: their moves build the output and run the finish hooks
ENDING_TRIGGERS = frozenset((FINISH, FAIL, INTERRUPT))
_NO_TURN_RESULT: dict = {}


def fail_move(rec: RequestRecord, turn: int, phase: str, exc: BaseException, reason: str = ERROR,
              tokens: Optional[int] = None) -> Move:
    """``fail``; ``tokens``: the completion tokens of this turn's output when it was applied (the
    trace counts them on the move that leaves ``generating``/``continuing``)."""
    return Move(rec, FAIL, turn, tokens=tokens or None, reason=reason, failure=failure_of(rec, turn, phase, exc))


def outcome_move(rec: RequestRecord, turn: int, phase: str, outcome: Outcome, tokens: Optional[int] = None) -> Move:
    """The ``fail`` move of a call's outcome that raised or timed out."""
    if outcome.kind == TIMED_OUT:
        err = StepTimeout(f'{phase} did not return within {outcome.value:g} s', uuid=rec.uuid, turn=turn, field=phase)
        return fail_move(rec, turn, phase, err, TIMEOUT, tokens)
    return fail_move(rec, turn, phase, outcome.value, tokens=tokens)


def wait_move(rec: RequestRecord, turn: int, duration: Optional[float] = None, extra: Optional[dict] = None) -> Move:
    """Into ``generating`` or ``continuing``, by the contract's continuation rule (``fail``
    when the messages cannot be read)."""
    try:
        trigger = CONTINUE if is_continuation_of(rec.request.messages) else GENERATE
    except Exception as exc:
        err = SchedulerResultError(f'messages must be a list of {{role, content}} dicts: {type(exc).__name__}: '
                                   f'{exc}', uuid=rec.uuid, turn=turn, field='messages')
        return fail_move(rec, turn, 'step' if rec.state == TOOL_STEP else 'input', err)
    return Move(rec, trigger, turn, duration=duration, extra=extra)


def apply_moves(run: RunState, moves: Sequence[Move]) -> None:
    """Carry out ``moves`` in order (the trace records them in that order). A handler's
    :class:`TurnMoves` with no move into ``finished`` goes through the graph in one pass."""
    graph, recorder = run.graph, run.recorder
    if moves.__class__ is TurnMoves and not moves.ending:
        graph.move_all(moves.records, moves.triggers, moves.turn, recorder, moves.tokens, moves.durations, moves.extras)
        return
    for mv in moves:
        if mv.trigger in ENDING_TRIGGERS:
            _end_request(run, mv)
        else:
            graph.move(mv.record, mv.trigger, mv.turn, recorder, mv.tokens, mv.duration, mv.extra)


def _end_request(run: RunState, mv: Move) -> None:
    """A move into ``finished``: the output built (a failure there turns ``finish`` into
    ``fail``), the move, then the finish hooks."""
    rec = mv.record
    if mv.trigger == FINISH:
        mv = _finishing(run, mv)
    if mv.trigger != FINISH:
        _failing(run, mv)
    extra = mv.extra
    if mv.failure is not None:
        extra = {'error': mv.failure.to_dict()}
    if rec.finalize_trace is not None:  # what finalize_output asked the finish event to carry
        extra = {**(extra or {}), **rec.finalize_trace}
    run.graph.move(rec, mv.trigger, mv.turn, run.recorder, mv.tokens, mv.duration, extra)
    if rec.state == FINISHED:
        notify_finished(run, rec)


def _finishing(run: RunState, mv: Move) -> Move:
    """A normal finish: the accounting's last turn, then the output; the ``fail`` move of
    whichever fails."""
    rec, turn = mv.record, mv.turn
    try:
        if rec.state == COMPACTING:  # the step accumulated the last turn already (docs/context.md)
            after_step = getattr(run.accounting, 'finalize_after_step', None)
            if after_step is not None:
                after_step(rec, rec.choice)
        else:
            run.accounting.finalize(rec, rec.choice, rec.turn_result or _NO_TURN_RESULT)
    except Exception as exc:  # e.g. ms-swift 4.6's get_response_token_data rejects a mask
        return fail_move(rec, turn, 'finalize', exc, tokens=mv.tokens)
    rec.reason = mv.reason
    try:
        rec.output = finalized_output(run, rec, rec.turns, strict=True)
    except OutputFailed as failed:  # the output cannot be built, or finalize_output failed
        return fail_move(rec, turn, failed.phase, failed.exc, tokens=mv.tokens)
    return mv


def _failing(run: RunState, mv: Move) -> None:
    """A failed or interrupted request: its failure kept, its partial output built."""
    rec = mv.record
    rec.reason = mv.reason or ERROR
    if mv.trigger == FAIL:
        rec.turns = mv.turn
    if mv.failure is not None:
        run.failures.append(mv.failure)
        rec.error = mv.failure
    if rec.reason in (TIMEOUT, INTERRUPTED):
        detach_messages(rec)  # an abandoned step may still write into them
    rec.output = finalized_output(run, rec, rec.turns)


def interrupt_all(run: RunState) -> None:
    """Finish every request still live with reason ``interrupted`` (partial outputs); finished
    requests keep their outputs untouched. Runs while an interrupt unwinds, so a second one
    still leaves every request finished."""
    moves: List[Move] = [Move(rec, INTERRUPT, rec.turns, reason=INTERRUPTED) for rec in run.records
                         if rec.state != FINISHED]
    for mv in moves:
        rec = mv.record
        try:
            _failing(run, mv)
        except BaseException:  # pragma: no cover - a second interrupt: keep what can be built
            rec.output = RolloutOutput.model_construct(messages=getattr(rec.request, 'messages', None))
        run.graph.move(rec, INTERRUPT, rec.turns, run.recorder, extra=rec.finalize_trace)
        try:
            notify_finished(run, rec)
        except BaseException:  # pragma: no cover - a second interrupt while notifying
            pass
