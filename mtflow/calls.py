"""Calling user code (hooks, steps, ``rollout_fn``) for a batch of requests, under a deadline.

The executor's driver is synchronous; what it calls may be sync or async. :class:`Caller` runs
one callable over a batch of argument tuples and returns one :class:`Outcome` per tuple, in
order: the value, the exception it raised, or a timeout. Nothing it calls can stop the batch:
``Exception`` becomes that item's outcome; ``KeyboardInterrupt``/``SystemExit`` propagate to the
driver (which turns them into :class:`mtflow.RolloutInterrupted`).

- **Coroutines, fast path.** A coroutine is first driven directly (``coro.send(None)``) with
  the private event loop set as the running loop: a hook that finishes without suspending (most
  do) costs a function call, no task and no loop iteration. Only coroutines that really suspend
  are resumed as tasks on the loop, concurrently, under the deadline; those still pending at the
  deadline are cancelled. (Until its first suspension a coroutine runs outside any task, so
  ``asyncio.current_task()`` is ``None`` there; ``eager=False`` gives every coroutine its own
  task from the start.)
- **Sync calls under a deadline** run, in order, in one daemon worker thread per batch; the
  driver waits for each with a timeout. A call past its deadline is abandoned: its thread is left
  running as a daemon (Python cannot kill a thread), so the process can still exit, and the
  remaining calls of the batch go on in a fresh worker. ``timeout=None`` calls inline, in the
  driver's thread.
"""
from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
from asyncio import events as _events
from time import perf_counter
from typing import Any, Callable, List, Optional, Sequence, Tuple

__all__ = ['Outcome', 'Caller', 'RAISED', 'TIMED_OUT', 'OK']

OK, RAISED, TIMED_OUT = 0, 1, 2


class Outcome:
    """What one call produced: ``kind`` (``OK``/``RAISED``/``TIMED_OUT``), the value or the
    exception, and its wall time in seconds."""
    __slots__ = ('kind', 'value', 'duration')

    def __init__(self, kind: int, value: Any, duration: float) -> None:
        self.kind, self.value, self.duration = kind, value, duration

    def __repr__(self) -> str:
        return f'Outcome({("ok", "raised", "timed out")[self.kind]}, {self.value!r:.60}, {self.duration:.3f}s)'


class _Resume:
    """Resumes, inside a task, a coroutine that the fast path started and that suspended."""
    __slots__ = ('coro', 'first')

    def __init__(self, coro: Any, first: Any) -> None:
        self.coro, self.first = coro, first

    def __await__(self) -> Any:
        coro, value = self.coro, self.first
        while True:
            try:
                sent = yield value
            except BaseException as exc:  # cancellation (deadline) or an exception thrown in
                try:
                    value = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


async def _resumed(coro: Any, first: Any) -> Any:
    return await _Resume(coro, first)


