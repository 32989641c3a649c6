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
import functools
import inspect
import threading
from asyncio import events as _events
from time import perf_counter
from types import CoroutineType as _CoroutineType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ['Outcome', 'Caller', 'Results', 'RAISED', 'TIMED_OUT', 'OK', 'is_async_callable', 'within',
           'UNWIND_GRACE_S', 'wrapped_methods']

OK, RAISED, TIMED_OUT = 0, 1, 2

#: how long a call cancelled at its deadline (or with its task) may take to unwind before it is
#: left behind: a call that swallows its cancellation cannot hold the run
UNWIND_GRACE_S = 1.0


def is_async_callable(fn: Any) -> bool:
    """Whether calling ``fn`` gives a coroutine: an ``async def`` function or method, an object
    whose ``__call__`` is one, or a ``functools.partial`` of one. The one test of this for hooks,
    steps, tools and ``rollout_fn``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, '__call__', None)) or (
        inspect.ismethod(fn) and inspect.iscoroutinefunction(fn.__func__))


def wrapped_methods(fn: Any, name: str) -> List[Callable[..., Any]]:
    """The methods called ``name`` of ``fn`` and of what it wraps (``__wrapped__``, a bound
    method's object; a few wrappers deep), outermost first, each once. A ``rollout_fn`` that keeps
    state per request declares so with them: ``forget(uuid)`` (the request is final), ``fork(
    parent_uuid, child_uuids)`` (children were forked from it, ``docs/branching.md``)."""
    found: List[Callable[..., Any]] = []
    for _ in range(8):  # a few wrappers deep, never a cycle
        if fn is None:
            break
        method = getattr(fn, name, None)
        if callable(method) and method not in found:
            found.append(method)
        fn = fn.__self__ if inspect.ismethod(fn) else getattr(fn, '__wrapped__', None)
    return found


async def within(call: Any, timeout: Optional[float], started: Optional[float] = None) -> Outcome:
    """Await ``call`` (a coroutine, a future, or a value already there) for at most ``timeout``
    seconds from now: the one call-with-deadline of the package, for the awaitables of hooks and
    steps, tool calls and model calls (trio's ``move_on_after``, answering an :class:`Outcome`).

    - **returned**: ``OK`` with the value; **raised** an ``Exception`` or called ``sys.exit()``:
      ``RAISED`` with it (a callee's exit ends that call, not the run); any other
      ``BaseException`` (an interrupt) propagates.
    - **deadline**: the call is cancelled, given :data:`UNWIND_GRACE_S` to unwind, and the
      outcome is ``TIMED_OUT`` (value: ``timeout``) whatever it raised in answer (a resumable
      generation answers with its partial output: past the deadline that is still the deadline).
    - **the awaiting task is cancelled** (a budget, a weight update): the call is cancelled and
      what it raised in answer propagates (a resumable generation's ``GenerationAborted`` with
      what it generated), else the cancellation.

    Durations count from ``started`` (a batch's start) when given. A coroutine stopped before it
    ever ran is closed (no "never awaited" warning)."""
    t0 = perf_counter() if started is None else started
    try:
        if timeout is None:
            value = await _result_of(call)
            kind = RAISED if isinstance(value, _Raised) else OK
            return Outcome(kind, value.error if kind == RAISED else value, perf_counter() - t0)
        loop = asyncio.get_running_loop()
        task = loop.create_task(_result_of(call))
        # wake at the call's end or at the deadline, whichever comes first (asyncio.wait's work,
        # without its bookkeeping for many awaitables: this is every step's and tool call's path)
        woken = loop.create_future()
        wake = functools.partial(_wake, woken)
        task.add_done_callback(wake)
        deadline = loop.call_later(timeout, wake)
        try:
            await woken
        except asyncio.CancelledError:
            await _unwind(task)
            answer = task.result() if task.done() and not task.cancelled() and task.exception() is None else None
            if isinstance(answer, _Raised):
                raise answer.error from None  # what the call answered the cancellation with
            raise
        finally:
            deadline.cancel()
            task.remove_done_callback(wake)
        if not task.done():
            await _unwind(task)
            return Outcome(TIMED_OUT, timeout, perf_counter() - t0)
        if task.cancelled():  # cancelled by the call itself
            return Outcome(RAISED, asyncio.CancelledError('cancelled'), perf_counter() - t0)
        exc = task.exception()
        if exc is not None:
            raise exc  # an interrupt: _result_of answers every Exception itself
        value = task.result()
        if isinstance(value, _Raised):
            return Outcome(RAISED, value.error, perf_counter() - t0)
        return Outcome(OK, value, perf_counter() - t0)
    finally:
        if inspect.iscoroutine(call) and inspect.getcoroutinestate(call) == inspect.CORO_CREATED:
            call.close()


def _wake(woken: 'asyncio.Future[None]', _task: Any = None) -> None:
    if not woken.done():
        woken.set_result(None)


class _Raised:
    """What a call raised, carried as its result: a task that raised ``SystemExit`` would stop
    the event loop itself, so the call's exceptions never leave :func:`_result_of` as such."""
    __slots__ = ('error', )

    def __init__(self, error: BaseException) -> None:
        self.error = error


async def _result_of(value: Any) -> Any:
    """What an awaitable comes to, awaited as often as it gives another awaitable (an async
    ``rollout_fn`` wrapped by a sync-looking one); a plain value is its own result; what it
    raised (an ``Exception``, ``sys.exit()``) is a :class:`_Raised`."""
    try:
        while inspect.isawaitable(value):
            value = await value
    except (Exception, SystemExit) as exc:
        return _Raised(exc)
    return value


async def _unwind(task: 'asyncio.Future[Any]') -> None:
    """Cancel ``task`` and give it :data:`UNWIND_GRACE_S` to end; its exception is retrieved
    (never reported as unretrieved), whether or not anyone reads it."""
    task.cancel()
    await asyncio.wait((task, ), timeout=UNWIND_GRACE_S)
    if task.done() and not task.cancelled():
        task.exception()


class Outcome:
    """What one call produced: ``kind`` (``OK``/``RAISED``/``TIMED_OUT``), the value or the
    exception, and its wall time in seconds."""
    __slots__ = ('kind', 'value', 'duration')

    def __init__(self, kind: int, value: Any, duration: float) -> None:
        self.kind, self.value, self.duration = kind, value, duration

    def __repr__(self) -> str:
        return f'Outcome({("ok", "raised", "timed out")[self.kind]}, {self.value!r:.60}, {self.duration:.3f}s)'


#: what :meth:`Caller.values` returns: ``(values, problems, durations)``
Results = Tuple[List[Any], Optional[Dict[int, Outcome]], Optional[List[float]]]


class _Resume:
    """Resumes, inside a task, a coroutine that the fast path started and that suspended
    (``yielded``: what it yielded when it suspended, handed on to the task)."""
    __slots__ = ('coro', 'yielded')

    def __init__(self, coro: Any, yielded: Any) -> None:
        self.coro, self.yielded = coro, yielded

    def __await__(self) -> Any:
        coro, value = self.coro, self.yielded
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


async def _resumed(coro: Any, yielded: Any) -> Any:
    return await _Resume(coro, yielded)


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
        values, problems, durations = self.values(fn, args, is_async, timeout, timed)
        if durations is None:
            out = [Outcome(OK, v, 0.0) for v in values]
        else:
            out = [Outcome(OK, v, d) for v, d in zip(values, durations)]
        if problems:
            for k, outcome in problems.items():
                out[k] = outcome
        return out

    def values(self, fn: Callable[..., Any], args: Sequence[tuple], is_async: bool, timeout: Optional[float],
               timed: bool = True) -> Results:
        """:meth:`batch` without an :class:`Outcome` per call (the executor's hot path):
        ``(values, problems, durations)``: ``values[k]`` is what call ``k`` returned (``None``
        where it did not return), ``problems`` maps the index of each call that raised or timed
        out to its :class:`Outcome` (``None`` when there is none), ``durations[k]`` its wall time
        (``None`` when ``timed=False``: calls that finish at once are not measured)."""
        if not args:
            return [], None, [] if timed else None
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
                    return self.run_awaitables([value], t, None)[0]
            except Exception as exc:
                return Outcome(RAISED, exc, perf_counter() - t)
            return Outcome(OK, value, perf_counter() - t)
        [outcome] = self.batch(fn, [args], False, timeout)
        if outcome.kind == OK and inspect.isawaitable(outcome.value):
            t = perf_counter()
            left = max(timeout - outcome.duration, 0.001)
            outcome = self.run_awaitables([outcome.value], t, left)[0]
            if outcome.kind == TIMED_OUT:
                outcome.value = timeout
        return outcome

    def awaited(self, awaitable: Any, timeout: Optional[float]) -> Outcome:
        """The outcome of one awaitable a sync-looking hook returned, by the coroutine fast path
        (driven directly; on the loop, under ``timeout``, only if it suspends): a hook such as
        ``on_request_finished`` that has nothing to await costs a ``send``, not a loop run."""
        values, problems, _ = self._coroutines(_same, [(awaitable,)], timeout, timed=False)
        if problems:
            return problems[0]
        return Outcome(OK, values[0], 0.0)

    # ---- sync --------------------------------------------------------------------------------
    @staticmethod
    def _inline(fn: Callable[..., Any], args: Sequence[tuple]) -> Results:
        values: List[Any] = []
        durations: List[float] = []
        problems: Optional[Dict[int, Outcome]] = None
        t = perf_counter()
        for k, a in enumerate(args):
            try:
                values.append(fn(*a))
            except Exception as exc:
                values.append(None)
                if problems is None:
                    problems = {}
                problems[k] = Outcome(RAISED, exc, perf_counter() - t)
            t1 = perf_counter()
            durations.append(t1 - t)
            t = t1
        return values, problems, durations

    def _threaded(self, fn: Callable[..., Any], args: Sequence[tuple], timeout: float) -> Results:
        n = len(args)
        values: List[Any] = [None] * n
        durations: List[float] = [0.0] * n
        problems: Dict[int, Outcome] = {}
        start = 0
        while start < n:
            worker = _Worker(fn, args, start, values, durations, problems, contextvars.copy_context())
            worker.thread.start()
            start = worker.wait(timeout)
        return values, problems or None, durations

    # ---- async -------------------------------------------------------------------------------
    def _coroutines(self, fn: Callable[..., Any], args: Sequence[tuple], timeout: Optional[float],
                    timed: bool = True) -> Results:
        """Drive each coroutine directly (``send(None)``); resume those that suspend as tasks."""
        n = len(args)
        values: List[Any] = [None] * n
        durations: Optional[List[float]] = [0.0] * n if timed else None
        problems: Optional[Dict[int, Outcome]] = None
        suspended: List[Tuple[int, Any, Any]] = []  # (k, coroutine, what its first suspension yielded)
        t0 = perf_counter()
        eager = self.eager
        previous = _events._get_running_loop()
        _events._set_running_loop(self.loop)
        try:
            t = t0
            for k, a in enumerate(args):
                try:
                    coro = fn(*a)
                    if eager and coro.__class__ is _CoroutineType:  # the common shape, inlined
                        try:
                            yielded = coro.send(None)
                        except StopIteration as stop:
                            values[k] = stop.value
                        else:
                            suspended.append((k, coro, yielded))
                    else:
                        self._start_awaitable(k, coro, values, suspended)
                except Exception as exc:
                    if problems is None:
                        problems = {}
                    problems[k] = Outcome(RAISED, exc, (perf_counter() - t) if timed else 0.0)
                except BaseException:  # an interrupt: nothing else of this batch starts
                    for _, pending, _ in suspended:
                        getattr(pending, 'close', lambda: None)()
                    raise
                if timed:
                    t1 = perf_counter()
                    durations[k] = t1 - t  # type: ignore[index]
                    t = t1
        finally:
            _events._set_running_loop(previous)
        if suspended:
            problems = self._resume_suspended(suspended, values, durations, problems, t0, timeout)
        return values, problems, durations

    def _start_awaitable(self, k: int, value: Any, values: List[Any], suspended: List[Tuple[int, Any, Any]]) -> None:
        """What an async hook returned when it is not a plain coroutine (or ``eager`` is off):
        a value (declared async, returned at once), an awaitable to run as a task, or a
        coroutine-like object driven directly like a coroutine."""
        send = getattr(value, 'send', None) if self.eager else None
        if send is None:
            if not inspect.isawaitable(value):  # declared async but returned a value
                values[k] = value
            else:
                suspended.append((k, value, _NOT_STARTED))
            return
        try:
            yielded = send(None)
        except StopIteration as stop:
            values[k] = stop.value
        else:
            suspended.append((k, value, yielded))

    def _resume_suspended(self, suspended: List[Tuple[int, Any, Any]], values: List[Any],
                          durations: Optional[List[float]], problems: Optional[Dict[int, Outcome]], t0: float,
                          timeout: Optional[float]) -> Optional[Dict[int, Outcome]]:
        """Run the coroutines that suspended as tasks, under what is left of ``timeout``; their
        values go into ``values``, their failures into the returned ``problems``."""
        left = None if timeout is None else max(timeout - (perf_counter() - t0), 0.001)
        awaitables = [c if yielded is _NOT_STARTED else _resumed(c, yielded) for _, c, yielded in suspended]
        for (k, _, _), outcome in zip(suspended, self.run_awaitables(awaitables, t0, left)):
            if outcome.kind == OK:
                values[k] = outcome.value
                if durations is not None:
                    durations[k] = outcome.duration
                continue
            if outcome.kind == TIMED_OUT:
                outcome.value = timeout  # the deadline, not what was left of it
            if problems is None:
                problems = {}
            problems[k] = outcome
        return problems

    def run_awaitables(self, awaitables: List[Any], t0: float, timeout: Optional[float]) -> List[Outcome]:
        """Run ``awaitables`` concurrently on the private loop, each :func:`within` ``timeout``."""

        async def run_all() -> List[Outcome]:
            tasks = [asyncio.ensure_future(within(aw, timeout, t0)) for aw in awaitables]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for task in tasks:
                    task.cancel()
                raise

        return self.loop.run_until_complete(run_all())


_NOT_STARTED = object()


def _same(value: Any) -> Any:
    return value


class _Worker:
    """Runs ``fn(*args[k])`` for ``k >= start`` in a daemon thread, stopping when abandoned.

    It writes ``values[k]``/``durations[k]`` (and ``problems[k]`` for a call that raised); the
    lock makes "call ``k`` finished" and "call ``k`` is abandoned" exclude each other, so an
    abandoned call's late result is never written and no call runs twice."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[tuple], start: int, values: List[Any],
                 durations: List[float], problems: Dict[int, Outcome], context: contextvars.Context) -> None:
        self.fn, self.args, self.context = fn, args, context
        self.values, self.durations, self.problems = values, durations, problems
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.current = start
        self.started = perf_counter()
        self.abandoned = False
        self.interrupt: Optional[BaseException] = None
        self.thread = threading.Thread(target=self.context.run, args=(self.body, ), name='mtflow-step', daemon=True)

    def body(self) -> None:
        fn, args, n, lock = self.fn, self.args, len(self.args), self.lock
        values, durations, problems = self.values, self.durations, self.problems
        k = self.current
        t = perf_counter()
        while k < n:
            failed = None
            try:
                value = fn(*args[k])
            except Exception as exc:
                value, failed = None, exc
            except BaseException as exc:  # KeyboardInterrupt/SystemExit from the call: the driver re-raises
                with lock:
                    if not self.abandoned:
                        self.interrupt = exc
                self.done.set()
                return
            t1 = perf_counter()
            with lock:
                if self.abandoned:
                    return
                values[k] = value
                durations[k] = t1 - t
                if failed is not None:
                    problems[k] = Outcome(RAISED, failed, t1 - t)
                k += 1
                self.current, self.started = k, t1
            t = t1
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
                            self.durations[k] = perf_counter() - started
                            self.problems[k] = Outcome(TIMED_OUT, timeout, self.durations[k])
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
