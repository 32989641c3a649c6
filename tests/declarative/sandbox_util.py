"""Helpers for the sandbox tests: which isolations work here, and checks made on the host (not on
the tool's reply): processes left behind, files, connections."""
from __future__ import annotations

import asyncio
import functools
import os
from typing import List

import pytest

from mtflow.tools import isolation
from mtflow.tools.sandbox import run_python

KINDS = ('bwrap', 'unshare')

#: 40 forks, each child alive for the whole loop: under ``max_processes=8`` it prints ``7 33`` (7
#: children + the program itself), which shows the process limit binds in that sandbox
BOUNDED_FORKS = '''
import os, time
kids, failed = [], 0
for _ in range(40):
    try:
        pid = os.fork()
    except OSError:
        failed += 1
        continue
    if pid == 0:
        time.sleep(60)  # alive for the whole loop, however slow the machine; killed with the namespace
        os._exit(0)
    kids.append(pid)
print(len(kids), failed)
'''


@functools.lru_cache(maxsize=None)
def why_unavailable(kind: str):
    return isolation.probe(kind)


def require(kind: str) -> None:
    """Skip (saying why) when ``kind`` cannot isolate on this machine; scripts/test.sh installs
    bubblewrap, and the refusal tests cover machines where neither works."""
    why = why_unavailable(kind)
    if why is not None:
        pytest.skip(f'{kind} cannot isolate here: {why}')


def run(code: str, kind: str, **kw):
    """One call; a generous wall-clock limit unless the test sets one (a loaded 2-core CI machine)."""
    require(kind)
    kw.setdefault('timeout_s', 30)
    return asyncio.run(run_python(code, isolation=kind, **kw))


def processes_with(marker: str) -> List[int]:
    """Host pids whose command line contains ``marker``."""
    found = []
    needle = marker.encode()
    for name in os.listdir('/proc'):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f'/proc/{name}/cmdline', 'rb') as f:
                if needle in f.read():
                    found.append(int(name))
        except OSError:
            pass
    return found


def assert_nothing_survives(result, marker: str = '') -> None:
    """No process runs as the call's uid, and none carries ``marker``, right after the call."""
    assert result.uid is not None
    assert isolation.processes_of_uid(result.uid) == [], 'a sandbox process outlived its call'
    if marker:
        assert processes_with(marker) == [], f'a process with {marker!r} outlived its call'
