"""What the async driver has running: each generation or step as a task on the run's loop.

Split from :mod:`mtflow.engine.async_driver` (which decides *what* runs next) so that the rules
of running it are in one place:

* every task posts exactly one completion, however it ends (:meth:`InFlight.launch`): a task
  cancelled before it ever ran never executes a line of its coroutine, so the completion is
  posted by a done callback, not from inside the task;
* a synchronous ``rollout_fn`` runs in a worker pool (each call blocks one thread, at most
  :data:`MAX_ROLLOUT_THREADS`), a synchronous ``step`` in one step thread (one at a time, as the
  lockstep driver runs them); async ones are awaited on the loop; both under their deadlines
  (:func:`mtflow.core.calls.within`, the one call-with-deadline). The pools' threads are daemons
  (:class:`mtflow.core.call_threads.CallThreads`): a user's call that never returns cannot hold the
  process after an interrupt;
* an interrupt cancels every task and lets them unwind (:meth:`InFlight.cancel_all`), and the
  pools are shut down with or without joining their threads (:meth:`InFlight.close`).
"""
from __future__ import annotations

import asyncio
from collections import deque
from time import perf_counter
from typing import Any, Awaitable, Callable, Deque, Dict, List, Optional, Tuple

from mtflow.core.call_threads import CallThreads
from mtflow.core.calls import RAISED, Outcome, is_async_callable, within
from mtflow.core.errors import MtflowError
from mtflow.core.machine import RequestRecord

__all__ = ['InFlight', 'Completion', 'Stopped', 'MAX_ROLLOUT_THREADS', 'timed_step']

#: the most threads the driver starts for a synchronous ``rollout_fn`` (each call blocks one)
MAX_ROLLOUT_THREADS = 256

#: one completion: (``'generate'`` or ``'step'``, the record, its turn, the call's outcome)
Completion = Tuple[str, RequestRecord, int, Outcome]


class Stopped(MtflowError):
    """A generation cancelled by the partial-rollout budget (never a failure)."""


