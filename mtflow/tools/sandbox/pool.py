"""Sandboxes started ahead of their calls (the ``python`` tool's ``warm_pool``), so a call pays only
for running its program; every pool is closed when the process exits."""
from __future__ import annotations

import atexit
import collections
import threading
import weakref
from typing import Optional

from mtflow.tools.sandbox.process import Sandbox, SandboxSpec

__all__ = ['SandboxPool']


class SandboxPool:
    """Sandboxes started ahead of their calls (``warm_pool: N`` in the tool options), so a call
    pays only for running its program. Each is used for exactly one program and then torn down,
    like any other; a thread keeps ``size`` of them ready. Idle ones hold a leased uid each."""

    def __init__(self, spec: SandboxSpec, size: int) -> None:
        self.spec, self.size = spec, size
        self._ready: 'collections.deque[Sandbox]' = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        _POOLS.add(self)

    def take(self) -> Optional[Sandbox]:
        """A ready sandbox, or None (the caller starts one itself); a refill is started either way."""
        if self._thread is None:
            self.start()
        found = None
        with self._lock:
            while self._ready and found is None:
                candidate = self._ready.popleft()
                if candidate.alive():
                    found = candidate
                else:
                    candidate.discard()
        self._wake.set()
        return found

    def start(self) -> None:
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._refill, name='mtflow-sandbox-pool', daemon=True)
                self._thread.start()

    def ready(self) -> int:
        with self._lock:
            return len(self._ready)

    def _refill(self) -> None:
        while not self._closed:
            with self._lock:
                missing = self.size - len(self._ready)
            for _ in range(max(0, missing)):
                if self._closed:
                    break
                try:
                    sandbox = Sandbox(self.spec)
                except Exception:  # e.g. all uids in use: the calls start their own
                    break
                with self._lock:
                    if self._closed:
                        sandbox.discard()
                        break
                    self._ready.append(sandbox)
            self._wake.wait(1.0)
            self._wake.clear()

    def close(self) -> None:
        """Stop refilling and tear down the idle sandboxes."""
        self._closed = True
        self._wake.set()
        with self._lock:
            idle, self._ready = list(self._ready), collections.deque()
        for sandbox in idle:
            sandbox.discard()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)


_POOLS: 'weakref.WeakSet[SandboxPool]' = weakref.WeakSet()


@atexit.register
def _close_pools() -> None:
    for pool in list(_POOLS):
        pool.close()
