"""The attacks of issue 52 as scenarios a test runs as root, or, through a script, as a normal
user (``json`` in, ``json`` out): each runs its calls through ``run_python`` and measures on the
host while they run (the file pages that stay cached once the host evicts them, the pipe pages a
call holds, the size of the driver's own fresh pipes, the driver's threads and subprocesses)."""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import resource
import shutil
import subprocess
import tempfile
import textwrap
import threading
import time
from typing import Dict, Iterator, List, Optional, Tuple

from mtflow.tools.sandbox import run_python

from .sandbox_util import HostSampler, call_processes, pipes_held

HUGE = 2 << 20

#: item 1: a file of huge pages the host wrote and evicted, mapped with huge pages by the call
#: (each fault reads a 2 MB folio), unmapped; then one byte of each folio spliced into a pipe of
#: its own (each slot would hold the whole folio), sendfile into a pipe and into a socket, tee
#: between pipes; a byte written to a pipe marks the hold, and the call keeps its pipes for 2 s
SPLICE_PIN = textwrap.dedent('''
    import ctypes, mmap, os, socket, time
    huge = 2 << 20
    fd = os.open({path!r}, os.O_RDONLY)
    n = os.fstat(fd).st_size // huge
    for i in range(n):  # one huge page at a time (RLIMIT_AS)
        m = mmap.mmap(fd, huge, offset=i * huge, prot=mmap.PROT_READ)
        m.madvise(mmap.MADV_HUGEPAGE)
        m[0]
        m.close()
    out, pipes = [], []
    def attempt(name, fn):
        try:
            fn()
            out.append(name + " ok")
        except OSError as e:
            out.append(name + " e%d" % e.errno)
    def splice_each():
        for i in range(n):
            if i % 16 == 0:  # a pipe has 16 slots
                pipes.append(os.pipe())
            os.splice(fd, pipes[-1][1], 1, offset_src=i * huge)
    attempt("splice", splice_each)
    r, w = os.pipe()
    attempt("sendfile_pipe", lambda: os.sendfile(w, fd, huge, 1))
    a, b = socket.socketpair()
    attempt("sendfile_socket", lambda: os.sendfile(a.fileno(), fd, 2 * huge, 1))
    os.write(w, b"!")  # the hold starts: the host sees a byte queued
    r2, w2 = os.pipe()
    libc = ctypes.CDLL(None, use_errno=True)
    def tee():
        if libc.tee(r, w2, 1, 0) < 0:
            raise OSError(ctypes.get_errno(), "tee")
    attempt("tee", tee)
    print(*out, flush=True)
    time.sleep(2)
''')


def _cachestat(fd: int) -> int:
    """The pages of ``fd``'s file in the page cache (``cachestat``, Linux 6.5)."""
    import pyseccomp
    nr = int(pyseccomp.resolve_syscall(pyseccomp.system_arch(), 'cachestat'))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rng, stat = (ctypes.c_uint64 * 2)(0, 0), (ctypes.c_uint64 * 5)()
    if libc.syscall(nr, fd, rng, stat, 0) != 0:
        raise OSError(ctypes.get_errno(), 'cachestat')
    return int(stat[0])


def _mem_free_mb() -> int:
    with open('/proc/meminfo', encoding='ascii') as f:
        for line in f:
            if line.startswith('MemFree:'):
                return int(line.split()[1]) >> 10
    return 0


class PinnedPages(HostSampler):
    """While calls run, every ``every_s``: ``path`` evicted (``POSIX_FADV_DONTNEED``) and its
    pages that stay cached all the same, the pipe pages and queued bytes of the calls' pipes
    (where this process may read their ``/proc/<pid>/fd``: root, or a driver whose calls run as
    this user) and ``MemFree``. :meth:`held_pages`: the most pages that stayed cached through
    every eviction of a whole second (pinned, not merely read again meanwhile)."""

    every_s = 0.05

    def __init__(self, path: str) -> None:
        self.path = path
        self.samples: List[Dict[str, float]] = []
        self.mem_free_before = _mem_free_mb()

    def sample(self) -> None:
        pipes = {ns: pipes_held(pids) for ns, pids in call_processes().items()}
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            cached = _cachestat(fd)
        finally:
            os.close(fd)
        self.samples.append({'t': time.monotonic(), 'pipes': pipes, 'cached_pages': cached,
                             'mem_free_drop_mb': self.mem_free_before - _mem_free_mb()})

    def held_pages(self, window_s: float = 1.0) -> int:
        best = 0
        for i, first in enumerate(self.samples):
            inside = [s['cached_pages'] for s in self.samples[i:] if s['t'] - first['t'] <= window_s]
            if self.samples[-1]['t'] - first['t'] >= window_s:
                best = max(best, min(inside))
        return int(best)

    def most(self, key: str) -> float:
        return max((s[key] for s in self.samples), default=0)

    def pipe_pages(self, ns: int) -> int:
        """The most pipe pages the call with PID namespace ``ns`` held (0: not seen)."""
        return max((s['pipes'].get(ns, (0, 0))[0] for s in self.samples), default=0)


