"""What every driver shares: how a run ends (its result, an interrupt, ``on_trajectory_end``).

A driver moves the requests of one :class:`~mtflow.engine.run_state.RunState` from ``pending``
to ``finished`` by calling the handlers and carrying out their moves. The executor picks one
(:class:`mtflow.engine.lockstep.LockstepDriver`, :class:`mtflow.engine.async_driver.AsyncDriver`)
and talks to it only through this interface.
"""
from __future__ import annotations

import inspect
import traceback
from typing import Any, Dict, List, Optional, Tuple

from mtflow.core.errors import RequestFailure
from mtflow.core.machine import FINISHED, WAITING_STATES, RequestRecord
from mtflow.core.trace import has_listeners, publish as publish_trace
from mtflow.engine.branching import tree_record, trees_of
from mtflow.engine.moves import apply_moves, fail_move, interrupt_all
from mtflow.engine.result import RunResult
from mtflow.engine.run_state import RunState

__all__ = ['Driver', 'publish', 'turn_of', 'by_turn', 'trees']


def trees(run: RunState) -> List[Dict[str, Any]]:
    """The tree records of a branched run's records (``[]`` without branching)."""
    if run.branching is None:
        return []
    return [tree_record(tree) for tree in trees_of(run.records)]


def publish(run: RunState, result: RunResult) -> None:
    """Hand the run's trace to the trace listeners (``mtflow.core.trace.add_listener``), if any."""
    if run.recorder is not None and has_listeners():
        publish_trace(result.trace)


def turn_of(rec: RequestRecord) -> int:
    """The turn a record's state handler works on: the model's next turn while it waits for the
    model, else the turn of its last applied output (``1`` before the first)."""
    return rec.turns + 1 if rec.state in WAITING_STATES else rec.turns or 1


def by_turn(records: List[RequestRecord]) -> List[Tuple[int, List[RequestRecord]]]:
    """``records`` (one state's batch) by :func:`turn_of`, in order of first appearance: one group
    in a lockstep turn, unless a tree was topped up with copies that start at turn 1 mid-run."""
    groups: Dict[int, List[RequestRecord]] = {}
    for rec in records:
        groups.setdefault(turn_of(rec), []).append(rec)
    return list(groups.items())


class Driver:
    """Drives one run: :meth:`drive` to the end; :meth:`interrupted` when an interrupt stops it;
    :meth:`end_trajectory` once, on every path."""

    def __init__(self, run: RunState) -> None:
        self.run = run

    def drive(self) -> RunResult:
        raise NotImplementedError

    def result(self) -> RunResult:
        """Every output, in input order. A request still live here cannot happen unless a rank's
        ``gather_fn`` lies; it is failed, never lost silently."""
        run = self.run
        records = run.records
        unfinished = [r for r in records if r.state != FINISHED]
        if unfinished:
            apply_moves(run, [fail_move(r, r.turns, 'executor', RuntimeError(f'request left in state {r.state!r}'))
                              for r in unfinished])
        result = RunResult(
            outputs=[r.output for r in records],
            finish_reasons=[r.reason for r in records],
            failures=run.failures,
            recorder=run.recorder,
            turns=run.loops,
            rollout_fn_calls=run.rollout_calls)
        result.trees = trees(run)
        publish(run, result)
        return result

    def interrupted(self) -> RunResult:
        """Finish every request still live with reason ``interrupted`` (partial outputs), and
        return the result so far; finished requests keep their outputs untouched."""
        interrupt_all(self.run)
        return self.result()

    def end_trajectory(self, error: Optional[BaseException]) -> None:
        """``on_trajectory_end(requests, error)`` once, on every path; a failure in it is
        recorded (phase ``on_trajectory_end``)."""
        run = self.run
        hook = run.hooks.on_trajectory_end
        if hook is None or run.ended:
            return
        run.ended = True
        try:
            result = hook([r.request for r in run.records], error)
            if inspect.isawaitable(result):
                run.await_value(result)
        except Exception as exc:
            run.failures.append(RequestFailure(-1, '*', run.turn, 'on_trajectory_end', exc, traceback.format_exc()))
