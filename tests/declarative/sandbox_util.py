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
from typing import Dict, Iterator, List, Optional, Tuple

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


def pid_namespace_of(pid: int) -> Optional[int]:
    """The inode of ``pid``'s PID namespace, or None (gone, or another user's process)."""
    try:
        link = os.readlink(f'/proc/{pid}/ns/pid')
    except OSError:
        return None
    return int(link[5:-1]) if link.startswith('pid:[') and link.endswith(']') else None


def processes_in_pid_namespace(ns: int, uid: int) -> List[int]:
    """Host pids of the processes running as ``uid`` (real uid, host view) in the PID namespace
    with inode ``ns``. The uid keeps a namespace of another user that reuses the inode number
    (the kernel hands out the lowest free one) from counting."""
    return [pid for pid in isolation.processes_of_uid(uid) if pid_namespace_of(pid) == ns]


def sandbox_uid(result) -> int:
    """The uid a call's processes ran as, host view: the leased one as root, rootless this user
    (the program is ``nobody`` only inside its user namespace)."""
    if result.uid is not None:
        return result.uid
    assert isolation.rootless(), 'an isolated call as root ran without a leased uid'
    return os.getuid()


def assert_nothing_survives(result, marker: str = '') -> None:
    """Right after the call: no process is left in its PID namespace (the launcher reports it
    before the program runs; everything the call started runs in it, as :func:`sandbox_uid`),
    none runs as its leased uid (as root), and none carries ``marker``. Checked on the host, as
    root and as a normal user alike."""
    assert result.pid_namespace is not None, 'the sandbox did not report its PID namespace'
    uid = sandbox_uid(result)
    assert processes_in_pid_namespace(result.pid_namespace, uid) == [], 'a sandbox process outlived its call'
    if result.uid is not None:
        assert isolation.processes_of_uid(result.uid) == [], 'a process of the leased uid outlived its call'
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


#: as a normal user, a script of :func:`unprivileged_uid` runs as this user under this wrapper: a
#: child subreaper, so that whatever the script started and left running is reparented here once
#: it exits. It waits for those to go (a namespace being torn down), and when any is still there
#: after 10 s it kills them and exits with status 3, naming them on stderr: the check, done as
#: this user, that ``processes_of_uid`` of a leased uid makes as root.
SUBREAPER = r'''
import ctypes, os, subprocess, sys, time
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    sys.exit("mtflow test wrapper: prctl(PR_SET_CHILD_SUBREAPER) failed")
rc = subprocess.call(sys.argv[1:])
def left():
    found = []
    for task in os.listdir("/proc/self/task"):
        with open("/proc/self/task/%s/children" % task) as f:
            found += f.read().split()
    return found
deadline = time.monotonic() + 10
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
    pids = left()
    if not pids or time.monotonic() > deadline:
        break
    time.sleep(0.05)
if pids:
    for pid in pids:
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                sys.stderr.write("left running: %s %r\n" % (pid, f.read()[:200]))
            os.kill(int(pid), 9)
        except OSError:
            pass
    sys.exit(3)
sys.exit(rc)
'''


def as_uid(uid: int) -> List[str]:
    """The command prefix that runs the rest as ``uid`` (its own group, no others); for this very
    user (not root: :func:`unprivileged_uid`), under :data:`SUBREAPER` instead."""
    if uid == os.geteuid() and uid != 0:
        return [sys.executable, '-c', SUBREAPER]
    return ['setpriv', f'--reuid={uid}', f'--regid={uid}', '--clear-groups', '--']


def assert_nothing_left_as(uid: int) -> None:
    """After a script run with :func:`as_uid` exited: no process runs as ``uid`` (a leased uid, as
    root). As a normal user the script ran as this user, and :data:`SUBREAPER` made that check:
    its run failed (exit status 3) if anything the script started was left."""
    if os.geteuid() == 0:
        assert isolation.processes_of_uid(uid) == [], 'a process of the script outlived it'


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
    """``(uid, interpreter, env)`` for running mtflow as a normal user (with :func:`as_uid`): as
    root, a uid leased for the block (so nothing else runs as it; released after); as a normal
    user, this user (the script then runs under :data:`SUBREAPER`); an interpreter it can run
    mtflow with, and the environment to run it in. Skips the test where that is impossible (no
    bwrap; as root no setpriv; no interpreter and checkout that uid can read)."""
    if not shutil.which('bwrap') or (os.geteuid() == 0 and not shutil.which('setpriv')):
        pytest.skip('needs bwrap, and as root setpriv (to become an unprivileged uid)')
    lease = isolation.UidLease() if os.geteuid() == 0 else None
    try:
        uid = lease.uid if lease is not None else os.geteuid()
        site = [p for p in sys.path if p.endswith('site-packages')]
        env = {'PATH': '/usr/bin:/bin', 'HOME': '/', 'PYTHONPATH': os.pathsep.join([ROOT] + site)}
        exe = interpreter_for(uid, env)
        if exe is None:
            pytest.skip('no interpreter and mtflow checkout that an unprivileged uid can read here')
        yield uid, exe, env
    finally:
        if lease is not None:
            lease.release()