@contextlib.contextmanager
def evicted_file(size: int = 32 * HUGE) -> Iterator[Tuple[str, str]]:
    """``(directory, path)``: a new world-readable file of ``size`` bytes under ``/var/tmp`` (a
    ``site_packages`` directory may not be under ``/tmp``), written out and evicted; removed after."""
    d = tempfile.mkdtemp(prefix='mtflow-pin-', dir='/var/tmp')
    try:
        os.chmod(d, 0o755)
        path = os.path.join(d, 'blob')
        with open(path, 'wb') as f:
            for _ in range(size // HUGE):
                f.write(b'\xab' * HUGE)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(path, 0o644)
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        yield d, path
    finally:
        shutil.rmtree(d, ignore_errors=True)


def pin_call(kind: str, directory: str, path: str) -> dict:
    """Item 1: one call of :data:`SPLICE_PIN` on ``path`` (in ``directory``, its site_packages)."""
    r = asyncio.run(run_python(SPLICE_PIN.format(path=path), isolation=kind, site_packages=[directory],
                               timeout_s=120, memory_mb=64))
    return {'error_kind': r.error_kind, 'output': r.output, 'pid_namespace': r.pid_namespace}


#: item 2, the sender: 3 processes besides itself, each holding 30 pipes (the sandbox's
#: RLIMIT_NOFILE is 64), of 1 MB while its user's quota lets it, while a bit of PATTERN is 1,
#: closing them while it is 0, one bit per SLOT_S: four processes together pass the user's
#: pipe-user-pages-soft (64 MB), past which every new pipe of the user has 2 pages
PIPE_SENDER = textwrap.dedent('''
    import fcntl, os, time
    pattern, slot = {pattern!r}, {slot}
    for _ in range(2):
        os.fork()
    start, held, most = time.monotonic(), [], 0
    for k, bit in enumerate(pattern):
        if bit == "1":
            try:
                while len(held) < 30:
                    held.append(os.pipe())
                    try:
                        fcntl.fcntl(held[-1][1], 1031, 1 << 20)  # F_SETPIPE_SZ: refused past the user's quota
                    except OSError:
                        pass  # (a pipe of 16 pages still takes the user past it)
            except OSError:
                pass
        most = max(most, len(held))
        time.sleep(max(0.0, start + (k + 1) * slot - time.monotonic()))
        for r, w in held:
            os.close(r)
            os.close(w)
        held = []
    os.write(1, b"sent %d\\n" % most)  # one write: the 4 processes' lines never interleave (python -u)
    time.sleep(0.2)
''')

#: item 2, the receiver: the size of a fresh pipe, every 10 ms for SECONDS
PIPE_RECEIVER = textwrap.dedent('''
    import fcntl, os, time
    sizes, end = [], time.monotonic() + {seconds}
    while time.monotonic() < end:
        r, w = os.pipe()
        sizes.append(fcntl.fcntl(w, 1032))  # F_GETPIPE_SZ
        os.close(r)
        os.close(w)
        time.sleep(0.01)
    print("sizes", *sorted(set(sizes)), "small", sum(s < 65536 for s in sizes), "of", len(sizes))
''')

PATTERN = '1011001110'
SLOT_S = 0.3


class DriverPipes(HostSampler):
    """The size of a fresh pipe of the driver (this process), every ``every_s``."""

    every_s = 0.02

    def __init__(self) -> None:
        self.sizes: List[int] = []

    def sample(self) -> None:
        import fcntl
        r, w = os.pipe()
        self.sizes.append(fcntl.fcntl(w, 1032))
        os.close(r)
        os.close(w)


async def _two(kind: str, first: str, second: str, **kw) -> list:
    return list(await asyncio.gather(run_python(first, isolation=kind, timeout_s=60, **kw),
                                     run_python(second, isolation=kind, timeout_s=60, **kw)))


def pipe_channel_scenario(kind: str) -> dict:
    """Item 2: a sender call modulates the pipe quota, a concurrent receiver call and the driver
    read the size of fresh pipes."""
    sender = PIPE_SENDER.format(pattern=PATTERN, slot=SLOT_S)
    receiver = PIPE_RECEIVER.format(seconds=len(PATTERN) * SLOT_S + 1.5)
    with DriverPipes() as driver:
        sent, got = asyncio.run(_two(kind, sender, receiver))
    return {'sender': sent.error_kind + ' ' + sent.output, 'receiver': got.error_kind + ' ' + got.output,
            'driver_small': sum(s < 65536 for s in driver.sizes), 'driver_samples': len(driver.sizes),
            'sender_ns': sent.pid_namespace, 'report': _report(kind)}


#: item 3, the sender: 60 descriptors per message in flight over a unix socket pair, sent until
#: the kernel refuses (the user's count past the sender's RLIMIT_NOFILE), held while a bit of
#: PATTERN is 1, received back (freed) while it is 0
INFLIGHT_SENDER = textwrap.dedent('''
    import array, os, socket, time
    pattern, slot = {pattern!r}, {slot}
    fd = os.open("/dev/null", os.O_RDONLY)
    start, most = time.monotonic(), 0
    for k, bit in enumerate(pattern):
        a, b = socket.socketpair()
        sent = 0
        if bit == "1":
            try:
                while sent < 600:
                    a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd] * 60))])
                    sent += 60
            except OSError:
                pass
        most = max(most, sent)
        time.sleep(max(0.0, start + (k + 1) * slot - time.monotonic()))
        a.close()
        b.close()
    print("sent", most, flush=True)
''')

#: item 3, the receiver: one descriptor passed to itself every 10 ms (what multiprocessing's
#: forkserver does for each process it starts), then a forkserver Pool
INFLIGHT_RECEIVER = textwrap.dedent('''
    import array, multiprocessing, os, socket, time
    def square(x):
        return x * x
    if __name__ == "__main__":
        a, b = socket.socketpair()
        fd = os.open("/dev/null", os.O_RDONLY)
        ok = failed = 0
        end = time.monotonic() + {seconds}
        while time.monotonic() < end:
            try:
                a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
                msg, anc, flags, addr = b.recvmsg(1, socket.CMSG_SPACE(4))
                for level, kind, data in anc:
                    os.close(array.array("i", data)[0])
                ok += 1
            except OSError as e:
                failed += 1
                err = e.errno
            time.sleep(0.01)
        print("passed", ok, "failed", failed, flush=True)
        with multiprocessing.get_context("forkserver").Pool(2) as pool:
            print("forkserver", sum(pool.map(square, range(10))))
''')


def inflight_scenario(kind: str) -> dict:
    """Item 3: a sender call holds descriptors in flight, a concurrent receiver call passes its
    own."""
    sender = INFLIGHT_SENDER.format(pattern=PATTERN, slot=SLOT_S)
    receiver = INFLIGHT_RECEIVER.format(seconds=len(PATTERN) * SLOT_S + 1.5)
    sent, got = asyncio.run(_two(kind, sender, receiver, memory_mb=256))
    return {'sender': sent.error_kind + ' ' + sent.output, 'receiver': got.error_kind + ' ' + got.output,
            'report': _report(kind)}


def _report(kind: str) -> str:
    from mtflow.tools import isolation
    return isolation.resolve_isolation(kind).describe()


#: item 4: a call that forks all it may and holds its processes
HOLD_PROCESSES = textwrap.dedent('''
    import os, time
    kids = 0
    for _ in range(100):
        try:
            if os.fork() == 0:
                time.sleep(1.2)
                os._exit(0)
            kids += 1
        except OSError:
            break
    print("forked", kids, flush=True)
    time.sleep(1.2)
''')


class DriverStarts(HostSampler):
    """Every ``every_s``: can the driver start a thread, and a subprocess? (Each fails with
    ``EAGAIN`` when its user's process limit is taken.)"""

    every_s = 0.1

    def __init__(self) -> None:
        self.tries = self.thread_failed = self.process_failed = 0

    def sample(self) -> None:
        self.tries += 1
        try:
            t = threading.Thread(target=lambda: None)
            t.start()
            t.join()
        except RuntimeError:
            self.thread_failed += 1
        try:
            subprocess.run(['/bin/true'], check=True)
        except (OSError, subprocess.CalledProcessError):
            self.process_failed += 1


def nproc_scenario(kind: str, limit: Optional[int] = None, calls: int = 3) -> dict:
    """Item 4: ``calls`` calls at once, each forking all it may (``max_processes`` 64) and
    holding; the driver starts a thread and a subprocess every 100 ms meanwhile. With ``limit``,
    the driver's ``RLIMIT_NPROC`` is set first to it (the issue's 121), or to what lets one call
    fit beside the tasks this user runs already (a test process of the same user, with its
    threads and warm pools, may run 30; this driver's threads grow meanwhile): 120 more, where 3
    calls would take 198."""
    if limit is not None:
        from mtflow.tools.sandbox import budget
        limit = max(limit, budget.user_tasks() + 120)
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))

    async def all_calls():
        return await asyncio.gather(*(run_python(HOLD_PROCESSES, isolation=kind, timeout_s=60)
                                      for _ in range(calls)), return_exceptions=True)

    with DriverStarts() as driver:
        results = asyncio.run(all_calls())
    return {'calls': [repr(r) if isinstance(r, BaseException) else (r.error_kind + ' ' + r.output).strip()
                      for r in results], 'limit': limit,
            'tries': driver.tries, 'thread_failed': driver.thread_failed, 'process_failed': driver.process_failed}


