"""The async driver (``Executor(..., mode='async')``): every request advances on its own.

The lockstep driver moves all live requests one turn together: each turn waits for the slowest
generation and the slowest tool of the batch. This driver runs the *same* per-state handlers
(:mod:`mtflow.engine.handlers`: same states, triggers, trace events, outputs) on one request at
a time, as soon as that request's own work completes:

1. a request is admitted (``pending`` -> ``generating``/``continuing``) while fewer than
   ``max_concurrency`` requests are in flight, and its generation is issued at once:
   ``rollout_fn([request], request_config)``, awaited when it is async, run in a thread pool
   when it is sync (at most ``max_concurrency`` calls in flight);
2. when its output arrives: ``handle_waiting`` (the output is applied, ``on_turn_end``,
   ``check_finished``, the stop decision), then either it finishes (its slot goes to the next
   pending request) or its ``step`` starts: an ``async def`` step as a task on the driver's
   loop, a sync one in a worker thread (one at a time, as the lockstep driver runs them);
3. when the step returns, its result is applied by the same handler code as in lockstep, the
   request moves to ``generating``/``continuing``, and its next generation is issued at once.

The driver thread keeps the lockstep driver's rule: user code runs outside a running event loop
in that thread, and async hooks are driven on the run's private loop. In-flight generations and
steps are tasks on that loop; the driver sleeps in ``run_until_complete`` until one of them
completes, then handles every completion in request order.

Deadlines (``step_timeout_s``, ``rollout_timeout_s``), interrupts (``RolloutInterrupted``) and
fault handling are the lockstep driver's: a failure finishes that request only. With ranks,
``gather_fn`` is called once, at the end (each rank drives its own requests; there is no
per-turn collective, which is why colocated tensor-parallel engines stay on lockstep).

**Partial rollouts** (``run(..., until=Until(finished=K) | Until(seconds=S))``): the budget is
checked after every completion, so exactly ``K`` requests finish (a step already in flight that
fails its request is the only overshoot: at most the steps in flight, fewer than
``max_concurrency``). When it is hit the driver stops admitting and generating, cancels the
generations in flight and drops the ones that completed in the same wake-up (their requests are
sent again on resume, unchanged, with the token record they had), lets the steps in flight
finish, waits for the threads of its synchronous ``rollout_fn`` calls to return (no thread of the
run outlives it), and hands back
every request that has not finished in :attr:`RunResult.unfinished` with its machine state
(state, turn, token segments, masks, logprobs, infos). ``executor.run(result.unfinished)``
resumes them exactly where they stopped.
"""
from __future__ import annotations

from collections import deque
from time import perf_counter
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

from mtflow.core.calls import OK, RAISED, Outcome
from mtflow.core.errors import RolloutFnError
from mtflow.core.machine import CONTINUE, FINISHED, GENERATE, PENDING, TOOL_STEP, WAITING_STATES, RequestRecord
from mtflow.accounting.token_record import RECORD_ATTR
from mtflow.engine.branching import plant
from mtflow.engine.driver import Driver, publish, trees
from mtflow.engine.in_flight import InFlight
from mtflow.engine.in_flight import Stopped as _Stopped
from mtflow.engine.handlers import STATE_HANDLERS, advance, check_uuids, prepare_steps
from mtflow.engine.context import route
from mtflow.engine.model_call import deliver, model_calls, model_failure_moves
from mtflow.engine.moves import apply_moves, fail_move, wait_move
from mtflow.engine.options import MODES
from mtflow.engine.partial import Budget, UnfinishedRequest, Until
from mtflow.engine.result import RunResult
from mtflow.engine.run_state import RunState
from mtflow.engine.versions import PolicyClock, stamp

__all__ = ['AsyncDriver', 'Until', 'UnfinishedRequest', 'MODES', 'resume_carried']

