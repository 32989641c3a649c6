"""Worker threads for the user calls a driver runs beside its event loop: a synchronous ``step``
(one at a time) and a synchronous ``rollout_fn`` (one thread per call in flight).

Why not :class:`concurrent.futures.ThreadPoolExecutor`: its workers are not daemon threads, and
the interpreter joins them when it exits. A user's call that never returns (a step blocked on a
socket, a model call that hangs) then holds the process forever after Ctrl-C or SIGTERM stopped
the run, although everything finished is written. :class:`CallThreads` runs the same calls in
daemon threads, so a hung call cannot hold the exit; a call that is merely slow still finishes:
at exit the interpreter waits for the calls still running, at most :data:`EXIT_WAIT_S` seconds
in all (a daemon thread killed while inside native code, torch's, can abort the process).
``mtflow run`` does not wait at all after a stop by signal (``mtflow/run/signals.py``).
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import queue
import threading
import time
import weakref
from typing import Any, Callable, List, Optional, Tuple

__all__ = ['CallThreads', 'EXIT_WAIT_S']

#: how long the interpreter's exit waits for the calls still running in every pool, in all
EXIT_WAIT_S = 30.0

_LIVE: 'weakref.WeakSet[CallThreads]' = weakref.WeakSet()

_Work = Optional[Tuple[cf.Future, Callable[..., Any], tuple]]


@atexit.register
def _wait_at_exit() -> None:
    """Let the calls still running finish (at most :data:`EXIT_WAIT_S` in all): ``atexit``
    handlers run while daemon threads still live."""
    deadline = time.monotonic() + EXIT_WAIT_S
    for pool in list(_LIVE):
        for thread in pool.threads():
            thread.join(max(0.0, deadline - time.monotonic()))


class CallThreads:
    """Up to ``max_workers`` daemon threads named ``<name>_<k>``, started as calls arrive and
    kept until :meth:`shutdown`. :meth:`submit` returns a :class:`concurrent.futures.Future`
    (``asyncio.wrap_future`` awaits it); whatever the call raises, ``KeyboardInterrupt`` and
    ``SystemExit`` included, is its future's exception, as in a ``ThreadPoolExecutor``."""

    def __init__(self, max_workers: int, name: str) -> None:
        if max_workers < 1:
            raise ValueError(f'max_workers must be >= 1, not {max_workers!r}')
        self.max_workers = max_workers
        self.name = name
        self._work: 'queue.SimpleQueue[_Work]' = queue.SimpleQueue()
        self._threads: List[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._closed = False
        _LIVE.add(self)

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future:
        future: cf.Future = cf.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f'{self.name}: cannot take a call after shutdown')
            self._work.put((future, fn, args))
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < self.max_workers:
                thread = threading.Thread(target=self._serve, name=f'{self.name}_{len(self._threads)}', daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def _serve(self) -> None:
        while True:
            work = self._work.get()
            if work is None:
                return
            future, fn, args = work
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - the call's outcome, an interrupt included
                    future.set_exception(exc)
                del future, fn, args, work  # nothing of the call is held while the thread waits
            with self._lock:
                self._idle += 1

    def threads(self) -> List[threading.Thread]:
        """The workers still alive."""
        return [t for t in self._threads if t.is_alive()]

    def shutdown(self, wait: bool = True) -> None:
        """Take no more calls; calls not started are cancelled. ``wait``: join the workers (the
        calls running finish first); else leave them (daemons: a hung call holds nothing)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        while True:
            try:
                work = self._work.get_nowait()
            except queue.Empty:
                break
            if work is not None:
                work[0].cancel()
        for _ in threads:
            self._work.put(None)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()
