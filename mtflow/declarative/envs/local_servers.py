"""What the bridges to server environments share (OpenEnv, NeMo Gym): a server process started
on a free port of 127.0.0.1 and waited for on its health route, stopped with its whole process
group; and the event loop, in a thread of its own, where the bridge's connections live.

The connections cannot live on the executor's loop: it is idle while the model generates
(minutes with a slow model), so a WebSocket could not answer its server's keepalive pings, and a
driver may run each turn on a new loop, which an HTTP session bound to the first one cannot
follow.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any, Callable, List, Optional, Type

__all__ = ['free_port', 'LocalServer', 'launch_local', 'wait_healthy', 'IOLoop', 'child_env']


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class LocalServer:
    """A server's URL and, when this process started it, its process and log."""

    def __init__(self, url: str, process: Optional[subprocess.Popen] = None, log_path: Optional[str] = None) -> None:
        self.url = url.rstrip('/')
        self.process = process
        self.log_path = log_path

    @property
    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def log_tail(self, chars: int = 600) -> str:
        if not self.log_path:
            return ''
        try:
            with open(self.log_path, encoding='utf-8', errors='replace') as f:
                return ' '.join(f.read()[-chars:].split())
        except OSError:
            return ''

    def stop(self, grace_s: float = 5.0) -> None:
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            proc.wait(timeout=grace_s)


def child_env(base_dir: Optional[str], same_python: bool = True) -> dict:
    """The environment of a launched server: this process's, with ``base_dir`` ahead on
    ``PYTHONPATH`` (the server imports what the config's directory holds) and, when the server
    runs in this same Python, ``sys.path`` after it; another Python (another version's standard
    library) gets ``base_dir`` alone."""
    env = dict(os.environ)
    paths = ([base_dir] if base_dir else [])
    if same_python:
        paths += [p for p in sys.path if p] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else [])
    if paths:
        env['PYTHONPATH'] = os.pathsep.join(paths)
    else:
        env.pop('PYTHONPATH', None)
    return env


def launch_local(command: Callable[[int], List[str]], env: dict, cwd: Optional[str], prefix: str,
                 make: Type[LocalServer] = LocalServer) -> LocalServer:
    """Start ``command(port)`` on a free port in a process group of its own, its output to a log."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix=prefix, suffix='.log', delete=False)
    try:
        proc = subprocess.Popen(command(port), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, cwd=cwd or None)
    finally:
        log.close()
    return make(f'http://127.0.0.1:{port}', proc, log.name)


def wait_healthy(server: LocalServer, timeout_s: float, what: str, error: Type[Exception]) -> None:
    """Wait until ``server`` answers ``GET /health`` with 200; ``error`` (with the end of its log)
    when its process exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if server.exited:
            raise error(f'{what} exited with status {server.process.returncode} before answering: {server.log_tail()}')
        try:
            with urllib.request.urlopen(f'{server.url}/health', timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise error(f'{what} did not answer {server.url}/health within {timeout_s:g} s: {server.log_tail()}')
        time.sleep(0.1)


class IOLoop:
    """An event loop in a daemon thread, started at first use; :meth:`run` awaits a coroutine on it
    from any other loop."""

    def __init__(self, name: str, closed_error: Callable[[], Exception]) -> None:
        self.name = name
        self.closed_error = closed_error
        self._lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise self.closed_error()
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name=self.name, daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    async def run(self, coro: Any) -> Any:
        try:
            loop = self.loop()
        except BaseException:
            coro.close()
            raise
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    def call_soon(self, fn: Any) -> None:
        """Run ``fn`` on the loop (it owns the connections), or now when there is none."""
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(fn)
        else:
            fn()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            if not thread.is_alive():
                loop.close()
