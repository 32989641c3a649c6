"""Making and carrying out moves: the only place a request's state changes during a run.

A handler decides a :class:`~mtflow.core.records.Move` per request and changes nothing;
:func:`apply_moves` carries the moves out. A turn whose moves only change states (into
``tool_step``, back into ``generating``/``continuing``) goes through the graph in one pass
(:class:`~mtflow.core.records.TurnMoves`, :meth:`StateGraph.move_all`); a move that ends a
request first gets its output built, so that a failure there becomes its ``fail`` move instead of
a second move out of ``finished``.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, List, Optional, Sequence

from mtflow.core.calls import TIMED_OUT, Outcome, wrapped_methods
from mtflow.core.errors import ForkRefused, SchedulerResultError, StepTimeout
from mtflow.core.machine import (COMPACTING, CONTINUE, ERROR, FAIL, FINISH, FINISHED, FORK_STATES, GENERATE,
                                 INTERRUPT, INTERRUPTED, PENDING, TIMEOUT, TOOL_STEP, RequestRecord)
from mtflow.core.protocol import RolloutOutput
from mtflow.core.records import Move, TurnMoves
from mtflow.accounting.segments import is_continuation_of
from mtflow.engine.branching import Branch, child_record, child_uuid, fork_point, fork_request, split_budget
from mtflow.engine.outputs import OutputFailed, detach_messages, finalized_output, notify_finished
from mtflow.engine.run_state import RunState, failure_of

__all__ = ['ENDING_TRIGGERS', 'fail_move', 'outcome_move', 'wait_move', 'apply_moves', 'interrupt_all', 'fork']

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
    else:
        for mv in moves:
            if mv.trigger in ENDING_TRIGGERS:
                _end_request(run, mv)
            else:
                graph.move(mv.record, mv.trigger, mv.turn, recorder, mv.tokens, mv.duration, mv.extra)
    if run.branching is not None and moves:
        _branch(run, moves)


def _branch(run: RunState, moves: Sequence[Move]) -> None:
    """Ask the branching policy about each moved record that rests where a fork may happen, and
    fork the ones it names (a decision that fails fails its record, phase ``fork``)."""
    if moves.__class__ is TurnMoves:
        records, extras = moves.records, moves.extras or (None, ) * len(moves.records)
    else:
        records, extras = [mv.record for mv in moves], [mv.extra for mv in moves]
    for rec, extra in zip(records, extras):
        if rec.state not in FORK_STATES or rec.branch is None:
            continue
        turn = fork_point(rec)[0]
        try:
            copies = run.branching.branches(rec, extra, _awaited(run))
        except Exception as exc:
            apply_moves(run, [fail_move(rec, turn, 'fork', exc)])
            continue
        if copies > 1:
            fork(run, rec, copies, turn)


def _awaited(run: RunState) -> Callable[[Any], Any]:
    """The value of what a hook returned: awaited on the run's loop when it is awaitable."""
    def value(result: Any) -> Any:
        return run.await_value(result) if inspect.isawaitable(result) else result
    return value


def fork(run: RunState, rec: RequestRecord, copies: int, turn: int) -> List[RequestRecord]:
    """The ``fork`` move: ``rec`` goes on as the first of ``copies`` branches and ``copies - 1``
    children are born in its state with its history (:func:`mtflow.engine.branching.child_record`),
    its leaf budget split among them. The scheduler's ``on_fork`` copies its own per-request state
    (or refuses: :class:`ForkRefused` fails ``rec``, phase ``fork``); a backend that keeps
    per-request state is told (``fork(parent_uuid, child_uuids)``, e.g. the router sends the
    children where the parent's prefix is cached). The children enter the run; returns them."""
    branch = rec.branch
    point = fork_point(rec)
    shares = split_budget(branch.budget, copies)
    uuids = [child_uuid(rec.uuid, branch.children + k) for k in range(1, copies)]
    try:
        requests = [fork_request(rec.request, uuid) for uuid in uuids]
        hook = run.hooks.on_fork
        if hook is not None:
            _awaited(run)(hook(rec.request, requests, turn))
    except Exception as exc:
        why = exc.detail if isinstance(exc, ForkRefused) else f'{type(exc).__name__}: {exc}'
        err = ForkRefused(f'cannot fork in state {rec.state!r}: {why}', uuid=rec.uuid, turn=turn,
                          field=exc.field if isinstance(exc, ForkRefused) else 'on_fork')
        err.__cause__ = exc
        apply_moves(run, [fail_move(rec, turn, 'fork', err)])
        return []
    for tell in wrapped_methods(run.settings.rollout_fn, 'fork'):
        tell(rec.uuid, list(uuids))
    branch.children += len(uuids)
    branch.budget = shares[0]
    branch.forks.append(point)
    return _born(run, rec, rec.uuid, branch.tree, uuids, requests, shares[1:], point)


def _tree_finished(run: RunState, rec: RequestRecord) -> None:
    """``rec`` finished: its tree has one record less live; the leaves of its budget it did not
    spend (its forks never came) are topped up at once, with copies of the tree's prompt (``fork``
    from ``pending``, budget 1 each), so that the tree ends with exactly its leaf budget."""
    branch = rec.branch
    tree = branch.tree
    tree.live -= 1
    missing = branch.budget - 1 if branch.budget is not None and tree.seed is not None else 0
    if missing < 1:
        return
    branch.budget = 1
    # numbered after every child the root can fork (at most budget - 1), so that the copies' uuids
    # never depend on when each record finished: whichever records they came from, they are the same
    uuids = [child_uuid(tree.root, tree.limit - 1 + tree.topped_up + k) for k in range(1, missing + 1)]
    tree.topped_up += missing
    _born(run, tree.seed, tree.root, tree, uuids, [fork_request(tree.seed.request, u) for u in uuids], [1] * missing,
          (0, PENDING))


def _born(run: RunState, parent: RequestRecord, parent_uuid: str, tree: Any, uuids: List[str], requests: List[Any],
          budgets: Sequence[Any], point: tuple) -> List[RequestRecord]:
    """The children of a fork of ``parent`` at ``point`` enter its tree and the run, and the graph
    records the move: the parent's event names them (but for a tree's prompt, ``pending``: its
    top-up copies' events say ``top_up``), each child's names its parent."""
    children = []
    for uuid, request, budget in zip(uuids, requests, budgets):
        children.append(child_record(parent, run.take_index(), uuid, request, Branch(tree, parent_uuid, budget, point)))
    tree.records.extend(children)
    tree.live += len(children)
    top_up = point[1] == PENDING
    tree.forks.append({'parent': parent_uuid, 'children': uuids, 'turn': point[0], 'state': point[1],
                       **({'top_up': True} if top_up else {})})
    run.add_records(children)  # indexed and named before their events are recorded
    run.graph.fork(parent, children, point[0], run.recorder, extra={'children': uuids},
                   child_extras=[{'parent': parent_uuid, **({'top_up': True} if top_up else {})} for _ in children],
                   parent_event=not top_up)
    return children


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
        if rec.branch is not None:
            _tree_finished(run, rec)


def _finishing(run: RunState, mv: Move) -> Move:
    """A normal finish: the accounting's last turn, then the output; the ``fail`` move of
    whichever fails."""
    rec, turn = mv.record, mv.turn
    try:
        if rec.state == COMPACTING:  # the step accumulated the last turn already (docs/context.md)
            after_step = getattr(run.accounting, 'finalize_after_step', None)
            if after_step is not None:
                after_step(rec, rec.choice)
        elif rec.choice is not None:  # None: it never generated (a role whose episode ended before it acted)
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
