"""The lockstep driver (the default, the contract's): every live request moves one turn together.

One turn (see ``docs/executor.md``):

1. ask every rank whether any has live requests (``gather_fn``); stop when none has;
2. hand the live requests their outputs, then, in the order of
   :data:`mtflow.engine.handlers.STATE_HANDLERS`, each state's handler takes the requests in
   that state and its moves are carried out (:mod:`mtflow.engine.handlers`,
   :mod:`mtflow.engine.moves`); the turn before the first (``pending``, then whatever it led to
   but the model's turn) goes through the same table;
3. ``rollout_fn`` once, with the requests that go on (``[]`` on a rank with nothing live while
   another rank works), so every rank calls it the same number of times (``skip_empty_calls``,
   single rank only: no call when nothing is live, e.g. after the final turn).

A request whose step answered :class:`~mtflow.core.records.Wait` (it waits for other requests:
a role of a multi-agent episode waiting for the others) *rests* in ``tool_step`` out of the turn;
after each turn's handlers the resting requests whose waits ended (the other requests' steps
ended them) go on through the ``tool_step`` handler and join this turn's model call
(:mod:`mtflow.engine.resting`). A rank with resting requests has work; resting requests with
nothing live beside them can never be woken: they fail (a deadlock), never hang the run.

Policy versions (:mod:`mtflow.engine.versions`) are stamped as the async driver stamps them:
once a version was set (``executor.set_policy_version``) or the backend declares one, each
generated turn gets the version current when its ``rollout_fn`` call was issued (read before
the call, so an update during it counts the turn as old), after its output is handed over and
before the turn's hooks run; outputs given as ``first_turn_outputs`` are not stamped (nothing
was issued). Without a version nothing is stamped and the outputs are as before.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from typing import List, Optional

from mtflow.core.errors import RankMismatchError
from mtflow.core.machine import FINISHED, PENDING, WAITING_STATES, RequestRecord
from mtflow.engine.branching import plant
from mtflow.engine.driver import Driver, by_turn
from mtflow.engine.handlers import advance, check_uuids, turn_phases
from mtflow.engine.model_call import call_model, deliver
from mtflow.engine.moves import apply_moves, fail_move, wait_move
from mtflow.engine.resting import deadlock_moves, wait_outcome
from mtflow.engine.result import RunResult
from mtflow.engine.run_state import RunState
from mtflow.engine.versions import PolicyClock, stamp

__all__ = ['LockstepDriver']

#: where a record taken up from resting stops going through the handlers in this turn
_SETTLED = WAITING_STATES | {FINISHED}


class LockstepDriver(Driver):
    """Every live request moves one turn together, on every rank alike."""

    def __init__(self, run: RunState, clock: Optional[PolicyClock] = None) -> None:
        super().__init__(run)
        self.clock = clock
        #: the records resting in ``tool_step`` (their step answered ``Wait``), out of the turn
        self.resting: List[RequestRecord] = []

    def issued_version(self) -> Optional[int]:
        """The version a ``rollout_fn`` call issued now is stamped with, or ``None`` (none set)."""
        clock, rollout_fn = self.clock, self.run.settings.rollout_fn
        return clock.current(rollout_fn) if clock is not None and clock.active(rollout_fn) else None

    def stamp_delivered(self, live: List[RequestRecord], version: Optional[int]) -> None:
        """Stamp the turn each of ``live`` was just handed (a failed call handed none)."""
        if version is None:
            return
        for rec in live:
            if rec.incoming is not None:
                stamp(rec, version)

    def drive(self) -> RunResult:
        run = self.run
        records = run.records
        apply_moves(run, check_uuids(run))
        plant(run.branching, records)
        pending = [r for r in records if r.state == PENDING]
        if run.first_turn_outputs is None:
            live = self.start(pending)
            version = self.issued_version()
            outputs = call_model(run, live, 1)
        else:
            version = None  # given, not issued: as the async driver, not stamped
            apply_moves(run, [wait_move(rec, 1) for rec in pending])
            live = [r for r in pending if r.state in WAITING_STATES] + self.entering()
            outputs = run.first_turn_outputs
            if len(live) != len(records) and len(outputs) == len(records):  # duplicates were failed
                outputs = [outputs[r.index] for r in live]
        turn = 1
        phases = turn_phases()
        while True:
            live = [r for r in live if r.state in WAITING_STATES]
            run.turn = turn
            if not self.ranks_have_work(live, turn):
                break
            run.loops += 1
            if live:
                deliver(run, live, outputs, turn)
                self.stamp_delivered(live, version)
            for states, handler in phases:
                batch = [r for r in live if r.state in states]
                for at, records_at in by_turn(batch):  # one turn, but where a tree was topped up
                    apply_moves(run, handler(run, records_at, at))
                    live += self.entering()
            if self.resting or run.came_to_rest:
                live = self.rest_and_wake(live, turn)
            live = [r for r in live if r.state in WAITING_STATES]
            turn += 1
            run.turn = turn
            version = self.issued_version()
            if not live and run.options.skip_empty_calls:
                outputs = []  # one rank, nothing to generate: the contract's empty call is not needed
            else:
                outputs = call_model(run, live, turn)
        return self.result()

    def rest_and_wake(self, records: List[RequestRecord], turn: int) -> List[RequestRecord]:
        """The records of ``records`` that rest in ``tool_step`` join the resting ones; the resting
        records whose waits ended (or passed their deadline) go on through the ``tool_step``
        handler. Returns ``records`` with those taken up; when nothing is left to act, the records
        still resting fail (nothing could end their waits)."""
        run = self.run
        self.resting += run.came_to_rest
        run.came_to_rest = []
        timeout = run.options.step_timeout_s
        woken: List[RequestRecord] = []
        resting: List[RequestRecord] = []
        for rec in self.resting:
            outcome = wait_outcome(rec.waiting, timeout)
            if outcome is None:
                resting.append(rec)
                continue
            rec.waiting, rec.step_outcome = None, outcome
            woken.append(rec)
        self.resting = resting
        going = woken
        while going:  # through the tool_step handler, and on (a compaction) until the model's turn
            for at, records_at in by_turn(going):
                advance(run, records_at, at)
                records = records + self.entering()
            going = [r for r in going if r.state not in _SETTLED and r.waiting is None]
        self.resting += run.came_to_rest  # woken records whose wait's result was another wait
        run.came_to_rest = []
        known = {id(r) for r in records}  # a record that rested in this very turn is among them already
        records = records + [r for r in woken if id(r) not in known]
        if self.resting and not any(r.state in WAITING_STATES for r in records):
            stuck, self.resting = self.resting, []
            apply_moves(run, deadlock_moves(stuck, turn))
        return records

    def start(self, pending: List[RequestRecord]) -> List[RequestRecord]:
        """The turn before the first for ``pending``: ``on_trajectory_start``, then whatever it led
        to but the model's turn (e.g. a first prompt over the context budget), through the same
        table; the records now waiting for the model (forks' children among them)."""
        run = self.run
        advance(run, pending, 1)
        pending = pending + self.entering()
        for states, handler in turn_phases():
            batch = [r for r in pending if r.state in states and r.state not in WAITING_STATES]
            if batch:
                apply_moves(run, handler(run, batch, 1))
                pending += self.entering()
        if self.run.came_to_rest:  # requests that opened in their step and wait
            pending = self.rest_and_wake(pending, 1)
        return [r for r in pending if r.state in WAITING_STATES]

    def entering(self) -> List[RequestRecord]:
        """The records that entered the run (a fork's children, born where their parent was;
        a tree's top-up copies, started here from ``pending``)."""
        new = self.run.take_entering()
        if not new:
            return new
        fresh = [r for r in new if r.state == PENDING]
        return [r for r in new if r.state != PENDING] + (self.start(fresh) if fresh else [])

    def ranks_have_work(self, live: List[RequestRecord], turn: int) -> bool:
        """The turn's collective: does any rank have live requests? With ``check_ranks`` the
        ranks also compare a fingerprint of their live sets."""
        run = self.run
        gather_fn = run.settings.gather_fn
        has_work = bool(live) or bool(self.resting)  # resting requests: a wait a failure just ended
        if not run.options.check_ranks:
            return any(gather_fn([has_work]))
        digest = hashlib.blake2b('\x1f'.join(r.uuid for r in live).encode(), digest_size=8).hexdigest()
        gathered = gather_fn([(has_work, len(live), digest)])
        prints = [tuple(g) if isinstance(g, (list, tuple)) else (bool(g), None, None) for g in gathered]
        if len(set(prints)) > 1:
            majority = Counter(prints).most_common(1)[0][0]
            odd = [r for r, p in enumerate(prints) if p != majority]
            same = [r for r, p in enumerate(prints) if p == majority]
            detail = ', '.join(f'rank {r}: {prints[r][1]} live' for r in range(len(prints)))
            err = RankMismatchError(
                f'turn {turn}: ranks {odd} disagree with ranks {same} on the live set ({detail}); ranks that must '
                f'hold the same requests made different stop decisions (is check_finished deterministic?)', turn, odd)
            apply_moves(run, [fail_move(rec, turn, 'ranks', err) for rec in live])
            err.result = self.result()
            raise err
        return any(p[0] for p in prints)