def resume_carried(run: RunState) -> Set[int]:
    """Put the records of the :class:`UnfinishedRequest` items among the run's requests back in
    their places (their machine state goes on); the indexes whose ``on_trajectory_start`` ran. A
    finished one (a member of a stream group handed back whole) is carried as it is: its output
    comes back unchanged and nothing runs for it."""
    started: Set[int] = set()
    requests = run.requests
    for i, item in enumerate(requests):
        if not isinstance(item, UnfinishedRequest):
            continue
        rec = item.record
        rec.index = i
        if rec.state == FINISHED:
            run.records[i] = rec
            continue
        rec.incoming = None
        rec.events = [] if run.recorder is not None and run.options.on_finished is not None else None
        run.records[i] = rec
        if isinstance(requests, list):
            requests[i] = rec.request
        if item.started:
            started.add(i)
    return started


class AsyncDriver(Driver):
    """One ``Executor.run`` in async mode: the shared handlers, driven per request."""

    #: stamp every turn with its policy version even when none was set (streams do)
    stamp_always = False

    def __init__(self, run: RunState, until: Optional[Until] = None, clock: Optional[PolicyClock] = None) -> None:
        super().__init__(run)
        #: what stops it early (``until=``: an :class:`Until`; a stream's ``StreamUntil``)
        self.budget: Optional[Budget] = until
        #: asked to stop from outside (a stream's ``close()``)
        self.closing = False
        #: the weights' version (``mtflow.engine.versions``); each turn is stamped with the version
        #: current when its generation was issued, when a version was set or the backend declares one
        self.clock = clock
        self.started = resume_carried(run)  # indexes whose on_trajectory_start already ran
        options = run.options
        self.max_concurrency = options.max_concurrency or max(1, len(run.records))
        #: environment sessions bound the requests started and not finished: each one's
        #: ``on_trajectory_start`` (its reset) runs when it gets a slot (``mtflow.engine.admission``)
        self.session_bound = run.settings.session_bound
        if self.session_bound is not None:
            self.max_concurrency = min(self.max_concurrency, self.session_bound)
        #: a branched run under the bound: the trees started and not finished, each holding up to
        #: ``prompt_sessions`` sessions (``mtflow.engine.admission.sessions_per_prompt``)
        self.prompt_sessions = run.settings.prompt_sessions
        self.open_trees: List[Any] = []
        self.start_rounds = 0
        #: the generations and steps running as tasks on the run's loop, the completions they
        #: posted, the worker pools of synchronous calls (``mtflow.engine.in_flight``)
        self.flight = InFlight(run.loop, run.settings.rollout_fn)
        self.queue: Deque[RequestRecord] = deque()
        self.active = 0
        self.finished_here = 0
        self.stopping = False
        self.t_start = 0.0
        #: what a request keeps while in flight is on its record (``admission``: its move into the
        #: model's turn, carried out when it gets a slot; ``issued_version``; ``sent_record``: its
        #: token record when its generation was issued, which a dropped generation's backend may
        #: have extended: the request goes back with the one it had)
        self.dropped: List[Tuple[RequestRecord, Any]] = []
        plant(run.branching, run.records)

    # ---- the loop ----------------------------------------------------------------------------
    def drive(self) -> RunResult:
        flight = self.flight
        flight.start()
        self.t_start = perf_counter()
        try:
            self.admit_all()
            while True:
                if self.over_budget():
                    self.stop()
                elif not self.stopping:
                    self.fill_slots()
                if flight.idle():
                    break  # every request finished, or was handed back by the budget
                batch = flight.wait(self.has_news, self.budget_left())
                for kind, rec, turn, outcome in sorted(batch, key=lambda c: c[1].index):
                    self.on_completion(kind, rec, turn, outcome)
                    if self.over_budget():  # after every completion: the budget is met exactly
                        self.stop()
        except BaseException:  # an interrupt (or a bug): nothing of ours is left running
            flight.cancel_all()
            flight.close(wait=False)
            raise
        flight.close(wait=True)
        self.restore_records()
        self.run.settings.gather_fn([self.finished_here])  # ranks stay in step: once, at the end
        return self.result()

    def admit_all(self) -> None:
        """Fail duplicates, run ``on_trajectory_start`` once for every new request (as lockstep
        does), keep their moves into ``generating`` for when they get a slot, and queue
        everything that will run."""
        run = self.run
        apply_moves(run, check_uuids(run))
        fresh = [r for r in run.records if r.state == PENDING and r.index not in self.started]
        first_outputs = run.first_turn_outputs
        if self.session_bound is not None and first_outputs is None:
            self.queue.extend(rec for rec in run.records if rec.state != FINISHED)
            return  # started in fill_slots, as sessions free up
        self.begin(fresh, [wait_move(rec, 1) for rec in fresh] if first_outputs is not None else None)
        live = [rec for rec in run.records if rec.state != FINISHED]
        if first_outputs is None:
            self.queue.extend(live)
            return
        outputs = list(first_outputs)
        if len(outputs) != len(run.records):
            err = RolloutFnError(f'{len(outputs)} first-turn output(s) for {len(run.records)} request(s)',
                                 turn=1, field='first_turn_outputs')
            apply_moves(run, [fail_move(r, 1, 'rollout_fn', err) for r in run.records if r.state != FINISHED])
            for rec in run.records:
                rec.admission = None
            return
        for rec in live:  # the first turn is already generated: every request starts at once
            self.active += 1
            admission, rec.admission = rec.admission, None
            apply_moves(run, [admission])
            self.flight.completions.append(('generate', rec, 1, Outcome(OK, [outputs[rec.index]], 0.0)))

    def start_deferred(self) -> None:
        """Under a session bound: ``on_trajectory_start`` for the queued requests that get a slot
        now, together (their resets run concurrently); the wait of each one admitted after the
        first round is counted as time queued for a session. A branched run starts a prompt only
        when its whole tree's sessions are free (:meth:`tree_room`)."""
        if self.prompt_sessions > 1:
            room = self.tree_room()
            due = [rec for rec in self.queue if rec.state == PENDING and rec.index not in self.started][:max(0, room)]
            self.open_trees.extend(rec.branch.tree for rec in due if rec.branch is not None)
        else:
            room = self.max_concurrency - self.active
            due = [rec for rec in list(self.queue)[:max(0, room)]
                   if rec.state == PENDING and rec.index not in self.started]
        if not due:
            return
        if self.start_rounds:  # not the first round: these waited for a session since the run began
            gate = self.run.options.admission.env_sessions
            for _ in due:
                gate.waited(perf_counter() - self.t_start)
        self.start_rounds += 1
        self.begin(due)

    def tree_room(self) -> int:
        """How many more prompts of a branched run may start: the trees whose sessions fit beside
        the trees started and not finished (a tree is finished when none of its records is live)."""
        self.open_trees = [tree for tree in self.open_trees if tree.live > 0]
        return self.session_bound // self.prompt_sessions - len(self.open_trees)

    def begin(self, records: List[RequestRecord], moves: Optional[List[Any]] = None) -> None:
        """``on_trajectory_start`` for ``records`` (``pending``), together (``moves``: their moves
        when it does not run, e.g. the first turn was given); each one's move into the model's
        turn is kept for when it gets a slot (``record.admission``), any other is carried out."""
        for mv in moves if moves is not None else STATE_HANDLERS[PENDING](self.run, records, 1):
            if mv.trigger in (GENERATE, CONTINUE):
                mv.record.admission = mv
            else:
                apply_moves(self.run, [mv])
        self.started.update(rec.index for rec in records)

    def admit_entering(self) -> None:
        """The records that entered the run (``docs/branching.md``: a fork's children, born where
        their parent was; a tree's top-up copies, started here) go first in the queue, so that a
        tree finishes together; each takes a slot as any request does."""
        new = self.run.take_entering()
        if not new:
            return
        fresh = [rec for rec in new if rec.state == PENDING]
        if fresh:
            self.begin(fresh)
        self.started.update(rec.index for rec in new)
        self.queue.extendleft(reversed([rec for rec in new if rec.state != FINISHED]))

    def fill_slots(self) -> None:
        if self.session_bound is not None:
            self.start_deferred()
        while True:
            self.admit_entering()
            if not (self.queue and self.active < self.max_concurrency):
                break
            if self.session_bound is not None and self.queue[0].state == PENDING and \
                    self.queue[0].index not in self.started:
                break  # its session is not free yet (start_deferred starts it when it is)
            rec = self.queue.popleft()
            self.active += 1
            admission, rec.admission = rec.admission, None
            if rec.state == PENDING:  # its on_trajectory_start ran at admission: the move it led to
                if admission is None:  # carried from a partial run: on_trajectory_start already ran
                    [admission] = route(self.run, [wait_move(rec, 1)], 1)
                apply_moves(self.run, [admission])
            self.settle(rec)
            if self.over_budget():  # an admission that finished its request (a failing hook)
                self.stop()

    # ---- issuing work --------------------------------------------------------------------------
    def generate(self, rec: RequestRecord, turn: int) -> None:
        rec.sent_record = getattr(rec.request, RECORD_ATTR, None)
        clock, rollout_fn = self.clock, self.run.settings.rollout_fn
        if clock is not None and (self.stamp_always or clock.active(rollout_fn)):
            rec.issued_version = clock.current(rollout_fn)
        self.flight.launch('generate', rec, turn, self._rollout(rec, turn))

    async def _rollout(self, rec: RequestRecord, turn: int) -> Outcome:
        # the call is made (and counted) when its task runs: a generation the budget cancels
        # before it ran made no call
        [(_, config)] = model_calls(self.run, [rec], self.call_config)
        return await self.flight.rollout(self.run.settings.rollout_fn, rec.request, config,
                                         self.run.options.rollout_timeout_s, threads=self.max_concurrency)

    #: a driver's change to a record's request config (``None``: none; a stream resuming a cut
    #: generation lowers its ``max_tokens``)
    call_config: Optional[Callable[[RequestRecord, Any], Any]] = None

    def has_news(self) -> bool:
        """Something to handle without waiting: a completion (a subclass adds its own events)."""
        return bool(self.flight.completions)

    @property
    def max_in_flight(self) -> int:
        """The most ``rollout_fn`` calls in flight at once."""
        return self.flight.max_calls

    # ---- handling what completed ---------------------------------------------------------------
    def on_completion(self, kind: str, rec: RequestRecord, turn: int, outcome: Outcome) -> None:
        """A generation or a step completed: its result goes to the record, and the record goes
        on through the state table (:meth:`settle`)."""
        if kind == 'generate':
            if self.stopping or (outcome.kind == RAISED and isinstance(outcome.value, _Stopped)):
                self.drop_generation(rec)  # past the budget: sent again on resume, unchanged
                return
            failed = model_failure_moves([rec], turn, outcome)
            if failed:
                apply_moves(self.run, failed)
            else:
                deliver(self.run, [rec], outcome.value, turn)
                self.on_generated(rec, turn)
            self.settle(rec, delivered=True)
            return
        if self.stopping and outcome.kind == RAISED and isinstance(outcome.value, _Stopped):
            self.hand_back(rec)  # a step an interrupt cancelled: the request goes back as it is
            return
        rec.step_outcome = outcome
        self.settle(rec)

    def settle(self, rec: RequestRecord, delivered: bool = False) -> None:
        """Hand ``rec`` to its state's handler (:data:`~mtflow.engine.handlers.STATE_HANDLERS`)
        until it needs work from outside: the model's output (a generation is issued), its step's
        outcome (the step starts as its own task), or nothing more (finished: its slot is free).
        ``delivered``: the output of its generation was just handed to it."""
        while True:
            state = rec.state
            if state == FINISHED:
                self.release_finished(rec)
                return
            if state in WAITING_STATES and not delivered:
                if self.stopping:
                    self.hand_back(rec)
                else:
                    self.generate(rec, rec.turns + 1)
                return
            if state == TOOL_STEP and rec.step_outcome is None:
                if self.begin_step(rec, rec.turns):
                    return
                continue  # prepare_steps failed it
            delivered = False
            advance(self.run, [rec], rec.turns + 1 if state in WAITING_STATES else rec.turns or 1)

    def on_generated(self, rec: RequestRecord, turn: int) -> None:
        """A generation's output was delivered (before its turn is handled): stamp its version."""
        version, rec.issued_version = rec.issued_version, None
        if version is not None:
            stamp(rec, version)

    def begin_step(self, rec: RequestRecord, turn: int) -> bool:
        """Start ``rec``'s step as its own task; ``False``: ``prepare_steps`` failed it."""
        going, moves = prepare_steps(self.run, [rec], turn)
        if moves:
            apply_moves(self.run, moves)
        if not going:
            return False
        self.flight.launch('step', rec, turn, self.flight.step(self.run.hooks, self.run.options.step_timeout_s,
                                                               rec, turn))
        return True

    def release_finished(self, rec: RequestRecord) -> None:
        """A request finished: its slot is free."""
        self.active -= 1
        self.finished_here += 1

    def drop_generation(self, rec: RequestRecord) -> None:
        """A generation stopped by the budget (cancelled, or completed after the budget was met):
        its output is not used, the request keeps the token record it was sent with, and it goes
        back unfinished."""
        self.dropped.append((rec, rec.sent_record))
        rec.sent_record = None
        self.hand_back(rec)

    def restore_records(self) -> None:
        """Give each request whose generation was dropped its token record back (after the
        threads of the calls were joined: a cancelled call may have extended it on its way out)."""
        for rec, before in self.dropped:
            if getattr(rec.request, RECORD_ATTR, None) is not before:
                try:
                    setattr(rec.request, RECORD_ATTR, before)
                except (AttributeError, TypeError):  # a frozen or slotted request
                    pass

    def hand_back(self, rec: RequestRecord) -> None:
        """Stopped by the budget in ``generating``/``continuing`` (or, by an interrupt, in its
        step): its slot is free, and it goes back unfinished (:attr:`RunResult.unfinished`)."""
        self.active -= 1

    # ---- the budget ------------------------------------------------------------------------------
    def done_counts(self) -> Dict[str, int]:
        """What the budget counts, under its names (a stream counts what it delivered)."""
        return {'finished': self.finished_here}

    def budget_left(self) -> Optional[float]:
        if self.budget is None or self.stopping:
            return None
        return self.budget.seconds_left(perf_counter() - self.t_start)

    def over_budget(self) -> bool:
        if self.stopping or self.closing:
            return True
        return self.budget is not None and self.budget.met(self.done_counts(), perf_counter() - self.t_start)

    def stop(self) -> None:
        """Stop admitting and generating: cancel the generations in flight (their requests go
        back unchanged), let the steps in flight finish (they stop in their next state)."""
        if self.stopping:
            return
        self.stopping = True
        self.queue.clear()
        for _rec, task in self.flight.generations():
            task.cancel()

    # ---- the result ------------------------------------------------------------------------------
    def result(self) -> RunResult:
        run = self.run
        run.loops = max((r.turns for r in run.records), default=0)  # the deepest turn reached
        if not self.stopping:
            return super().result()
        return partial_result(run, self.started)


def partial_result(run: RunState, started: Set[int]) -> RunResult:
    """The result of a partial rollout: the unfinished requests go back with their state (and
    whether their ``on_trajectory_start`` ran), never failed."""
    result = RunResult(
        outputs=[r.output if r.state == FINISHED else None for r in run.records],
        finish_reasons=[r.reason if r.state == FINISHED else None for r in run.records],
        failures=run.failures,
        recorder=run.recorder,
        turns=run.loops,
        rollout_fn_calls=run.rollout_calls)
    result.unfinished = [UnfinishedRequest(r, r.index in started) for r in run.records if r.state != FINISHED]
    result.trees = trees(run)
    publish(run, result)
    return result
