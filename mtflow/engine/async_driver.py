"""The async driver (``Executor(..., mode='async')``): every request advances on its own.

The lockstep driver moves all live requests one turn together: each turn waits for the slowest
generation and the slowest tool of the batch. This driver runs the *same* per-state handlers of
:class:`mtflow.engine.executor.BatchRun` (same states, triggers, trace events, outputs) on one request
at a time, as soon as that request's own work completes:

1. a request is admitted (``pending`` -> ``generating``/``continuing``) while fewer than
   ``max_concurrency`` requests are in flight, and its generation is issued at once:
   ``rollout_fn([request], request_config)``, awaited when it is async, run in a thread pool
   when it is sync (at most ``max_concurrency`` calls in flight);
2. when its output arrives: ``handle_waiting([record])`` (the output is applied, ``on_turn_end``,
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

**Partial rollouts** (``run(..., until=Until(finished=K) | Until(seconds=S))``): when the budget
is hit the driver stops admitting and generating, cancels the generations in flight (their
requests are sent again on resume, unchanged), lets the steps in flight finish, and hands back
every request that has not finished in :attr:`RunResult.unfinished` with its machine state
(state, turn, token segments, masks, logprobs, infos). ``executor.run(result.unfinished)``
resumes them exactly where they stopped.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
from collections import deque
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from mtflow.core import machine as M
from mtflow.core import trace as _trace
from mtflow.core.calls import OK, RAISED, TIMED_OUT, Outcome
from mtflow.core.errors import MtflowError, RolloutFnError, StepTimeout
from mtflow.engine.executor import BatchRun, RunResult, _fail_move
from mtflow.core.machine import RequestRecord
from mtflow.core.records import Move

__all__ = ['Until', 'UnfinishedRequest', 'AsyncRun', 'MODES']

MODES = ('lockstep', 'async')
#: the most threads the driver starts for a synchronous ``rollout_fn`` (each call blocks one)
MAX_ROLLOUT_THREADS = 256


@dataclass(frozen=True)
class Until:
    """The budget of a partial rollout: stop once ``finished`` requests have finished in this
    call, or ``seconds`` have passed, whichever comes first."""
    finished: Optional[int] = None
    seconds: Optional[float] = None

    def __post_init__(self) -> None:
        if self.finished is None and self.seconds is None:
            raise ValueError('Until needs finished= (a number of requests) or seconds=')
        if self.finished is not None and (isinstance(self.finished, bool) or not isinstance(self.finished, int)
                                          or self.finished < 1):
            raise ValueError(f'Until.finished must be an int >= 1, not {self.finished!r}')
        if self.seconds is not None and (isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float))
                                         or self.seconds <= 0):
            raise ValueError(f'Until.seconds must be a number > 0, not {self.seconds!r}')

    @classmethod
    def coerce(cls, value: Any) -> Optional['Until']:
        """``None``, an :class:`Until`, or a dict like ``{'finished': 48}`` / ``{'seconds': 30}``."""
        if value is None or isinstance(value, Until):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {'finished', 'seconds'}
            if unknown:
                raise ValueError(f'until: unknown key(s) {sorted(unknown)}; use finished= and/or seconds=')
            return cls(**value)
        raise TypeError(f'until must be None, mtflow.Until or a dict, not {type(value).__name__}')


class UnfinishedRequest:
    """A request a partial rollout handed back, with its machine state: pass it (in a list, in
    any position, with new requests beside it) to ``Executor.run`` to resume it.

    ``state`` is ``'pending'`` (never started) or ``'generating'``/``'continuing'`` (its next
    generation was not done yet); ``turn`` is the turn that generation belongs to; ``request``
    is what will be sent. The record keeps the token segments, loss masks, logprobs and infos
    collected so far."""
    __slots__ = ('record', 'started')

    def __init__(self, record: RequestRecord, started: bool) -> None:
        self.record = record
        self.started = started  # on_trajectory_start already ran for it

    @property
    def uuid(self) -> str:
        return self.record.uuid

    @property
    def state(self) -> str:
        return self.record.state

    @property
    def turn(self) -> int:
        return self.record.turns + 1

    @property
    def request(self) -> Any:
        return self.record.request

    @property
    def messages(self) -> Any:  # so the request-shaped checks of the executor find them
        return self.record.request.messages

    def __repr__(self) -> str:
        return f'<UnfinishedRequest {self.uuid} {self.state} turn {self.turn}>'


class _Stopped(MtflowError):
    """A generation cancelled by the partial-rollout budget (never a failure)."""


class AsyncRun(BatchRun):
    """One ``Executor.run`` in async mode: :class:`BatchRun`'s handlers, driven per request."""

    def __init__(self, ex: Any, loop: asyncio.AbstractEventLoop, requests: List[Any],
                 first_turn_outputs: Optional[Sequence[Any]] = None, until: Optional[Until] = None) -> None:
        carried = {i: item for i, item in enumerate(requests) if isinstance(item, UnfinishedRequest)}
        if carried and first_turn_outputs is not None:
            raise ValueError('first_turn_outputs cannot be given with unfinished requests to resume')
        super().__init__(ex, loop, requests, first_turn_outputs)
        self.until = until
        self.started: set = set()  # indexes whose on_trajectory_start already ran
        for i, item in carried.items():
            rec = item.record
            if rec.state == M.FINISHED:
                raise ValueError(f'request {rec.uuid}: already finished, nothing to resume')
            rec.index = i
            rec.incoming = None
            rec.events = [] if self.recorder is not None and ex.on_finished is not None else None
            self.records[i] = rec
            if isinstance(requests, list):
                requests[i] = rec.request
            if item.started:
                self.started.add(i)
        self.max_concurrency = ex.max_concurrency or max(1, len(self.records))
        self.in_flight = 0
        self.max_in_flight = 0  # rollout_fn calls in flight at once (tests read it)
        self.completions: Deque[Tuple[str, RequestRecord, int, Any]] = deque()
        self.wake: Optional[asyncio.Event] = None
        self.waiter: Optional[asyncio.Task] = None
        self.tasks: Dict[int, asyncio.Task] = {}
        self.kinds: Dict[int, str] = {}
        self.held: Dict[int, Move] = {}  # admitted on a free slot
        self.queue: Deque[RequestRecord] = deque()
        self.active = 0
        self.finished_here = 0
        self.stopping = False
        self.rollout_pool: Optional[cf.ThreadPoolExecutor] = None
        self.step_pool: Optional[cf.ThreadPoolExecutor] = None
        self.rollout_is_async = _is_async_callable(ex.rollout_fn)

    # ---- the loop ----------------------------------------------------------------------------
    def drive(self) -> RunResult:
        loop = self.loop
        self.wake = asyncio.Event()
        self.t_start = perf_counter()
        try:
            self.admit_all()
            while True:
                if self.over_budget():
                    self.stop()
                elif not self.stopping:
                    self.fill_slots()
                if not self.tasks and not self.completions:
                    break  # every request finished, or was parked by the budget
                self.waiter = loop.create_task(self.next_completions())
                batch = loop.run_until_complete(self.waiter)
                for kind, rec, turn, outcome in sorted(batch, key=lambda c: c[1].index):
                    self.on_completion(kind, rec, turn, outcome)
        except BaseException:  # an interrupt (or a bug): nothing of ours is left running
            self.cancel_all()
            raise
        finally:
            for pool in (self.rollout_pool, self.step_pool):
                if pool is not None:
                    pool.shutdown(wait=False, cancel_futures=True)
        self.ex.gather_fn([self.finished_here])  # ranks stay in step: once, at the end
        return self.result()

    def admit_all(self) -> None:
        """Fail duplicates, run ``on_trajectory_start`` once for every new request (as lockstep
        does), hold their moves into ``generating``, and queue everything that will run."""
        self.apply(self.check_uuids())
        fresh = [r for r in self.records if r.state == M.PENDING and r.index not in self.started]
        if self.first is not None:
            moves = [self.wait_move(rec, 1) for rec in fresh]
        else:
            moves = self.start(fresh)
        for mv in moves:
            if mv.trigger in (M.GENERATE, M.CONTINUE):
                self.held[mv.record.index] = mv
            else:
                self.apply([mv])
        for rec in fresh:
            self.started.add(rec.index)
        outputs = None
        if self.first is not None:
            outputs = list(self.first)
            if len(outputs) != len(self.records):
                err = RolloutFnError(f'{len(outputs)} first-turn output(s) for {len(self.records)} request(s)',
                                     turn=1, field='first_turn_outputs')
                self.apply([_fail_move(r, 1, 'rollout_fn', err) for r in self.records if r.state != M.FINISHED])
                self.held.clear()
                return
        live = [rec for rec in self.records if rec.state != M.FINISHED]
        if outputs is None:
            self.queue.extend(live)
            return
        for rec in live:  # the first turn is already generated: every request starts at once
            self.active += 1
            self.apply([self.held.pop(rec.index)])
            self.completions.append(('generate', rec, 1, Outcome(OK, [outputs[rec.index]], 0.0)))

    def fill_slots(self) -> None:
        while self.queue and self.active < self.max_concurrency:
            rec = self.queue.popleft()
            self.active += 1
            held = self.held.pop(rec.index, None)
            if rec.state == M.PENDING:
                if held is None:  # carried from a partial run: on_trajectory_start already ran
                    held = self.wait_move(rec, 1)
                self.apply([held])
                if rec.state == M.FINISHED:
                    self.released(rec)
                    continue
            self.generate(rec, rec.turns + 1)

    # ---- issuing work --------------------------------------------------------------------------
    def generate(self, rec: RequestRecord, turn: int) -> None:
        self.launch('generate', rec, turn, self._rollout(rec, turn))

    def launch(self, kind: str, rec: RequestRecord, turn: int, coro: Any) -> None:
        """Start ``coro`` as a task whose end, however it comes, posts exactly one completion.

        The completion is posted by a done callback, not by code inside the task: a task that
        :meth:`stop` cancels before it ever ran never executes a line of its coroutine, and it
        must still leave :attr:`tasks` and report (as a stopped generation), or the driver would
        wait for it forever."""
        task = self.loop.create_task(coro)
        self.tasks[rec.index] = task
        self.kinds[rec.index] = kind
        task.add_done_callback(lambda done: self.landed(kind, rec, turn, done))

    def landed(self, kind: str, rec: RequestRecord, turn: int, task: 'asyncio.Task[Outcome]') -> None:
        """A task ended: post its completion. Cancelled (by the budget, or while unwinding an
        interrupt): a stopped generation; an interrupt raised inside it: that exception, which the
        driver is already unwinding (retrieved here, so it is never reported as unretrieved)."""
        if self.tasks.get(rec.index) is task:
            del self.tasks[rec.index]
        if task.cancelled():
            outcome = Outcome(RAISED, _Stopped('cancelled'), 0.0)
        else:
            exc = task.exception()
            outcome = Outcome(RAISED, exc, 0.0) if exc is not None else task.result()
        self.completions.append((kind, rec, turn, outcome))
        self.wake.set()

    async def _rollout(self, rec: RequestRecord, turn: int) -> Outcome:
        ex = self.ex
        self.rollout_calls += 1  # counted here: a generation the budget cancels before it ran made no call
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        t = perf_counter()
        call = None
        try:
            if self.rollout_is_async:
                call = ex.rollout_fn([rec.request], ex.request_config)
            else:
                call = asyncio.wrap_future(self._rollout_threads().submit(ex.rollout_fn, [rec.request],
                                                                          ex.request_config))
            value = await _bounded(call, ex.rollout_timeout_s)
        except asyncio.TimeoutError:
            return Outcome(TIMED_OUT, ex.rollout_timeout_s, perf_counter() - t)
        except Exception as exc:
            return Outcome(RAISED, exc, perf_counter() - t)
        finally:
            self.in_flight -= 1
        return Outcome(OK, value, perf_counter() - t)

    def _rollout_threads(self) -> cf.ThreadPoolExecutor:
        if self.rollout_pool is None:
            self.rollout_pool = cf.ThreadPoolExecutor(min(self.max_concurrency, MAX_ROLLOUT_THREADS),
                                                      thread_name_prefix='mtflow-rollout')
        return self.rollout_pool

    async def _step(self, rec: RequestRecord, turn: int) -> Outcome:
        hooks, timeout = self.hooks, self.ex.step_timeout_s
        t = perf_counter()
        try:
            if hooks.step_is_async:
                call = hooks.step(rec.request, rec.choice, turn)
            else:
                if self.step_pool is None:  # one at a time, as the lockstep driver runs sync steps
                    self.step_pool = cf.ThreadPoolExecutor(1, thread_name_prefix='mtflow-step')
                call = asyncio.wrap_future(self.step_pool.submit(hooks.step, rec.request, rec.choice, turn))
            value = await _bounded(call, timeout)
        except asyncio.TimeoutError:
            return Outcome(TIMED_OUT, timeout, perf_counter() - t)
        except Exception as exc:
            return Outcome(RAISED, exc, perf_counter() - t)
        return Outcome(OK, value, perf_counter() - t)

    async def next_completions(self) -> List[Tuple[str, RequestRecord, int, Any]]:
        if not self.completions:
            self.wake.clear()
            left = self.budget_left()
            try:
                await asyncio.wait_for(self.wake.wait(), left)
            except asyncio.TimeoutError:
                pass
        batch = list(self.completions)
        self.completions.clear()
        return batch

    # ---- handling what completed ---------------------------------------------------------------
    def on_completion(self, kind: str, rec: RequestRecord, turn: int, outcome: Outcome) -> None:
        if kind == 'generate':
            if outcome.kind == RAISED and isinstance(outcome.value, _Stopped):
                self.parked(rec)
                return
            self.apply(self.rollout_moves([rec], turn, outcome))
            if rec.state in M.WAITING_STATES:
                self.apply(self.handle_waiting([rec], turn))
            if rec.state == M.TOOL_STEP:
                self.begin_step(rec, turn)
        else:
            self.apply(self.end_steps([rec], turn, [outcome]))
            if rec.state in M.WAITING_STATES:
                if self.stopping:
                    self.parked(rec)
                    return
                self.generate(rec, turn + 1)
        if rec.state == M.FINISHED:
            self.released(rec)

    def rollout_moves(self, records: List[RequestRecord], turn: int, outcome: Outcome) -> List[Move]:
        """What a ``rollout_fn`` call's outcome does to the records it served (the lockstep
        driver's rules: a failed or late call fails them; a good one is delivered)."""
        if outcome.kind == TIMED_OUT:
            err = StepTimeout(f'rollout_fn did not return within {outcome.value:g} s', turn=turn, field='rollout_fn')
            return [_fail_move(rec, turn, 'rollout_fn', err, M.TIMEOUT) for rec in records]
        if outcome.kind == RAISED:
            exc = outcome.value
            err = RolloutFnError(f'rollout_fn raised {type(exc).__name__}: {exc}', turn=turn, field='rollout_fn')
            err.__cause__ = exc
            return [_fail_move(rec, turn, 'rollout_fn', err) for rec in records]
        self.deliver(records, outcome.value, turn)
        return []

    def begin_step(self, rec: RequestRecord, turn: int) -> None:
        going, moves = self.begin_steps([rec], turn)
        if moves:
            self.apply(moves)
        if going:
            self.launch('step', rec, turn, self._step(rec, turn))

    def released(self, rec: RequestRecord) -> None:
        self.active -= 1
        self.finished_here += 1

    def parked(self, rec: RequestRecord) -> None:
        """Stopped by the budget in ``generating``/``continuing``: handed back unfinished."""
        self.active -= 1

    def cancel_all(self) -> None:
        """Cancel every task of this run and let them unwind. A task whose coroutine raised an
        interrupt re-raises it while unwinding; that is swallowed here (the first one is already on
        its way up), so the loop closes clean."""
        tasks = [t for t in list(self.tasks.values()) + [self.waiter] if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        for _ in range(5):
            pending = [t for t in tasks if not t.done()]
            if not pending:
                break
            try:
                self.loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
            except BaseException:  # noqa: BLE001 - see the docstring
                continue
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: no "exception was never retrieved" at exit

    # ---- the budget ------------------------------------------------------------------------------
    def budget_left(self) -> Optional[float]:
        if self.until is None or self.until.seconds is None or self.stopping:
            return None
        return max(0.0, self.until.seconds - (perf_counter() - self.t_start))

    def over_budget(self) -> bool:
        until = self.until
        if until is None or self.stopping:
            return self.stopping
        if until.finished is not None and self.finished_here >= until.finished:
            return True
        return until.seconds is not None and perf_counter() - self.t_start >= until.seconds

    def stop(self) -> None:
        """Stop admitting and generating: cancel the generations in flight (their requests go
        back unchanged), let the steps in flight finish (they park in their next state)."""
        if self.stopping:
            return
        self.stopping = True
        self.queue.clear()
        for index, task in list(self.tasks.items()):
            if self.kinds.get(index) == 'generate':
                task.cancel()

    # ---- the result ------------------------------------------------------------------------------
    def result(self) -> RunResult:
        parked = [r for r in self.records if r.state != M.FINISHED]
        self.loops = max((r.turns for r in self.records), default=0)  # the deepest turn reached
        if not self.stopping:
            return super().result()
        # a partial rollout: the unfinished requests go back with their state, never failed
        result = RunResult(
            outputs=[r.output if r.state == M.FINISHED else None for r in self.records],
            finish_reasons=[r.reason if r.state == M.FINISHED else None for r in self.records],
            failures=self.failures,
            recorder=self.recorder,
            turns=self.loops,
            rollout_fn_calls=self.rollout_calls)
        result.unfinished = [UnfinishedRequest(r, r.index in self.started) for r in parked]
        if self.recorder is not None and _trace.has_listeners():
            _trace.publish(result.trace)
        return result


def _is_async_callable(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, '__call__', None)) or (
        inspect.ismethod(fn) and inspect.iscoroutinefunction(fn.__func__))


async def _bounded(call: Any, timeout: Optional[float]) -> Any:
    """Await ``call`` (a coroutine, a future, or a plain value) within ``timeout``. A coroutine
    that a cancellation or the deadline stops before it ever ran is closed (no "never awaited"
    warning)."""
    try:
        if timeout is None:
            return await _await_result(call)
        return await asyncio.wait_for(_await_result(call), timeout)
    except BaseException:
        if inspect.iscoroutine(call) and inspect.getcoroutinestate(call) == inspect.CORO_CREATED:
            call.close()
        raise


async def _await_result(value: Any) -> Any:
    """A value that may be awaitable (an async ``rollout_fn`` or step) or already there (a sync
    ``rollout_fn`` declared as a plain function that returned an awaitable, or a list)."""
    while inspect.isawaitable(value):
        value = await value
    return value
