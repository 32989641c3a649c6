"""A private event loop in a daemon thread, for backends whose client is bound to one loop.

An HTTP client (httpx) or an async engine (vLLM's ``AsyncLLM``) belongs to the loop it was
created on. The executor's drivers each run their own short-lived loop, and trainers and
notebooks have theirs, so such a backend keeps one loop of its own for its whole life:
synchronous callers block on :meth:`LoopThread.run`, async callers (any loop) await
:meth:`LoopThread.wrap`, and both reach the same client.

**Why not ``run_coroutine_threadsafe`` + ``wrap_future`` for async callers.** Each call would
cross between the loops twice, each crossing a ``call_soon_threadsafe`` that writes to the other
loop's self-pipe, plus the chained futures' callbacks on both sides. At thousands of model calls
a second that was about a quarter of the client's CPU (a py-spy profile of
``benchmarks/serving.py``), and in a burst of replies each freed server slot waited for it. So
:meth:`wrap` posts calls into an inbox and results into one outbox per caller loop, and wakes a
loop only when its box was empty: a burst of 1,000 replies is one wake-up, not 1,000.
"""
from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from typing import Any, Awaitable, Deque, Optional

__all__ = ['LoopThread']


class _Call:
    """One :meth:`LoopThread.wrap`: the coroutine, its task on the private loop, and the future
    its caller awaits on its own loop."""
    __slots__ = ('coro', 'caller', 'done', 'task', 'cancelled')

    def __init__(self, coro: Any, caller: asyncio.AbstractEventLoop, done: 'asyncio.Future[Any]') -> None:
        self.coro = coro
        self.caller = caller
        self.done = done
        self.task: Optional['asyncio.Task[Any]'] = None
        self.cancelled = False


class LoopThread:
    """A private event loop in a daemon thread: callers submit coroutines and wait."""

    def __init__(self, name: str = 'mtflow-backend') -> None:
        self.loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._inbox: Deque[_Call] = deque()
        self._outboxes: 'weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Deque[_Call]]' = \
            weakref.WeakKeyDictionary()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        """Run ``coro`` on the private loop; block until it is done (never from that loop)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def wrap(self, coro: Any) -> Awaitable[Any]:
        """Schedule ``coro`` on the private loop; an awaitable for the caller's loop. Cancelling
        the caller's await cancels the coroutine on the private loop too."""
        return self._bridge(coro)

    async def _bridge(self, coro: Any) -> Any:
        caller = asyncio.get_running_loop()
        call = _Call(coro, caller, caller.create_future())
        with self._lock:
            self._inbox.append(call)
            wake = len(self._inbox) == 1
        if wake:
            self.loop.call_soon_threadsafe(self._start_posted)
        try:
            return await call.done
        except asyncio.CancelledError:
            self.loop.call_soon_threadsafe(self._cancel, call)
            raise

    # ---- on the private loop ----------------------------------------------------------------------
    def _start_posted(self) -> None:
        with self._lock:
            calls = list(self._inbox)
            self._inbox.clear()
        for call in calls:
            if call.cancelled:
                call.coro.close()
                continue
            call.task = self.loop.create_task(call.coro)
            call.task.add_done_callback(lambda _task, call=call: self._post_result(call))

    def _cancel(self, call: _Call) -> None:
        call.cancelled = True
        if call.task is not None:
            call.task.cancel()

    def _post_result(self, call: _Call) -> None:
        caller = call.caller
        with self._lock:
            box = self._outboxes.get(caller)
            if box is None:
                box = self._outboxes[caller] = deque()
            box.append(call)
            wake = len(box) == 1
        if wake:
            try:
                caller.call_soon_threadsafe(self._deliver, box)
            except RuntimeError:  # the caller's loop is closed: nobody waits for these results
                with self._lock:
                    box.clear()

    # ---- on the caller's loop ---------------------------------------------------------------------
    def _deliver(self, box: Deque[_Call]) -> None:
        with self._lock:
            calls = list(box)
            box.clear()
        for call in calls:
            task = call.task
            if call.done.done() or task is None:  # the caller gave up on it
                if task is not None and not task.cancelled():
                    task.exception()  # retrieved: no "never retrieved" warning for an abandoned call
                continue
            if task.cancelled():
                call.done.cancel()
            elif task.exception() is not None:
                call.done.set_exception(task.exception())  # type: ignore[arg-type]
            else:
                call.done.set_result(task.result())

    def stop(self) -> None:
        """Cancel what still runs on the private loop and wait for it briefly (so no task is
        destroyed pending), then stop and close the loop."""
        if self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self.loop).result(timeout=5)
            except Exception:  # noqa: BLE001 - best effort: the loop is going away either way
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
        if not self.loop.is_running():
            self.loop.close()


async def _cancel_the_rest() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=2)
