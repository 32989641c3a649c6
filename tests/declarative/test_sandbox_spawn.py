"""Sandboxes start on the spawner threads, off the event loop (concurrent calls start side by side),
and a call cancelled while its sandbox is starting leaves nothing behind."""
from __future__ import annotations

import asyncio
import os
import threading
import uuid

import pytest

from mtflow.tools import seccomp
from mtflow.tools.sandbox import process, run_python

from .sandbox_util import KINDS, processes_with, require

kinds = pytest.mark.parametrize('kind', KINDS)


@kinds
def test_concurrent_calls_start_their_sandboxes_on_the_spawner_threads(kind, monkeypatch):
    require(kind)
    started_on = []
    real_init = process.Sandbox.__init__

    def init(self, *a, **k):
        started_on.append(threading.current_thread().name)
        real_init(self, *a, **k)

    monkeypatch.setattr(process.Sandbox, '__init__', init)
    n = 3 * seccomp.SPAWNERS  # more starts than spawner threads: nested keyring joins must not deadlock

    async def calls():
        loop_thread = threading.current_thread().name
        results = await asyncio.gather(*[run_python(f'print({i})', isolation=kind, timeout_s=60) for i in range(n)])
        return loop_thread, results

    loop_thread, results = asyncio.run(asyncio.wait_for(calls(), 240))
    assert [r.output for r in results] == [f'{i}\n' for i in range(n)]
    assert len(started_on) == n and loop_thread not in started_on
    assert all(name.startswith('mtflow-sandbox-spawn') for name in started_on), started_on


@kinds
def test_a_call_cancelled_while_its_sandbox_starts_leaves_nothing(kind):
    require(kind)
    for delay in (0.0, 0.001, 0.005, 0.02, 0.05):
        marker = 'mtflow-' + uuid.uuid4().hex
        code = f'import time\n# {marker}\ntime.sleep(120)'

        async def call():
            await run_python(f'import subprocess, sys\nsubprocess.Popen([sys.executable, "-c", {code!r}])\n'
                             'import time\ntime.sleep(120)', isolation=kind, timeout_s=120)

        async def cancelled():
            task = asyncio.ensure_future(call())
            await asyncio.sleep(delay)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        before = set(_children())  # (warm pools of earlier tests in this process keep theirs)
        asyncio.run(cancelled())
        assert processes_with(marker) == [], f'a process of a call cancelled after {delay} s outlived it'
        left = set(_children()) - before
        assert not left, f'the sandbox of a call cancelled after {delay} s is still running: {left}'


def _children() -> list:
    """This process's children, whichever of its threads started them (the spawners did)."""
    found = []
    for tid in os.listdir('/proc/self/task'):
        try:
            with open(f'/proc/self/task/{tid}/children', encoding='ascii') as f:
                found += f.read().split()
        except OSError:
            pass
    return found
