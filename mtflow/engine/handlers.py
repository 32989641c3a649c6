"""The per-state handlers: what happens to the requests in each state, one form each.

A handler takes any subset of the records in its states (one record is fine) and the turn, and
returns one :class:`~mtflow.core.records.Move` per record, in order (the turn's handlers return
them as a :class:`~mtflow.core.records.TurnMoves`, so that the common moves cost no object per
request); it never changes a state itself (:func:`mtflow.engine.moves.apply_moves` carries the
moves out). Both drivers call the same handlers: lockstep with every live request of a turn,
async mode with one request at a time.

- ``pending``: :func:`handle_pending` (``on_trajectory_start``, then into
  ``generating``/``continuing``); :func:`check_uuids` fails duplicate uuids when a run begins;
- ``generating``/``continuing`` (phase ``waiting``): :func:`handle_waiting` applies the model's
  output (``record.incoming``), runs ``on_turn_end``, the ``turn_reward`` hook, ``check_finished`` and the stop
  decision -> ``finish`` / ``run_step`` / ``fail``;
- ``tool_step``: :func:`handle_tool_step` applies the scheduler's ``step`` -> ``generate`` /
  ``continue_message`` / ``finish`` (the step returned ``done``) / ``fail`` (the step run here, or
  brought as ``record.step_outcome`` by a driver that ran it as its own task); a step's
  ``new_segment`` closes the training segment first;
- ``compacting`` (a context budget only): :func:`mtflow.engine.context.handle_compacting`
  applies the policy -> ``finish`` / ``generate`` / ``continue_message`` / ``fail``; the moves
  into ``generating``/``continuing`` of ``start`` and ``tool_step`` are checked against the
  budget first (:func:`mtflow.engine.context.route`: ``compact`` when the prompt does not fit).

:data:`STATE_HANDLERS` names the handler of every state: the one dispatch of every driver.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mtflow.core.calls import OK, Outcome
from mtflow.core.errors import DuplicateUuidError, RolloutFnError, SchedulerResultError
from mtflow.core.images import check_request_images
from mtflow.core.machine import (CHECK_FINISHED, COMPACTING, CONTINUE, CONTINUING, DONE_BY_HOOK, FAIL, FINISH, GENERATE,
                                 GENERATING, PENDING, RUN_STEP, TOOL_STEP, RequestRecord)
from mtflow.core.protocol import generated_tokens
from mtflow.core.records import Move, TurnMoves
from mtflow.core.stop import decide_stop, default_check, output_finish
from mtflow.core.validate import check_bool, check_infos, check_output, check_turn_result
from mtflow.accounting.segments import is_continuation_of
from mtflow.accounting.segments_split import cut_segment, detach_record
from mtflow.accounting.turn_spans import checked_turn_reward
from mtflow.engine.context import handle_compacting, relabel, route
from mtflow.engine.moves import apply_moves, fail_move, outcome_move, wait_move
from mtflow.engine.model_call import request_failed
from mtflow.engine.run_state import RunState

__all__ = ['Handler', 'STATE_HANDLERS', 'advance', 'turn_phases', 'check_uuids', 'start', 'handle_pending',
           'handle_waiting', 'handle_tool_step', 'prepare_steps']

Handler = Callable[[RunState, List[RequestRecord], int], Sequence[Move]]


# ---- pending -------------------------------------------------------------------------------------
def check_uuids(run: RunState) -> List[Move]:
    """Duplicate uuids: every later copy fails before the first turn, with an error naming
    both indexes (per-request scheduler state is keyed by uuid); the first copy runs."""
    first_index: Dict[str, int] = {}
    moves: List[Move] = []
    if not run.settings.unique_uuids:
        return moves
    for rec in run.records:
        earlier = first_index.setdefault(rec.uuid, rec.index)
        if earlier != rec.index:
            err = DuplicateUuidError(f'request {rec.uuid}: uuid used by index {earlier} and index {rec.index} '
                                     f'of the same batch; give every request its own uuid')
            moves.append(fail_move(rec, 1, 'input', err))
    return moves


def start(run: RunState, records: List[RequestRecord]) -> List[Move]:
    """``pending``: ``on_trajectory_start`` for ``records`` (native API), then each enters
    ``generating`` or ``continuing``."""
    hooks = run.hooks
    hook = hooks.on_trajectory_start
    if hook is not None and records:
        [outcome] = run.caller.batch(hook, [([r.request for r in records], )], hooks.on_trajectory_start_is_async,
                                     run.options.step_timeout_s)
        if outcome.kind != OK:
            return [outcome_move(rec, 1, 'on_trajectory_start', outcome) for rec in records]
    return route(run, [wait_move(rec, 1) for rec in records], 1)


# ---- generating / continuing ---------------------------------------------------------------------
def handle_waiting(run: RunState, records: List[RequestRecord], turn: int) -> TurnMoves:
    """``generating`` / ``continuing``: apply each record's ``incoming`` output, run
    ``on_turn_end`` (all at once), ``check_finished`` and the stop decision; return
    ``finish`` (with the reason), ``run_step`` or ``fail`` per record, in order."""
    failed: Dict[int, Move] = {}  # record index -> its fail move
    applied = _apply_outputs(run, records, turn, failed)
    accounting = run.accounting
    snapshots: Dict[int, Any] = {}
    if accounting.materializes:  # ms-swift 4.6 decodes id-backed messages for the hooks
        for rec in list(applied):
            try:
                snapshots[rec.index] = accounting.materialize([rec])
            except Exception as exc:
                failed[rec.index] = fail_move(rec, turn, 'materialize', exc, tokens=rec.tokens)
                applied.remove(rec)
    try:
        stops = _stops(run, _turn_rewards(run, _turn_end(run, applied, turn, failed), turn, failed), turn, failed)
    finally:
        for rec in records if snapshots else ():
            snapshot = snapshots.get(rec.index)
            if snapshot is not None:
                try:
                    accounting.restore(snapshot)
                except Exception as exc:
                    failed[rec.index] = fail_move(rec, turn, 'restore', exc, tokens=rec.tokens)
    tokens = [rec.tokens for rec in records]
    if not failed and not stops:
        return TurnMoves(records, [RUN_STEP] * len(records), turn, tokens)
    triggers: List[str] = []
    ending: Dict[int, Move] = {}
    for k, rec in enumerate(records):
        mv = failed.get(rec.index)
        if mv is None:
            reason = stops.get(rec.index)
            if reason is None:
                triggers.append(RUN_STEP)
                continue
            mv = Move(rec, FINISH, turn, rec.tokens, reason=relabel(run, rec, reason))
        ending[k] = mv
        triggers.append(mv.trigger)
    return TurnMoves(records, triggers, turn, tokens, ending=ending)


def _apply_outputs(run: RunState, records: List[RequestRecord], turn: int,
                   failed: Dict[int, Move]) -> List[RequestRecord]:
    """Each record's output checked and applied to its messages: the records it applied to
    (the ``fail`` moves of the others go into ``failed``)."""
    append_completion = run.accounting.append_completion
    applied: List[RequestRecord] = []
    for rec in records:
        out, rec.incoming = rec.incoming, None
        rec.tokens = 0
        if isinstance(out, BaseException):  # the backend failed this request only; the call's others go on
            failed[rec.index] = fail_move(rec, turn, 'rollout_fn', request_failed(out, rec.uuid, turn))
            continue
        try:
            response, choice = check_output(out, rec.uuid, turn)
            ends = output_finish(choice.finish_reason)
            if ends is not None:  # e.g. replay_diverged: the output must not be applied at all
                failed[rec.index] = Move(rec, FAIL, turn, reason=ends)
                continue
            rec.response = response
            rec.is_continuation = append_completion(rec, choice.message.content)
        except Exception as exc:
            if not isinstance(exc, RolloutFnError):
                exc = RolloutFnError(f'cannot apply the output: {type(exc).__name__}: {exc}', uuid=rec.uuid,
                                     turn=turn, field='response')
            failed[rec.index] = fail_move(rec, turn, 'apply', exc)
            continue
        rec.turns = turn
        rec.choice = choice
        rec.tokens = generated_tokens(response, choice)
        rec.turn_result = None
        applied.append(rec)
    return applied


def _per_record_hook(run: RunState, records: List[RequestRecord], turn: int, failed: Dict[int, Move],
                     phase: str, hook: Optional[Callable[..., Any]], is_async: bool,
                     take: Callable[[RequestRecord, Any], None]) -> List[RequestRecord]:
    """One rule for the hooks called once per record after a turn (``on_turn_end``, ``turn_reward``):
    all records at once; a hook that raises or times out, or whose value ``take`` refuses (it
    raises), fails its request only, in ``phase``; the others are kept, ``take`` having applied
    their value."""
    if hook is None or not records:
        return records
    values, problems, _ = run.caller.values(hook, [(r.request, r.choice, turn) for r in records],
                                            is_async, run.options.step_timeout_s, timed=False)
    kept = []
    for k, rec in enumerate(records):
        if problems is not None and k in problems:
            failed[rec.index] = outcome_move(rec, turn, phase, problems[k], rec.tokens)
            continue
        try:
            take(rec, values[k])
        except Exception as exc:
            failed[rec.index] = fail_move(rec, turn, phase, exc, tokens=rec.tokens)
            continue
        kept.append(rec)
    return kept


def _turn_end(run: RunState, applied: List[RequestRecord], turn: int,
              failed: Dict[int, Move]) -> List[RequestRecord]:
    """``on_turn_end`` for the applied records (all at once): those whose result is good, with
    it kept in ``turn_result`` and its ``rollout_infos`` merged."""
    def take(rec: RequestRecord, value: Any) -> None:
        turn_result = check_turn_result(value, rec.uuid, turn)
        rec.turn_result = turn_result
        infos = turn_result.get('rollout_infos') if turn_result else None
        if infos:
            rec.infos.update(infos)

    hooks = run.hooks
    return _per_record_hook(run, applied, turn, failed, 'on_turn_end', hooks.on_turn_end,
                            hooks.on_turn_end_is_async, take)


def _turn_rewards(run: RunState, going: List[RequestRecord], turn: int,
                  failed: Dict[int, Move]) -> List[RequestRecord]:
    """The ``turn_reward`` hook (the scheduler's method or ``Executor(turn_reward=)``) for the
    records still going: each number is kept on the record, in its entry
    (:func:`mtflow.accounting.turn_spans.checked_turn_reward`, the YAML hook's rule too); a hook
    that raises, times out or returns something else fails its request only."""
    def take(rec: RequestRecord, value: Any) -> None:
        entry = checked_turn_reward(value, turn, rec.uuid)
        if entry is not None:
            rec.turn_rewards.append(entry)

    hooks = run.hooks
    return _per_record_hook(run, going, turn, failed, 'turn_reward', hooks.turn_reward,
                            hooks.turn_reward_is_async, take)


def _stops(run: RunState, going: List[RequestRecord], turn: int, failed: Dict[int, Move]) -> Dict[int, str]:
    """``check_finished`` and the stop decision: the records that stop (index -> reason)."""
    hooks = run.hooks
    check = hooks.check_finished
    checks: Optional[List[Outcome]] = None
    if check is not None and going:
        # a sync check_finished is a cheap predicate: called inline, in the driver's thread
        checks = run.caller.batch(check, [(r.request, r.choice, turn) for r in going], hooks.check_finished_is_async,
                                  run.options.step_timeout_s if hooks.check_finished_is_async else None)
    default_max = hooks.default_max_turns
    limit, limit_reason = run.limit, run.limit_reason
    stops: Dict[int, str] = {}
    for k, rec in enumerate(going):
        if checks is not None:
            outcome = checks[k]
            if outcome.kind != OK:
                failed[rec.index] = outcome_move(rec, turn, 'check_finished', outcome, rec.tokens)
                continue
            try:
                checked = check_bool(outcome.value, rec.uuid, turn, 'check_finished')
            except Exception as exc:
                failed[rec.index] = fail_move(rec, turn, 'check_finished', exc, tokens=rec.tokens)
                continue
            check_reason = CHECK_FINISHED
        else:
            checked, check_reason = default_check(rec.choice.finish_reason, turn, default_max)
        stop, reason = decide_stop(rec.turn_result, checked, check_reason, turn, limit, limit_reason)
        if stop:
            stops[rec.index] = reason
    return stops


# ---- tool_step -----------------------------------------------------------------------------------
def handle_tool_step(run: RunState, records: List[RequestRecord], turn: int) -> Sequence[Move]:
    """``tool_step``: each record's step outcome applied through the accounting -> ``generate`` /
    ``continue_message`` (by the next request's messages) or ``fail``, one move per record, in
    order. A record whose step already ran (``record.step_outcome``: a driver that runs each step
    as its own task, :func:`prepare_steps` having run first) brings its outcome; the others' steps
    run here, together (async ones concurrently, sync ones in order, each under
    ``step_timeout_s``)."""
    if not records or records[0].step_outcome is None:  # a batch brings all its outcomes, or none
        going, failed = prepare_steps(run, records, turn)
        hooks = run.hooks
        values, problems, durations = run.caller.values(hooks.step, [(r.request, r.choice, turn) for r in going],
                                                        hooks.step_is_async, run.options.step_timeout_s)
        return _step_moves(run, records, turn, going, values, problems, durations, failed)
    outcomes = [rec.step_outcome for rec in records]
    if None in outcomes:  # one form, one batch: a driver hands over one kind at a time
        raise ValueError('handle_tool_step: records with and without a step outcome in one batch')
    for rec in records:
        rec.step_outcome = None
    values = [o.value if o.kind == OK else None for o in outcomes]
    problems = {k: o for k, o in enumerate(outcomes) if o.kind != OK} or None
    return _step_moves(run, records, turn, records, values, problems, [o.duration for o in outcomes], ())


def prepare_steps(run: RunState, records: List[RequestRecord],
                  turn: int) -> Tuple[List[RequestRecord], List[Move]]:
    """Before a step runs: the accounting's ``before_step`` for each record; the records whose
    step may run, and the ``fail`` moves of the others."""
    before = getattr(run.accounting, 'before_step', None)
    if before is None:
        return records, []
    going, failed = [], []
    for rec in records:
        try:
            before(rec, rec.choice, turn)
        except Exception as exc:
            failed.append(fail_move(rec, turn, 'step', exc))
            continue
        going.append(rec)
    return going, failed


def _step_moves(run: RunState, records: List[RequestRecord], turn: int, going: List[RequestRecord],
                values: List[Any], problems: Optional[Dict[int, Outcome]], durations: Optional[List[float]],
                failed: Sequence[Move]) -> Sequence[Move]:
    """The step results of ``going`` applied, each record's next request in place (also in the
    caller's list): one move per record of ``records``, in order."""
    accumulate = run.accounting.accumulate_step
    image_limits = getattr(run.hooks.scheduler, 'image_limits', None)
    requests = run.requests if run.requests.__class__ is list else None
    n = len(going)
    triggers: List[str] = [GENERATE] * n  # columns filled in place: no call per request
    extras: List[Optional[dict]] = [None] * n
    ending: Dict[int, Move] = {}
    for k, rec in enumerate(going):
        if problems is not None and k in problems:
            mv = ending[k] = outcome_move(rec, turn, 'step', problems[k])
            triggers[k] = mv.trigger
            continue
        result = values[k]
        if result.__class__ is dict and result.get('done'):  # the step ends its request (docs/schedulers.md)
            mv = ending[k] = _step_done(rec, turn, result, durations[k] if durations is not None else None)
            triggers[k] = mv.trigger
            continue
        try:
            next_request = accumulate(rec, rec.choice, result, turn)
            if getattr(next_request, 'images', None):  # what the step added is checked once, here
                check_request_images(next_request, rec.uuid, turn, image_limits)
            extra = result.get('trace_info')
            if extra is not None and extra.__class__ is not dict and not isinstance(extra, dict):
                raise SchedulerResultError(f'trace_info must be a dict, got {type(extra).__name__}',
                                           uuid=rec.uuid, turn=turn, field='trace_info')
            cut = result.get('new_segment')
            if cut:
                _new_segment(run, rec, next_request, cut, turn)
        except Exception as exc:
            mv = ending[k] = fail_move(rec, turn, 'step', exc)
            triggers[k] = mv.trigger
            continue
        rec.request = next_request
        if requests is not None:
            requests[rec.index] = next_request
        extras[k] = extra
        try:  # wait_move's rule, inlined (once per request and turn); wait_move builds the fail move
            if is_continuation_of(next_request.messages):
                triggers[k] = CONTINUE
        except Exception:
            mv = ending[k] = wait_move(rec, turn, durations[k] if durations is not None else None, extra)
            triggers[k] = mv.trigger
    moves = route(run, TurnMoves(going, triggers, turn, None, durations, extras, ending or None), turn)
    if not failed:  # going is records
        return moves
    by_index = {mv.record.index: mv for mv in moves}
    by_index.update((mv.record.index, mv) for mv in failed)
    return [by_index[rec.index] for rec in records]


def _step_done(rec: RequestRecord, turn: int, result: Dict[str, Any], duration: Optional[float]) -> Move:
    """A step that returned a truthy ``done``: ``finish`` with its ``finish_reason`` (default
    ``done_by_hook``), its ``rollout_infos`` merged and its ``trace_info`` on the event (the last
    turn's output was applied already; the accounting finalizes it as a stop after that turn
    would); ``fail`` when one of them is malformed."""
    try:
        reason = result.get('finish_reason') or DONE_BY_HOOK
        if not isinstance(reason, str):
            raise SchedulerResultError(f'finish_reason must be a str, got {type(reason).__name__}', uuid=rec.uuid,
                                       turn=turn, field='finish_reason')
        infos = check_infos(result.get('rollout_infos'), rec.uuid, turn)
        extra = result.get('trace_info')
        if extra is not None and not isinstance(extra, dict):
            raise SchedulerResultError(f'trace_info must be a dict, got {type(extra).__name__}', uuid=rec.uuid,
                                       turn=turn, field='trace_info')
    except Exception as exc:
        return fail_move(rec, turn, 'step', exc)
    if infos:
        rec.infos.update(infos)
    return Move(rec, FINISH, turn, duration=duration, extra=extra, reason=reason)


def _new_segment(run: RunState, rec: RequestRecord, next_request: Any, cut: Any, turn: int) -> None:
    """A step whose next request does not continue the conversation the model saw (``new_segment``:
    ``True``, or a dict that says why, kept as the closed segment's ``ended_by``): the current
    training segment is closed as a compaction closes it (``docs/context.md``) and the next turn
    starts a new one, its prompt rendered afresh (its request carries an empty token record)."""
    if next_request is rec.request:
        raise SchedulerResultError('new_segment needs a new request object: infer_request is the request of the '
                                   'segment being closed (its messages are kept with it)', uuid=rec.uuid, turn=turn,
                                   field='new_segment')
    if cut is not True and not isinstance(cut, dict):
        raise SchedulerResultError(f'new_segment must be True or a dict, got {type(cut).__name__}', uuid=rec.uuid,
                                   turn=turn, field='new_segment')
    cut_segment(rec, getattr(run.accounting, 'name', None) == 'record', cut if isinstance(cut, dict) else None)
    detach_record(next_request, rec.turns + 1)


def handle_pending(run: RunState, records: List[RequestRecord], turn: int) -> List[Move]:
    """``pending``: :func:`start` (``turn`` is always 1)."""
    return start(run, records)


#: The handler of every state of the graph but ``finished``, in the order a turn visits them: the
#: only dispatch by state. Every driver hands records to this table (:func:`advance`, or
#: :func:`turn_phases` for a whole turn); a state's handler takes the records in that state. To
#: add a state: its line in ``core/machine.py`` (``STATES``, ``CORE_TRANSITIONS``) and its line
#: here (``docs/architecture.md`` shows it, ``tests/test_add_a_state.py`` runs it).
STATE_HANDLERS: Dict[str, Handler] = {
    PENDING: handle_pending,
    GENERATING: handle_waiting,
    CONTINUING: handle_waiting,
    TOOL_STEP: handle_tool_step,
    COMPACTING: handle_compacting,
}


def advance(run: RunState, records: List[RequestRecord], turn: int) -> None:
    """Hand ``records`` (all in one state) to their state's handler and carry out its moves."""
    if records:
        apply_moves(run, STATE_HANDLERS[records[0].state](run, records, turn))


def turn_phases() -> List[Tuple[frozenset, Handler]]:
    """``(states, handler)`` for each handler of a turn after ``pending``, in table order: the
    states that share a handler (``generating``, ``continuing``) are one batch."""
    phases: Dict[Handler, List[str]] = {}
    for state, handler in STATE_HANDLERS.items():
        if state != PENDING:
            phases.setdefault(handler, []).append(state)
    return [(frozenset(states), handler) for handler, states in phases.items()]