#: the host's uevents: a call listens on NETLINK_KOBJECT_UEVENT for 3 s; the host sends it
#: synthetic ones (a "change" of /dev/null, with a UUID of the test's)
UEVENTS = textwrap.dedent('''
    import socket, time
    try:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15)
        s.bind((0, 1))
    except OSError as e:
        print("socket", "e%d" % e.errno)
        raise SystemExit
    s.settimeout(0.2)
    got, end = b"", time.monotonic() + 3
    while time.monotonic() < end:
        try:
            got += s.recv(65536)
        except OSError:
            pass
    print("received", {marker!r}.encode() in got)
''')


def uevent_scenario(kind: str) -> dict:
    """The host's uevents: does a call receive a synthetic one the host sends while it listens?
    (As root: only root may write ``/sys``.)"""
    import uuid
    marker = str(uuid.uuid4())
    stop = threading.Event()

    def send() -> None:
        while not stop.wait(0.2):
            try:
                with open('/sys/class/mem/null/uevent', 'w', encoding='ascii') as f:
                    f.write(f'change {marker}')
            except OSError:
                return

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        r = asyncio.run(run_python(UEVENTS.format(marker=marker), isolation=kind, timeout_s=60))
    finally:
        stop.set()
        sender.join()
    return {'error_kind': r.error_kind, 'output': r.output}


