"""The dynamic batcher: many concurrent single-request calls become a few batch calls.

An async driver (``Executor(..., mode='async')``) calls ``rollout_fn`` with one request at a time,
each as soon as that request is ready. Engines built for batches (the HF backend's
``model.generate``, ms-swift's colocate engine, any ``rollout_fn(requests, config)``) would then
run one request per forward pass. :class:`DynamicBatcher` sits in between: calls that arrive
within ``max_wait_s`` of the first waiting one (or until ``max_batch_size`` requests wait) are
sent to the wrapped function as **one** call, and each caller gets back exactly its own outputs.

* While a batch call runs, new requests keep queueing; the next batch starts as soon as a
  dispatcher is free and holds everything that waited (up to ``max_batch_size``). With
  ``max_concurrent_batches=1`` (default) the engine never sees two calls at once, which is what
  a single model on one device wants.
* Only requests with the same request config share a batch call (the wrapped function takes one
  config per call); configs are compared by identity, then by value.
* A batch call that raises, or returns the wrong number of outputs, fails exactly the callers
  in that batch, with the same exception; the others are unaffected.

The batcher is loop-agnostic: its state lives behind a lock and dispatcher threads, callers wait
on :class:`concurrent.futures.Future` objects. ``await batcher(requests, config)`` works from any
event loop (the executor's, a server's); :meth:`DynamicBatcher.call` blocks (thread pools,
synchronous callers).
"""
from __future__ import annotations

import asyncio
import atexit
from concurrent.futures import Future, InvalidStateError
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

__all__ = ['DynamicBatcher', 'BatcherClosed']

#: batchers with dispatcher threads, closed at interpreter exit (see :func:`_close_at_exit`)
_LIVE: 'weakref.WeakSet[DynamicBatcher]' = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Close every batcher still open when the interpreter exits, joining its dispatchers.

    They are daemon threads (an idle one must not keep the process alive), and a daemon thread
    still inside the engine when the interpreter finalizes is killed mid-call: with a C++
    runtime on the stack (torch) that aborts the process (``FATAL: exception not rethrown``).
    A partial rollout leaves such a call behind (its caller was cancelled, the batch runs on);
    ``atexit`` handlers run while daemon threads still live, so the call finishes here first."""
    for batcher in list(_LIVE):
        batcher.close()


class BatcherClosed(RuntimeError):
    """The batcher was closed while a call was waiting (or a call came after :meth:`close`)."""


@dataclass
class _Item:
    """One caller's requests, waiting for their batch."""
    requests: List[Any]
    config: Any
    future: Future
    enqueued: float = field(default_factory=time.perf_counter)


