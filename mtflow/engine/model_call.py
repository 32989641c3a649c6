"""The model's turn: the one way every driver calls ``rollout_fn``, and its outputs handed over.

:func:`model_calls` decides the calls for a set of records (one per distinct request config: a
context budget's cut ``max_tokens``, a resumed generation's, give a record a config of its own)
and counts them, once, in ``run.rollout_calls``; the lockstep driver carries them out with
:func:`call_model` (in its thread: the contract's), the async driver one record at a time as a
task (:meth:`mtflow.engine.in_flight.InFlight.rollout`). A call that raises or misses
``rollout_timeout_s`` fails every request it served; a call that returns the wrong number of
outputs fails them too.
"""
from __future__ import annotations

from time import perf_counter
from typing import Any, Callable, Dict, List, Optional, Tuple

from mtflow.core.calls import RAISED, TIMED_OUT, Outcome, is_async_callable
from mtflow.core.errors import RolloutFnError, StepTimeout
from mtflow.core.machine import TIMEOUT, WAITING_STATES, RequestRecord
from mtflow.core.records import Move
from mtflow.engine.moves import apply_moves, fail_move
from mtflow.engine.run_state import RunState

__all__ = ['ModelCall', 'model_calls', 'call_model', 'model_failure_moves', 'deliver', 'request_failed']

#: one ``rollout_fn`` call: the records it serves, in order, and its request config
ModelCall = Tuple[List[RequestRecord], Any]


def model_calls(run: RunState, records: List[RequestRecord],
                adjust: Optional[Callable[[RequestRecord, Any], Any]] = None) -> List[ModelCall]:
    """The ``rollout_fn`` calls that serve ``records`` (counted here, the one place): one call
    with the run's request config, or, when some records have a config of their own (a context
    budget cut their ``max_tokens``, ``adjust``: a driver's per-record change), one call per
    distinct config, in the order of their first record. ``[]`` records: one empty call (every
    rank calls ``rollout_fn`` alike)."""
    config = run.settings.request_config
    context = run.context
    if context is None and adjust is None:
        run.rollout_calls += 1
        return [(records, config)]
    calls: List[ModelCall] = []
    for rec in records:
        own = context.config_for(rec, config) if context is not None else config
        if adjust is not None:
            own = adjust(rec, own)
        for served, theirs in calls:  # a few distinct configs at most
            if theirs is own or theirs == own:
                served.append(rec)
                break
        else:
            calls.append(([rec], own))
    calls = calls or [(records, config)]
    run.rollout_calls += len(calls)
    return calls


def call_model(run: RunState, records: List[RequestRecord], turn: int) -> Optional[Any]:
    """The lockstep driver's model turn: the calls of :func:`model_calls` for ``records``
    (possibly ``[]``), in its thread; the outputs in the order of ``records``, or ``None`` when
    every call failed (their requests are failed already). With several calls an async
    ``rollout_fn``'s run at once (the turn costs one round trip), a sync one's one after the other
    (the HF backend is not safe to call from several threads). The outputs are not handed over
    here: the driver does that after the next gather, as ms-swift checks their count there
    (:func:`deliver`)."""
    calls = model_calls(run, records)
    rollout_fn, timeout = run.settings.rollout_fn, run.options.rollout_timeout_s
    if len(calls) == 1:
        served, config = calls[0]
        outcome = run.caller.one(rollout_fn, ([r.request for r in served], config), timeout)
        if outcome.kind != RAISED and outcome.kind != TIMED_OUT:
            return outcome.value
        apply_moves(run, model_failure_moves(served, turn, outcome))
        return None
    arguments = [([r.request for r in served], config) for served, config in calls]
    if is_async_callable(rollout_fn):
        outcomes = run.caller.run_awaitables([rollout_fn(*a) for a in arguments], perf_counter(), timeout)
    else:
        outcomes = [run.caller.one(rollout_fn, a, timeout) for a in arguments]
    by_index: Dict[int, Any] = {}
    for (served, _config), outcome in zip(calls, outcomes):
        if outcome.kind == RAISED or outcome.kind == TIMED_OUT:
            apply_moves(run, model_failure_moves(served, turn, outcome))
            continue
        try:
            values = list(outcome.value)
        except TypeError:
            values = [outcome.value]
        if len(values) != len(served):  # deliver() names the mismatch for the whole turn
            return outcome.value
        by_index.update((rec.index, v) for rec, v in zip(served, values))
    kept = [by_index[rec.index] for rec in records if rec.index in by_index]
    return kept if kept or not by_index else None


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
