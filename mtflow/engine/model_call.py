"""The model's turn: one ``rollout_fn`` call for a set of records, and its outputs handed over.

A call that raises or misses ``rollout_timeout_s`` fails every request it served; a call that
returns the wrong number of outputs fails them too. Both drivers use these rules: lockstep calls
``rollout_fn`` once per turn with every live request, async mode once per request and turn.
"""
from __future__ import annotations

from typing import Any, List, Optional

from mtflow.core.calls import RAISED, TIMED_OUT, Outcome
from mtflow.core.errors import RolloutFnError, StepTimeout
from mtflow.core.machine import TIMEOUT, WAITING_STATES, RequestRecord
from mtflow.core.records import Move
from mtflow.engine.moves import apply_moves, fail_move
from mtflow.engine.run_state import RunState

__all__ = ['call_model', 'model_failure_moves', 'deliver', 'request_failed']


def call_model(run: RunState, records: List[RequestRecord], turn: int) -> Optional[Any]:
    """One ``rollout_fn`` call for ``records`` (possibly ``[]``: every rank calls it alike);
    the outputs, or ``None`` when the call failed (its requests are failed already). The outputs
    are not handed over here: the lockstep driver does that after the next gather, as ms-swift
    checks their count there (:func:`deliver`). With a context budget the budget makes the call
    (:meth:`mtflow.engine.context.ContextRun.call`: per-request ``max_tokens``)."""
    if run.context is not None:
        return run.context.call(run, records, turn)
    run.rollout_calls += 1
    settings = run.settings
    outcome = run.caller.one(settings.rollout_fn, ([r.request for r in records], settings.request_config),
                             run.options.rollout_timeout_s)
    if outcome.kind != RAISED and outcome.kind != TIMED_OUT:
        return outcome.value
    apply_moves(run, model_failure_moves(records, turn, outcome))
    return None


def model_failure_moves(records: List[RequestRecord], turn: int, outcome: Outcome) -> List[Move]:
    """The ``fail`` moves of the records a ``rollout_fn`` call served when it raised or timed out
    (``[]`` when it returned); each at the turn it was waiting for (``turn``, but for a tree's
    top-up copy that started mid-run, ``docs/branching.md``)."""
    if outcome.kind == TIMED_OUT:
        err = StepTimeout(f'rollout_fn did not return within {outcome.value:g} s', turn=turn, field='rollout_fn')
        return [fail_move(rec, _waiting_turn(rec, turn), 'rollout_fn', err, TIMEOUT) for rec in records]
    if outcome.kind == RAISED:
        exc = outcome.value
        err = RolloutFnError(f'rollout_fn raised {type(exc).__name__}: {exc}', turn=turn, field='rollout_fn')
        err.__cause__ = exc
        return [fail_move(rec, _waiting_turn(rec, turn), 'rollout_fn', err) for rec in records]
    return []


def _waiting_turn(rec: RequestRecord, turn: int) -> int:
    return rec.turns + 1 if rec.state in WAITING_STATES else turn


def request_failed(exc: BaseException, uuid: str, turn: int) -> RolloutFnError:
    """The error of a request whose output ``rollout_fn`` gave as an exception (a backend that
    cannot serve that request, e.g. one with images a token prompt cannot carry): it fails that
    request, the other requests of the call go on."""
    err = RolloutFnError(f'rollout_fn failed this request: {type(exc).__name__}: {exc}', uuid=uuid, turn=turn,
                         field='rollout_fn')
    err.__cause__ = exc
    return err


def deliver(run: RunState, records: List[RequestRecord], outputs: Any, turn: int) -> None:
    """Hand each record its output (``incoming``, read by the ``waiting`` handler); the wrong
    number of outputs fails them all."""
    returned = outputs
    try:
        outputs = list(outputs)
    except TypeError:
        outputs = None
    if outputs is None or len(outputs) != len(records):
        got = f'{len(outputs)} output(s)' if outputs is not None else f'a {type(returned).__name__}'
        err = RolloutFnError(f'rollout_fn returned {got} for {len(records)} request(s)', turn=turn, field='outputs')
        apply_moves(run, [fail_move(rec, _waiting_turn(rec, turn), 'rollout_fn', err) for rec in records])
        return
    for rec, out in zip(records, outputs):
        rec.incoming = out