class DynamicBatcher:
    """Groups concurrent calls of ``batch_fn(requests, request_config) -> outputs``.

    Args:
        batch_fn: the batch ``rollout_fn`` to wrap (a backend, an ms-swift engine's ``infer``
            adapter, any callable; if it returns an awaitable, it is run to completion on the
            dispatcher thread's own loop).
        max_batch_size: the most requests in one batch call (a caller's list is never split, so a
            single call with more requests is sent alone).
        max_wait_s: how long the first waiting request waits for company before its batch goes.
        max_concurrent_batches: batch calls in flight at once (dispatcher threads).
    """

    def __init__(self, batch_fn: Callable[[List[Any], Any], Any], *, max_batch_size: int = 16,
                 max_wait_s: float = 0.005, max_concurrent_batches: int = 1) -> None:
        if not callable(batch_fn):
            raise TypeError(f'batch_fn must be callable, not {type(batch_fn).__name__}')
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f'max_batch_size must be a positive int, not {max_batch_size!r}')
        if not isinstance(max_wait_s, (int, float)) or max_wait_s < 0:
            raise ValueError(f'max_wait_s must be a number >= 0, not {max_wait_s!r}')
        if not isinstance(max_concurrent_batches, int) or max_concurrent_batches < 1:
            raise ValueError(f'max_concurrent_batches must be a positive int, not {max_concurrent_batches!r}')
        self.batch_fn = batch_fn
        self.max_batch_size = max_batch_size
        self.max_wait_s = float(max_wait_s)
        self.max_concurrent_batches = max_concurrent_batches
        #: the number of requests in every batch call made, in order (tests and benchmarks read it)
        self.batch_sizes: List[int] = []
        self._pending: List[_Item] = []
        self._cond = threading.Condition()
        self._threads: List[threading.Thread] = []
        self._closed = False
        # passthrough for code that reads a backend's attributes through the rollout_fn
        self.tokenizer = getattr(batch_fn, 'tokenizer', None)
        self.stats = getattr(batch_fn, 'stats', None)
        forget = getattr(batch_fn, 'forget', None)
        if callable(forget):  # a backend that keeps per-request state is told when a request is final
            self.forget = forget

    # ---- calling -------------------------------------------------------------------------------
    def submit(self, requests: List[Any], request_config: Any = None) -> Future:
        """Queue ``requests``; the future resolves to their outputs (same order)."""
        fut: Future = Future()
        requests = list(requests)
        if not requests:
            fut.set_result([])
            return fut
        with self._cond:
            if self._closed:
                raise BatcherClosed('the dynamic batcher is closed')
            self._pending.append(_Item(requests, request_config, fut))
            self._start_threads()
            self._cond.notify_all()
        return fut

    def call(self, requests: List[Any], request_config: Any = None) -> List[Any]:
        """Blocking call (from any thread but a dispatcher's)."""
        return self.submit(requests, request_config).result()

    async def __call__(self, requests: List[Any], request_config: Any = None) -> List[Any]:
        """``await batcher(requests, config)``: the async ``rollout_fn``."""
        return await asyncio.wrap_future(self.submit(requests, request_config))

    # ---- dispatching ---------------------------------------------------------------------------
    def _start_threads(self) -> None:
        _LIVE.add(self)
        while len(self._threads) < self.max_concurrent_batches:
            t = threading.Thread(target=self._dispatch_loop, name=f'mtflow-batcher-{len(self._threads)}', daemon=True)
            self._threads.append(t)
            t.start()

    def _take_batch(self) -> Optional[List[_Item]]:
        """Wait (under the lock) until a batch is due; remove and return it. ``None``: closed."""
        while True:
            if self._closed:
                return None
            if not self._pending:
                self._cond.wait()
                continue
            self._pending = [it for it in self._pending if not it.future.cancelled()]
            if not self._pending:
                continue
            oldest = self._pending[0]
            same = [it for it in self._pending if _same_config(it.config, oldest.config)]
            size = sum(len(it.requests) for it in same)
            due = oldest.enqueued + self.max_wait_s - time.perf_counter()
            if size < self.max_batch_size and due > 0:
                self._cond.wait(timeout=due)
                continue
            batch: List[_Item] = []
            total = 0
            for it in same:
                if batch and total + len(it.requests) > self.max_batch_size:
                    break
                batch.append(it)
                total += len(it.requests)
            taken = set(map(id, batch))
            self._pending = [it for it in self._pending if id(it) not in taken]
            return batch

    def _dispatch_loop(self) -> None:
        loop: Optional[asyncio.AbstractEventLoop] = None
        try:
            while True:
                with self._cond:
                    batch = self._take_batch()
                if batch is None:
                    return
                requests = [r for it in batch for r in it.requests]
                self.batch_sizes.append(len(requests))
                try:
                    outputs = self.batch_fn(requests, batch[0].config)
                    if asyncio.iscoroutine(outputs) or isinstance(outputs, asyncio.Future) or hasattr(
                            outputs, '__await__'):
                        loop = loop or asyncio.new_event_loop()
                        outputs = loop.run_until_complete(_await(outputs))
                    outputs = list(outputs)
                    if len(outputs) != len(requests):
                        raise RuntimeError(f'the batch rollout_fn returned {len(outputs)} output(s) for '
                                           f'{len(requests)} request(s)')
                except BaseException as exc:  # noqa: BLE001 - every caller of this batch gets it
                    for it in batch:
                        _resolve(it.future, exc=exc)
                    if not isinstance(exc, Exception):
                        raise
                    continue
                k = 0
                for it in batch:
                    _resolve(it.future, result=outputs[k:k + len(it.requests)])
                    k += len(it.requests)
        finally:
            if loop is not None:
                loop.close()

    # ---- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the dispatchers; calls still waiting fail with :class:`BatcherClosed`. A batch call
        already running finishes first. Safe to call twice."""
        with self._cond:
            self._closed = True
            pending, self._pending = self._pending, []
            self._cond.notify_all()
        for it in pending:
            _resolve(it.future, exc=BatcherClosed('the dynamic batcher was closed before this call ran'))
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=30)

    def __enter__(self) -> 'DynamicBatcher':
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def describe(self) -> str:
        inner = self.batch_fn.describe() if hasattr(self.batch_fn, 'describe') else type(self.batch_fn).__name__
        return f'{inner} + dynamic batcher (max_batch_size {self.max_batch_size}, max_wait {self.max_wait_s * 1000:g} ms)'

    def __repr__(self) -> str:
        return f'<DynamicBatcher {self.describe()}>'


def _same_config(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # pragma: no cover - exotic configs that cannot compare
        return False


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _resolve(fut: Future, result: Any = None, exc: Optional[BaseException] = None) -> None:
    if fut.done():  # cancelled by its caller
        return
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:  # pragma: no cover - cancelled in between
        pass