#: the normal user the rootless tests of issue 52 run as, when they run as root: made by
#: scripts/test.sh with ``useradd -m``, which gives it a range of subordinate uids (/etc/subuid)
TEST_USER = 'mtflow-sbx'


@contextlib.contextmanager
def normal_user() -> Iterator[Tuple[int, str, dict]]:
    """``(uid, interpreter, env)`` for running mtflow as a normal user made with ``useradd -m``
    (:data:`TEST_USER` as root; this user otherwise), with its subordinate uids: what most cluster
    users are. Skips where there is none (scripts/test.sh makes it as root) or it cannot run the
    interpreter and checkout."""
    import pwd
    if not shutil.which('bwrap'):
        pytest.skip('needs bwrap')
    if os.geteuid() == 0:
        if not shutil.which('setpriv'):
            pytest.skip('needs setpriv (to become the test user)')
        try:
            uid = pwd.getpwnam(TEST_USER).pw_uid
        except KeyError:
            pytest.skip(f'no user {TEST_USER} (scripts/test.sh makes it: useradd -m {TEST_USER})')
    else:
        uid = os.geteuid()
    site = [p for p in sys.path if p.endswith('site-packages')]
    env = {'PATH': '/usr/bin:/bin', 'HOME': '/', 'PYTHONPATH': os.pathsep.join([ROOT] + site)}
    exe = interpreter_for(uid, env)
    if exe is None:
        pytest.skip(f'no interpreter and mtflow checkout that uid {uid} can read here')
    yield uid, exe, env


def run_as(uid: int, exe: str, env: dict, script: str, *args: str, timeout: float = 300) -> str:
    """``script`` run with ``exe`` as ``uid`` (:func:`as_uid`); its stdout (stderr in the failure)."""
    proc = subprocess.run(as_uid(uid) + [exe, '-c', script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd='/')
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def call_processes() -> Dict[int, List[int]]:
    """PID namespace -> host pids of the sandbox processes of calls this process started (or a
    script it runs): its descendants in PID namespaces other than its own (the outer
    bwrap/unshare is in ours; everything it runs is not)."""
    children: dict = {}
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            with open(f'/proc/{name}/stat', 'rb') as f:
                ppid = int(f.read().rsplit(b')', 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    mine, todo = pid_namespace_of(os.getpid()), list(children.get(os.getpid(), []))
    found: Dict[int, List[int]] = {}
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        ns = pid_namespace_of(pid)
        if ns is not None and ns != mine:
            found.setdefault(ns, []).append(pid)
    return found


def pipes_held(pids: List[int]) -> Tuple[int, int]:
    """``(pages, queued bytes)`` of the distinct pipes ``pids`` hold, read on the host: each pipe
    reopened through ``/proc/<pid>/fd`` for its size (``F_GETPIPE_SZ``) and what is queued in it
    (``FIONREAD``), and closed again."""
    import fcntl
    import struct
    import termios
    seen = {}
    for pid in pids:
        try:
            fds = os.listdir(f'/proc/{pid}/fd')
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f'/proc/{pid}/fd/{fd}')
                if not link.startswith('pipe:[') or link in seen:
                    continue
                f = os.open(f'/proc/{pid}/fd/{fd}', os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                size = fcntl.fcntl(f, 1032)  # F_GETPIPE_SZ
                queued = struct.unpack('i', fcntl.ioctl(f, termios.FIONREAD, b'\0' * 4))[0]
                seen[link] = (size // os.sysconf('SC_PAGE_SIZE'), queued)
            except OSError:
                pass
            finally:
                os.close(f)
    return sum(p for p, _ in seen.values()), sum(q for _, q in seen.values())
