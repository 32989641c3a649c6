"""Helpers for the sandbox tests: which isolations work here, and checks made on the host (not on
the tool's reply): processes left behind, files, connections."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import subprocess
import sys
from typing import Iterator, List, Optional, Tuple

import pytest

from mtflow.tools import isolation
from mtflow.tools.sandbox import run_python

KINDS = ('bwrap', 'unshare')

#: the checkout (an unprivileged uid imports mtflow from it)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


class HostSampler:
    """Something read on the host every ``every_s`` on a thread of its own while a ``with`` block
    runs (a call), and once more at its end: subclasses say what in :meth:`sample`."""

    every_s = 0.01

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def __enter__(self):
        import threading
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


class HostMemory(HostSampler):
    """Samples the host's ``/proc/meminfo`` (``Shmem``, ``Slab``, ``SUnreclaim``, ``MemAvailable``)
    every few ms while a call runs: :meth:`growth` is the peak rise of each over the figure before
    (for ``MemAvailable``, the deepest fall), in MB. The machine is shared, so tests compare it with
    a bound far below what the attack would hold unbounded, not with zero."""

    FIELDS = ('Shmem', 'Slab', 'SUnreclaim', 'MemAvailable')

    def __init__(self, every_s: float = 0.01) -> None:
        self.every_s = every_s
        self.before = self.read()
        self.peak = dict(self.before)

    @classmethod
    def read(cls) -> dict:
        out = {}
        with open('/proc/meminfo', encoding='ascii') as f:
            for line in f:
                name, _, rest = line.partition(':')
                if name in cls.FIELDS:
                    out[name] = int(rest.split()[0]) / 1024  # kB -> MB
        return out

    def sample(self) -> None:
        now = self.read()
        for name, value in now.items():
            pick = min if name == 'MemAvailable' else max
            self.peak[name] = pick(self.peak[name], value)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.after = self.read()

    def growth(self) -> dict:
        return {name: round(abs(self.peak[name] - self.before[name]), 1) for name in self.FIELDS}


def as_uid(uid: int) -> List[str]:
    """The command prefix that runs the rest as ``uid`` (its own group, no others)."""
    return ['setpriv', f'--reuid={uid}', f'--regid={uid}', '--clear-groups', '--']


def interpreter_for(uid: int, env: dict) -> Optional[str]:
    """An interpreter of this Python version that ``uid`` can run with mtflow importable, or None."""
    for exe in (os.path.realpath(getattr(sys, '_base_executable', sys.executable)),
                shutil.which(f'python{sys.version_info[0]}.{sys.version_info[1]}', path='/usr/bin:/bin')):
        if not exe:
            continue
        check = subprocess.run(as_uid(uid) + [exe, '-c',
                                              'import os, sys, mtflow.tools.sandbox\n'
                                              'for d in (os.path.dirname(os.path.realpath(sys.executable)), '
                                              'sys.base_prefix):\n'
                                              '    os.listdir(d)'], env=env, capture_output=True, timeout=60, cwd='/')
        if check.returncode == 0:
            return exe
    return None


@contextlib.contextmanager
def unprivileged_uid() -> Iterator[Tuple[int, str, dict]]:
    """``(uid, interpreter, env)`` for running mtflow as a normal user: a uid leased for the block
    (so nothing else runs as it; released after), an interpreter it can run mtflow with, and the
    environment to run it in. Skips the test where that is impossible (not root, no setpriv or
    bwrap, no interpreter and checkout that uid can read)."""
    if os.geteuid() != 0 or not shutil.which('setpriv') or not shutil.which('bwrap'):
        pytest.skip('needs root (to become an unprivileged uid), setpriv and bwrap')
    lease = isolation.UidLease()
    try:
        site = [p for p in sys.path if p.endswith('site-packages')]
        env = {'PATH': '/usr/bin:/bin', 'HOME': '/', 'PYTHONPATH': os.pathsep.join([ROOT] + site)}
        exe = interpreter_for(lease.uid, env)
        if exe is None:
            pytest.skip('no interpreter and mtflow checkout that an unprivileged uid can read here')
        yield lease.uid, exe, env
    finally:
        lease.release()
