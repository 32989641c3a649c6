"""Clean stops for long runs: SIGINT and SIGTERM become one ``KeyboardInterrupt``; a second signal
exits at once.

``mtflow run`` installs :class:`StopSignals` around its rollout. The first SIGINT or SIGTERM
raises :class:`StopRequested` (a ``KeyboardInterrupt``, so the executor finishes the requests in
flight as ``interrupted`` exactly as for Ctrl-C) and remembers which signal it was, so the command
can exit with 130 (SIGINT) or 143 (SIGTERM). A second signal, while the run is still stopping,
calls ``os._exit`` right away: whatever was already written stays whole (``mtflow/run/store.py``
drops a torn last line on ``--resume``).

Code that must not be cut in half by the first signal (the run store writing a group of lines)
runs inside :func:`deferred_interrupts`: a signal that arrives there is raised when the block
ends. Plain data, no threads: handlers only ever run in the main thread.

A user's call that never returns (a step, a tool, a model call) cannot be stopped inside its
thread. Once a stopped command has written everything, :func:`leave_if_calls_hang` ends the
process at once when such a call is still running, instead of letting the interpreter's exit wait
for it (or kill it inside native code).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

__all__ = ['StopRequested', 'StopSignals', 'deferred_interrupts', 'exit_code_for', 'leave_if_calls_hang',
           'CALL_THREADS']

#: the names (prefixes) of the threads mtflow runs user calls in: sync steps, sync ``rollout_fn``
#: calls, YAML tools, a dynamic batcher's batch calls
CALL_THREADS = ('mtflow-step', 'mtflow-rollout', 'mtflow-tool-', 'mtflow-batcher-')

_STATE: Dict[str, Any] = {'depth': 0, 'pending': None}


class StopRequested(KeyboardInterrupt):
    """The first SIGINT/SIGTERM of a run; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_code_for(signum: int) -> int:
    """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold back a :class:`StopSignals` interrupt until the block ends (main thread only; other
    threads never receive Python signal handlers, so there is nothing to hold back there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STATE['depth'] += 1
    try:
        yield
    finally:
        _STATE['depth'] -= 1
        pending = _STATE['pending']
        if _STATE['depth'] == 0 and pending is not None:
            _STATE['pending'] = None
            raise StopRequested(pending)


class StopSignals:
    """Context manager: SIGINT/SIGTERM stop the run cleanly once, then at once.

    ``signum`` is the first signal received (``None`` if none); the previous handlers come back
    on exit. Outside the main thread (where Python cannot install handlers) it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, message: Optional[str] = 'mtflow: stopping: finishing the requests in flight as interrupted '
                 '(again to exit at once)') -> None:
        self.message = message
        self.signum: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # the second signal: no more cleanup
            try:
                sys.stderr.write(f'mtflow: {signal.Signals(signum).name} again: exiting now\n')
                sys.stderr.flush()
            finally:
                os._exit(exit_code_for(self.signum))
        self.signum = signum
        if self.message:
            try:
                sys.stderr.write(f'\n{self.message}\n')
                sys.stderr.flush()
            except Exception:  # pragma: no cover - a closed stderr must not stop the stop
                pass
        if _STATE['depth'] > 0:
            _STATE['pending'] = signum
            return
        raise StopRequested(signum)

    def __enter__(self) -> 'StopSignals':
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        _STATE['pending'] = None


def leave_if_calls_hang(code: int) -> None:
    """After a stop by signal (``code`` 130 or 143), everything written and closed: if a user's
    call is still running in one of mtflow's threads (:data:`CALL_THREADS`), say so and end the
    process now with ``code`` (``os._exit``, the output flushed first). Otherwise return."""
    if code not in (exit_code_for(signal.SIGINT), exit_code_for(signal.SIGTERM)):
        return
    running = sorted({t.name for t in threading.enumerate() if t.is_alive() and t.name.startswith(CALL_THREADS)})
    if not running:
        return
    try:
        sys.stderr.write(f'mtflow: leaving {len(running)} call(s) that did not return ({", ".join(running[:4])}): '
                         'a thread cannot be stopped\n')
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