class InFlight:
    """The tasks of one async run (by record index, with their kind), the completions they posted
    and not yet handled, and the worker pools of synchronous calls."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rollout_fn: Any) -> None:
        self.loop = loop
        self.rollout_is_async = is_async_callable(rollout_fn)
        #: record index -> its running task, and the generations and the resting records' waits
        #: among them (their records)
        self.tasks: Dict[int, asyncio.Task] = {}
        self.generating: Dict[int, RequestRecord] = {}
        self.waking: Dict[int, RequestRecord] = {}
        self.completions: Deque[Completion] = deque()
        self.wake: Optional[asyncio.Event] = None  # set by start(), when the driver begins
        self.waiter: Optional[asyncio.Task] = None
        self.rollout_pool: Optional[CallThreads] = None
        self.step_pool: Optional[CallThreads] = None
        self.calls = 0  # rollout_fn calls running now
        self.max_calls = 0  # the most at once

    def start(self) -> None:
        self.wake = asyncio.Event()

    def launch(self, kind: str, rec: RequestRecord, turn: int, coro: Any) -> None:
        """Start ``coro`` as a task whose end, however it comes, posts exactly one completion
        (see the module docstring: a task :meth:`cancel_all` or the budget cancels before it ran
        must still leave :attr:`tasks` and report, as a stopped generation, or the driver would
        wait for it forever)."""
        task = self.loop.create_task(coro)
        self.tasks[rec.index] = task
        if kind == 'generate':
            self.generating[rec.index] = rec
        elif kind == 'wake':
            self.waking[rec.index] = rec
        task.add_done_callback(lambda done: self._post(kind, rec, turn, done))

    def _post(self, kind: str, rec: RequestRecord, turn: int, task: 'asyncio.Task[Outcome]') -> None:
        """A task ended: post its completion. Cancelled (by the budget, or while unwinding an
        interrupt): a stopped generation; an interrupt raised inside it: that exception, which the
        driver is already unwinding (retrieved here, so it is never reported as unretrieved)."""
        if self.tasks.get(rec.index) is task:
            del self.tasks[rec.index]
            self.generating.pop(rec.index, None)
            self.waking.pop(rec.index, None)
        if task.cancelled():
            outcome = Outcome(RAISED, Stopped('cancelled'), 0.0)
        else:
            exc = task.exception()
            outcome = Outcome(RAISED, exc, 0.0) if exc is not None else task.result()
        self.completions.append((kind, rec, turn, outcome))
        self.wake.set()

    def generations(self) -> List[Tuple[RequestRecord, 'asyncio.Task[Outcome]']]:
        """The generations running now, with their tasks (to cancel some)."""
        return [(rec, self.tasks[index]) for index, rec in list(self.generating.items())]

    def waits(self) -> List[Tuple[RequestRecord, 'asyncio.Task[Outcome]']]:
        """The resting records' waits running now, with their tasks."""
        return [(rec, self.tasks[index]) for index, rec in list(self.waking.items())]

    def forget(self, rec: RequestRecord) -> None:
        """Stop ``rec``'s task and drop it without a completion (a deadlocked wait, failed by the
        driver itself)."""
        task = self.tasks.pop(rec.index, None)
        self.generating.pop(rec.index, None)
        self.waking.pop(rec.index, None)
        if task is not None:
            task.cancel()

    def steps(self) -> List['asyncio.Task[Outcome]']:
        """The steps running now (to cancel them on an interrupt; not the resting records' waits,
        which the budget's stop cancels with the generations)."""
        return [task for index, task in list(self.tasks.items())
                if index not in self.generating and index not in self.waking]

    def idle(self) -> bool:
        """Nothing running and nothing to handle."""
        return not self.tasks and not self.completions

    def wait(self, has_news: Callable[[], bool], timeout: Optional[float]) -> List[Completion]:
        """Sleep on the loop until a completion is posted (or ``has_news()``, or ``timeout``
        seconds), then take every completion posted."""
        self.waiter = self.loop.create_task(self._next(has_news, timeout))
        return self.loop.run_until_complete(self.waiter)

    async def _next(self, has_news: Callable[[], bool], timeout: Optional[float]) -> List[Completion]:
        if not has_news():
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        batch = list(self.completions)
        self.completions.clear()
        return batch

    # ---- the calls -------------------------------------------------------------------------------
    async def rollout(self, rollout_fn: Any, request: Any, config: Any, timeout: Optional[float],
                      threads: int) -> Outcome:
        """One request's ``rollout_fn([request], config)`` under its deadline: awaited when it is
        async, in the rollout pool (``threads`` workers, made at the first call) when it is sync."""
        self.calls += 1
        self.max_calls = max(self.max_calls, self.calls)
        t = perf_counter()
        try:
            if self.rollout_is_async:
                call = rollout_fn([request], config)
            else:
                if self.rollout_pool is None:
                    self.rollout_pool = CallThreads(min(threads, MAX_ROLLOUT_THREADS), 'mtflow-rollout')
                call = asyncio.wrap_future(self.rollout_pool.submit(rollout_fn, [request], config))
        except Exception as exc:  # submitting it failed (a pool shut down)
            self.calls -= 1
            return Outcome(RAISED, exc, perf_counter() - t)
        try:
            return await within(call, timeout, t)
        finally:
            self.calls -= 1

    def step(self, hooks: Any, timeout: Optional[float], rec: RequestRecord, turn: int) -> Awaitable[Outcome]:
        """One request's ``step`` under its deadline (a sync one in the single step thread)."""
        if self.step_pool is None and not hooks.step_is_async:  # one at a time, as lockstep runs sync steps
            self.step_pool = CallThreads(1, 'mtflow-step')
        return timed_step(hooks, timeout, self.step_pool, rec, turn)

    # ---- the end ---------------------------------------------------------------------------------
    def close(self, wait: bool) -> None:
        """Shut the worker pools down. ``wait``: join the threads of synchronous calls still
        running (a generation the budget cancelled cannot be stopped inside its thread), so that
        no thread of this run is left running native code when the interpreter exits; an interrupt
        does not wait (a call that never returns would hold the stop: the daemon threads are left,
        and the interpreter's exit waits a bounded time for them, ``mtflow.core.call_threads``)."""
        for pool in (self.rollout_pool, self.step_pool):
            if pool is not None:
                pool.shutdown(wait=wait)

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


async def timed_step(hooks: Any, timeout: Optional[float], step_pool: Optional[CallThreads],
                     rec: RequestRecord, turn: int) -> Outcome:
    """One request's ``step`` under its deadline: an async step on the loop, a sync one in the
    driver's single step thread."""
    t = perf_counter()
    try:
        if hooks.step_is_async:
            call = hooks.step(rec.request, rec.choice, turn)
        else:
            call = asyncio.wrap_future(step_pool.submit(hooks.step, rec.request, rec.choice, turn))
    except Exception as exc:  # a sync-looking step that raised as it was called, or a pool shut down
        return Outcome(RAISED, exc, perf_counter() - t)
    return await within(call, timeout, t)
