"""A private event loop in a daemon thread, for backends whose client is bound to one loop.

An HTTP client (httpx) or an async engine (vLLM's ``AsyncLLM``) belongs to the loop it was
created on. The executor's drivers each run their own short-lived loop, and trainers and
notebooks have theirs, so such a backend keeps one loop of its own for its whole life:
synchronous callers block on :meth:`LoopThread.run`, async callers (any loop) await
:meth:`LoopThread.wrap`, and both reach the same client.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable

__all__ = ['LoopThread']


class LoopThread:
    """A private event loop in a daemon thread: callers submit coroutines and wait."""

    def __init__(self, name: str = 'mtflow-backend') -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        """Run ``coro`` on the private loop; block until it is done (never from that loop)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def wrap(self, coro: Any) -> Awaitable[Any]:
        """Schedule ``coro`` on the private loop; an awaitable for the caller's loop. Cancelling
        the caller's await cancels the coroutine on the private loop too."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
        if not self.loop.is_running():
            self.loop.close()