EPERM = f'e{errno.EPERM}'


class CallPipes(HostSampler):
    """The most pipe pages each call this process (or a script it runs) started held (read on the
    host: as root, or as the user the calls run as), by the call's PID namespace."""

    every_s = 0.1

    def __init__(self) -> None:
        self.most: Dict[int, int] = {}  # PID namespace -> pages

    def sample(self) -> None:
        for ns, pids in call_processes().items():
            pages = pipes_held(pids)[0]
            if pages:  # (none where this process may not read the call's /proc/<pid>/fd)
                self.most[ns] = max(self.most.get(ns, 0), pages)


#: a script a rootless test runs as a normal user: ``<scenario> <kind> [args...]``, json on stdout
SCRIPT = textwrap.dedent('''
    import json, sys
    from tests.declarative import quota_scenarios
    name, kind, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    print(json.dumps(getattr(quota_scenarios, name)(kind, *[int(a) if a.isdigit() else a for a in args])))
''')


#: two calls at once, each printing its uid inside and staying a second
WHO = 'import os, time\nprint(os.getuid(), flush=True)\ntime.sleep(1)'


def identity_scenario(kind: str) -> dict:
    """Which host uid each of two concurrent calls ran as, what the load-time report says, and
    this user's subordinate uid range."""
    import pwd
    from mtflow.tools import isolation, subuid
    results = asyncio.run(_two(kind, WHO, WHO))
    try:
        first, count = subuid.own_range(subuid.SUBUID, pwd.getpwuid(os.getuid()).pw_name, os.getuid())
    except subuid.SubuidUnavailable:
        first = count = 0
    return {'uid': os.getuid(), 'inside': [r.output.strip() for r in results], 'host_uids': [r.uid for r in results],
            'range': [first, count], 'report': isolation.resolve_isolation(kind).describe()}
