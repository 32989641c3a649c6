"""The dynamic batcher: many concurrent single-request calls become a few batch calls.

An async driver (``Executor(..., mode='async')``) calls ``rollout_fn`` with one request at a time,
each as soon as that request is ready. Engines built for batches (the HF backend's
``model.generate``, ms-swift's colocate engine, any ``rollout_fn(requests, config)``) would then
run one request per forward pass. :class:`DynamicBatcher` sits in between: calls that arrive
within ``max_wait_s`` of the first waiting one (or until ``max_batch_size`` requests wait) are
sent to the wrapped function as **one** call, and each caller gets back exactly its own outputs.

* **Coalescing what comes back.** When a batch call returns, its requests come back one after
  another as the driver applies each output (a scheduler step, an environment, a short tool):
  milliseconds apart, not at once. A fixed window from the first arrival cut such a turn into
  calls of 1, 6 and 9 requests on ``vllm.LLM`` (a lone request cost a whole engine call: async
  mode ran 1.2x slower than lockstep). So while requests of the last batch are still expected
  back (tracked by ``uuid``), the next batch waits until they are all back, or until none has
  arrived for ``settle_s`` (the others finished, or are in a long tool call), and never longer
  than ``max_delay_s`` for its oldest request. A request not expected back (a new one, or after
  all came back) waits ``max_wait_s`` as before. These waits count from when the engine became
  free: a request queued behind a running batch waits for that batch's requests too.

* **Callers that come back late** (a gateway's sessions: each next call comes when its agent
  is done, not when the driver applies an output). With ``settle_fraction`` the wait for the last
  batch's requests is capped at that fraction of the last batch call's own duration: a few
  milliseconds for a fast backend, enough for a slow one's agents to answer; and when the recent
  return lags (their median) are longer than that, it does not wait at all (agents that think
  between calls would not be back in time: the calls waiting would only lose it). Without the
  wait, requests that arrived while a batch generated went alone the moment it returned, and
  the batch's own requests, back a millisecond later, waited for that one: concurrent sessions
  settled into fixed groups that never merged (2 and 14 on the HF backend: two generate calls
  per turn where one would do).

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
import itertools
from concurrent.futures import Future, InvalidStateError
import threading
import time
import weakref
from dataclasses import dataclass, field
from collections import deque
from typing import Any, Callable, Dict, List, Optional

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
        max_wait_s: how long the first waiting request waits for company before its batch goes
            (when no request of the last batch is expected back).
        settle_s: while requests of the last batch are expected back, the batch goes once none
            has arrived for this long (the quiet gap; see the module docstring). 50 ms covers a
            driver applying a turn's outputs one by one; ``return_lags_s`` records what a real
            workload needs.
        max_delay_s: the longest any request waits for company, whatever comes back.
        max_concurrent_batches: batch calls in flight at once (dispatcher threads).
        settle_fraction: cap the wait for the last batch's requests at this fraction of that
            batch call's duration (``None``: no cap but ``max_delay_s``).
    """

    def __init__(self, batch_fn: Callable[[List[Any], Any], Any], *, max_batch_size: int = 16,
                 max_wait_s: float = 0.005, settle_s: float = 0.05, max_delay_s: float = 1.0,
                 max_concurrent_batches: int = 1, settle_fraction: Optional[float] = None) -> None:
        if not callable(batch_fn):
            raise TypeError(f'batch_fn must be callable, not {type(batch_fn).__name__}')
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f'max_batch_size must be a positive int, not {max_batch_size!r}')
        if not isinstance(max_wait_s, (int, float)) or max_wait_s < 0:
            raise ValueError(f'max_wait_s must be a number >= 0, not {max_wait_s!r}')
        for label, value in (('settle_s', settle_s), ('max_delay_s', max_delay_s)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f'{label} must be a number >= 0, not {value!r}')
        if not isinstance(max_concurrent_batches, int) or max_concurrent_batches < 1:
            raise ValueError(f'max_concurrent_batches must be a positive int, not {max_concurrent_batches!r}')
        if settle_fraction is not None and (not isinstance(settle_fraction, (int, float)) or settle_fraction < 0):
            raise ValueError(f'settle_fraction must be a number >= 0 or None, not {settle_fraction!r}')
        self.settle_fraction = settle_fraction
        self._last_duration = 0.0  # seconds the last batch call took
        self._typical_lag = 0.0  # the median of the recent return lags, when the last batch went
        self.batch_fn = batch_fn
        self.max_batch_size = max_batch_size
        self.max_wait_s = float(max_wait_s)
        self.settle_s = float(settle_s)
        self.max_delay_s = float(max_delay_s)
        self.max_concurrent_batches = max_concurrent_batches
        #: the number of requests in every batch call made, in order (tests and benchmarks read it)
        self.batch_sizes: List[int] = []
        #: seconds from a batch call's return to each of its requests' next call (the last 10000;
        #: what ``settle_s`` must cover: benchmarks read it)
        self.return_lags_s: 'deque[float]' = deque(maxlen=10000)
        self._expected: Dict[Any, float] = {}  # uuid -> when its batch returned
        self._all_back = False  # every request of the last batch came back: the next batch is due
        self._last_arrival = 0.0
        self._free_since = 0.0  # when the last batch call returned (the engine became free)
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
        fork = getattr(batch_fn, 'fork', None)
        if callable(fork):  # ... and when a request is forked (docs/branching.md)
            self.fork = fork

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
            item = _Item(requests, request_config, fut)
            self._pending.append(item)
            self._last_arrival = item.enqueued
            if self._expected:
                for r in requests:
                    returned = self._expected.pop(_key(r), None)
                    if returned is not None:
                        self.return_lags_s.append(item.enqueued - returned)
                self._all_back = not self._expected
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
            due = self._due_in(oldest, time.perf_counter())
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
            self._expected.clear()  # who is still out is not waited for again
            self._all_back = False
            return batch

    def _due_in(self, oldest: _Item, now: float) -> float:
        """Seconds until the batch of ``oldest`` is due (<= 0: now)."""
        # The waits count from when the engine became free, not from when a request queued: a
        # request that queued behind a running batch has not waited for company yet. Counted from
        # its arrival, it went the moment that batch returned, without the batch's own requests,
        # and two half-size cohorts alternated for the rest of the run (12 vllm.LLM calls of 7-11
        # requests for 16 games x 6 turns instead of 6 of 14-16; docs/benchmarks.md).
        start = max(oldest.enqueued, self._free_since)
        cap = start + self.max_delay_s - now
        if self.settle_fraction is not None and self._expected:
            share = self.settle_fraction * self._last_duration
            # callers that come back later than that (agents that think) are not waited for at all
            cap = min(cap, self._free_since + share - now if self._typical_lag <= share else 0.0)
        if self._all_back:
            return 0.0
        if self._expected:  # the last batch's requests are coming back: wait for a quiet gap
            return min(max(self._last_arrival, self._free_since) + self.settle_s - now, cap)
        return min(oldest.enqueued + self.max_wait_s - now, cap)

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
                began = time.perf_counter()
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
                with self._cond:  # before the callers wake: their next calls are expected
                    done = time.perf_counter()
                    self._last_duration = done - began
                    recent = sorted(itertools.islice(reversed(self.return_lags_s), 64))
                    self._typical_lag = recent[len(recent) // 2] if recent else 0.0
                    self._expected = {k: done for k in map(_key, requests) if k is not None}
                    self._free_since = done
                    self._all_back = False
                k = 0
                for it in batch:
                    _resolve(it.future, result=outputs[k:k + len(it.requests)])
                    k += len(it.requests)
        finally:
            if loop is not None:
                loop.close()

    # ---- lifetime ------------------------------------------------------------------------------
    def close(self, wait: bool = True) -> None:
        """Stop the dispatchers; calls still waiting fail with :class:`BatcherClosed`. A batch call
        already running finishes first (``wait``: joined, 30 s at most per dispatcher; an interrupt
        does not wait for a call that may never return). Safe to call twice."""
        with self._cond:
            self._closed = True
            pending, self._pending = self._pending, []
            self._cond.notify_all()
        for it in pending:
            _resolve(it.future, exc=BatcherClosed('the dynamic batcher was closed before this call ran'))
        for t in self._threads:
            if wait and t is not threading.current_thread():
                t.join(timeout=30)

    def __enter__(self) -> 'DynamicBatcher':
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def describe(self) -> str:
        inner = self.batch_fn.describe() if hasattr(self.batch_fn, 'describe') else type(self.batch_fn).__name__
        return (f'{inner} + dynamic batcher (max_batch_size {self.max_batch_size}, max_wait {self.max_wait_s * 1000:g} ms, '
                f'settle {self.settle_s * 1000:g} ms)')

    def __repr__(self) -> str:
        return f'<DynamicBatcher {self.describe()}>'


def _key(request: Any) -> Any:
    """What identifies a request across its turns (``None``: not tracked)."""
    return getattr(request, 'uuid', None)


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