class Caller:
    """Calls user code for the executor's private event loop (one per run)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, eager: bool = True) -> None:
        self.loop = loop
        self.eager = eager

    # ---- one batch -----------------------------------------------------------------------------
    def batch(self, fn: Callable[..., Any], args: Sequence[tuple], is_async: bool,
              timeout: Optional[float], timed: bool = True) -> List[Outcome]:
        """``fn(*a)`` for every ``a`` in ``args``; one :class:`Outcome` each, in order.
        ``timed=False``: durations of calls that finish at once are not measured (0)."""
        if not args:
            return []
        if is_async:
            return self._coroutines(fn, args, timeout, timed)
        if timeout is None:
            return self._inline(fn, args)
        return self._threaded(fn, args, timeout)

    def one(self, fn: Callable[..., Any], args: tuple, timeout: Optional[float]) -> Outcome:
        """One call of a callable that may be sync or return an awaitable (``rollout_fn``)."""
        if timeout is None:
            t = perf_counter()
            try:
                value = fn(*args)
                if inspect.isawaitable(value):
                    return self._awaitables([value], t, None)[0]
            except Exception as exc:
                return Outcome(RAISED, exc, perf_counter() - t)
            return Outcome(OK, value, perf_counter() - t)
        [outcome] = self._threaded(fn, [args], timeout)
        if outcome.kind == OK and inspect.isawaitable(outcome.value):
            t = perf_counter()
            left = max(timeout - outcome.duration, 0.001)
            outcome = self._awaitables([outcome.value], t, left)[0]
            if outcome.kind == TIMED_OUT:
                outcome.value = timeout
        return outcome

    # ---- sync --------------------------------------------------------------------------------
    @staticmethod
    def _inline(fn: Callable[..., Any], args: Sequence[tuple]) -> List[Outcome]:
        out = []
        for a in args:
            t = perf_counter()
            try:
                out.append(Outcome(OK, fn(*a), perf_counter() - t))
            except Exception as exc:
                out.append(Outcome(RAISED, exc, perf_counter() - t))
        return out

    def _threaded(self, fn: Callable[..., Any], args: Sequence[tuple], timeout: float) -> List[Outcome]:
        results: List[Optional[Outcome]] = [None] * len(args)
        start = 0
        while start < len(args):
            worker = _Worker(fn, args, start, results, contextvars.copy_context())
            worker.thread.start()
            start = worker.wait(timeout)
        return results  # type: ignore[return-value]

    # ---- async -------------------------------------------------------------------------------
    def _coroutines(self, fn: Callable[..., Any], args: Sequence[tuple], timeout: Optional[float],
                    timed: bool = True) -> List[Outcome]:
        results: List[Optional[Outcome]] = [None] * len(args)
        suspended: List[Tuple[int, Any, Any]] = []
        t0 = perf_counter()
        eager = self.eager
        previous = _events._get_running_loop()
        _events._set_running_loop(self.loop)
        try:
            clock = perf_counter if timed else _zero
            for k, a in enumerate(args):
                t = clock()
                try:
                    coro = fn(*a)
                except Exception as exc:
                    results[k] = Outcome(RAISED, exc, clock() - t)
                    continue
                send = getattr(coro, 'send', None) if eager else None
                if send is None:
                    if not inspect.isawaitable(coro):  # declared async but returned a value
                        results[k] = Outcome(OK, coro, clock() - t)
                    else:
                        suspended.append((k, coro, _NOT_STARTED))
                    continue
                try:
                    first = send(None)
                except StopIteration as stop:
                    results[k] = Outcome(OK, stop.value, clock() - t)
                    continue
                except Exception as exc:
                    results[k] = Outcome(RAISED, exc, clock() - t)
                    continue
                except BaseException:  # an interrupt: nothing else of this batch starts
                    for _, pending, _ in suspended:
                        getattr(pending, 'close', lambda: None)()
                    raise
                suspended.append((k, coro, first))
        finally:
            _events._set_running_loop(previous)
        if suspended:
            left = None if timeout is None else max(timeout - (perf_counter() - t0), 0.001)
            awaitables = [c if first is _NOT_STARTED else _resumed(c, first) for _, c, first in suspended]
            for (k, _, _), outcome in zip(suspended, self._awaitables(awaitables, t0, left)):
                if outcome.kind == TIMED_OUT:
                    outcome.value = timeout  # the deadline, not what was left of it
                results[k] = outcome
        return results  # type: ignore[return-value]

    def _awaitables(self, awaitables: List[Any], t0: float, timeout: Optional[float]) -> List[Outcome]:
        """Run ``awaitables`` concurrently on the private loop; cancel those past ``timeout``."""

        async def timed(aw: Any) -> Tuple[int, Any, float]:
            try:
                return OK, await aw, perf_counter() - t0
            except Exception as exc:
                return RAISED, exc, perf_counter() - t0

        async def run_all() -> List[Outcome]:
            tasks = [asyncio.ensure_future(timed(aw)) for aw in awaitables]
            try:
                done, pending = await asyncio.wait(tasks, timeout=timeout)
            except BaseException:
                for task in tasks:
                    task.cancel()
                raise
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)  # let them run their cleanup, briefly
            out = []
            for task in tasks:
                if task in pending:
                    out.append(Outcome(TIMED_OUT, timeout, perf_counter() - t0))
                elif task.cancelled():  # cancelled by the hook itself
                    out.append(Outcome(RAISED, asyncio.CancelledError('cancelled'), perf_counter() - t0))
                else:
                    exc = task.exception()
                    if exc is not None:  # a BaseException (interrupt) from inside the hook
                        raise exc
                    kind, value, duration = task.result()
                    out.append(Outcome(kind, value, duration))
            return out

        return self.loop.run_until_complete(run_all())


_NOT_STARTED = object()


def _zero() -> float:
    return 0.0


class _Worker:
    """Runs ``fn(*args[k])`` for ``k >= start`` in a daemon thread, stopping when abandoned."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[tuple], start: int, results: List[Optional[Outcome]],
                 context: contextvars.Context) -> None:
        self.fn, self.args, self.results, self.context = fn, args, results, context
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.current = start
        self.started = perf_counter()
        self.abandoned = False
        self.interrupt: Optional[BaseException] = None
        self.thread = threading.Thread(target=self.context.run, args=(self.body, ), name='mtflow-step', daemon=True)

    def body(self) -> None:
        fn, args, n = self.fn, self.args, len(self.args)
        k = self.current
        while k < n:
            t = perf_counter()
            try:
                outcome = Outcome(OK, fn(*args[k]), 0.0)
            except Exception as exc:
                outcome = Outcome(RAISED, exc, 0.0)
            except BaseException as exc:  # KeyboardInterrupt/SystemExit from the call: the driver re-raises
                with self.lock:
                    if not self.abandoned:
                        self.interrupt = exc
                self.done.set()
                return
            outcome.duration = perf_counter() - t
            with self.lock:
                if self.abandoned:
                    return
                self.results[k] = outcome
                k += 1
                self.current, self.started = k, perf_counter()
        self.done.set()

    def wait(self, timeout: float) -> int:
        """Wait until the batch is done (return ``len(args)``) or one call is past ``timeout``
        (mark it timed out, abandon this worker, return the index to resume from)."""
        n = len(self.args)
        try:
            while True:
                with self.lock:
                    k, started = self.current, self.started
                left = timeout - (perf_counter() - started)
                if left <= 0:
                    with self.lock:
                        if self.current == k and not self.done.is_set():
                            self.abandoned = True
                            self.results[k] = Outcome(TIMED_OUT, timeout, perf_counter() - started)
                            return k + 1
                    continue
                if self.done.wait(left):
                    if self.interrupt is not None:
                        raise self.interrupt
                    return n
        except BaseException:
            with self.lock:
                self.abandoned = True  # an interrupt in the driver: the worker stops after its call
            raise
