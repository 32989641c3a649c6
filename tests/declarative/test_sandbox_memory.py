"""Memory that no process maps (``memfd``, System V shared memory, message queues) and kernel memory
(a flood of empty files) stay bounded per call in every mode: with a cgroup (root here: the kernel
kills the call at ``memory_mb``), as root where no cgroup can be made, and as a normal user (no
cgroup: the filter denies ``memfd_create`` and System V IPC, and ``/tmp`` has an inode cap). The
host is checked while the call runs (``/proc/meminfo``: ``Shmem``, ``Slab``, ``SUnreclaim``), not
only the tool's reply."""
from __future__ import annotations

import asyncio
import errno
import subprocess
import textwrap

import pytest

from mtflow.tools import cgroup, isolation
from mtflow.tools.sandbox import process, run_python

from .sandbox_util import (KINDS, HostMemory, as_uid, assert_nothing_left_as, assert_nothing_survives, require,
                           unprivileged_uid)

kinds = pytest.mark.parametrize('kind', KINDS)

MEMORY_MB = 128
#: what a host figure may rise by on this shared machine beyond what the call may hold: far below
#: the 1 GB (memfd, shm) and the 2 GB of slab (two million files) the attacks hold unbounded
SLACK_MB = 160

#: 1 GB in memfds of 16 MB (each under RLIMIT_FSIZE), then 1 GB of System V shared memory in
#: segments of 32 MB, each attached (under RLIMIT_AS), touched and detached again (a detached
#: segment keeps its pages), then a message queue; every line says how far it got and why it stopped
SHARED_HOG = textwrap.dedent('''
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    chunk = b"x" * (1 << 20)
    held, why = 0, "all"
    fds = []
    try:
        while held < 1024:
            fds.append(os.memfd_create("hog"))
            for _ in range(16):
                os.write(fds[-1], chunk)
                held += 1
            print("memfd held", held, flush=True)
    except OSError as exc:
        why = "errno %d" % exc.errno
    print("memfd stopped", held, why, flush=True)
    held, why = 0, "all"
    while held < 1024:
        seg = libc.shmget(0, 32 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
        if seg < 0:
            why = "errno %d" % ctypes.get_errno()
            break
        addr = libc.shmat(seg, None, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            why = "shmat errno %d" % ctypes.get_errno()
            break
        ctypes.memset(addr, 1, 32 << 20)
        libc.shmdt(ctypes.c_void_p(addr))
        held += 32
        print("shm held", held, flush=True)
    print("shm stopped", held, why, flush=True)
    q = libc.msgget(0, 0o1600)
    print("msgget", "ok" if q >= 0 else "errno %d" % ctypes.get_errno(), flush=True)
''')

#: empty files until the file system says no (two million at most)
FILE_FLOOD = textwrap.dedent('''
    n = 0
    try:
        while n < 2000000:
            open("f%d" % n, "w").close()
            n += 1
        print("flood stopped", n, 0)
    except OSError as exc:
        print("flood stopped", n, exc.errno)
''')


#: epoll: watches are kernel memory only a cgroup counts, with a per-user quota (the driver's, when
#: rootless): without a cgroup epoll_create is denied, select.epoll hidden, and asyncio still works.
#: Socket buffers: without a cgroup no raised sizes and no IP sockets; 60 unix sockets filled with
#: the default buffers (60 x 8 MB had they been raised to twice wmem_max)
EPOLL = textwrap.dedent('''
    import asyncio, ctypes, select, selectors, socket
    def attempt(name, fn):
        try:
            fn()
            print(name, "ok")
        except OSError as exc:
            print(name, "errno", exc.errno)
    attempt("SO_SNDBUF", lambda: socket.socketpair()[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30))
    attempt("AF_INET", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    queued, pairs = 0, []
    for _ in range(30):
        pairs.append(socket.socketpair())
        for s in pairs[-1]:
            s.setblocking(False)
            try:
                while True:
                    queued += s.send(b"x" * 65536)
            except BlockingIOError:
                pass
    print("queued MB", queued >> 20)
    del pairs
    libc = ctypes.CDLL(None, use_errno=True)
    print("epoll_create1", "ok" if libc.epoll_create1(0) >= 0 else "errno %d" % ctypes.get_errno())
    print("select.epoll", hasattr(select, "epoll"), selectors.DefaultSelector.__name__)
    async def main():
        import socket
        mine, theirs = socket.socketpair()
        reader, _ = await asyncio.open_connection(sock=mine)
        theirs.sendall(b"ping\\n")
        print("asyncio", (await reader.readline()).decode().strip())
    asyncio.run(main())
''')


def _stopped(output: str, what: str):
    lines = [line.split() for line in output.splitlines() if line.startswith(what + ' stopped')]
    return lines[-1][2:] if lines else None


def _check_unbounded_mode(output: str, growth: dict) -> None:
    """No cgroup: memfd_create, shmget and msgget denied (EPERM); the host did not hold the memory."""
    assert _stopped(output, 'memfd') == ['0', 'errno', str(errno.EPERM)], output
    assert _stopped(output, 'shm') == ['0', 'errno', str(errno.EPERM)], output
    assert f'msgget errno {errno.EPERM}' in output, output
    assert growth['Shmem'] < MEMORY_MB + SLACK_MB, growth


def _check_epoll(output: str, bounded: bool) -> None:
    lines = output.splitlines()
    queued = int(lines[2].split()[-1])
    if bounded:
        # IP sockets are refused with a cgroup too: a v1 memory cgroup does not charge TCP buffers
        # (docs/sandbox.md, 'TCP memory'); socketpairs stay, bounded by the cgroup
        assert lines[:2] == ['SO_SNDBUF ok', f'AF_INET errno {errno.EPERM}'], output
        assert lines[3:5] == ['epoll_create1 ok', 'select.epoll True EpollSelector'], output
    else:
        assert lines[:2] == [f'SO_SNDBUF errno {errno.EPERM}', f'AF_INET errno {errno.EPERM}'], output
        assert lines[3:5] == [f'epoll_create1 errno {errno.EPERM}', 'select.epoll False PollSelector'], output
        with open('/proc/sys/net/core/wmem_default', encoding='ascii') as f:
            default = int(f.read())
        assert queued <= (60 * 2 * default) >> 20, output  # the default buffers, not raised ones
    assert 'asyncio ping' in output, output


def _check_flood(output: str, growth: dict, tmp_mb: int) -> None:
    """The flood ended at the inode cap of /tmp (ENOSPC), or (with a cgroup) at ``memory_mb``."""
    stop = _stopped(output, 'flood')
    if stop is not None:
        assert int(stop[1]) == errno.ENOSPC and int(stop[0]) <= isolation.tmp_inodes(tmp_mb), output
    # (most of a flood's slab is unreclaimable, the tmpfs inodes: +12.7 of +15.7 MB for 16382 files;
    # Slab as a whole also moves with the dentry caches of everything else on this shared machine,
    # so the bound is on SUnreclaim)
    assert growth['SUnreclaim'] < SLACK_MB, growth


@kinds
def test_shared_memory_of_a_call_with_a_cgroup_ends_at_memory_mb(kind):
    require(kind)
    if not cgroup.support().version:
        pytest.skip(cgroup.support().describe())
    with HostMemory() as host:
        r = asyncio.run(run_python(SHARED_HOG, isolation=kind, memory_mb=MEMORY_MB, timeout_s=60))
    assert r.error_kind == 'memory' and r.oom_killed, (r.error_kind, r.output[-400:])
    assert _stopped(r.output, 'memfd') is None  # killed while it held memfds, not refused
    held = [int(line.split()[2]) for line in r.output.splitlines() if line.startswith('memfd held')]
    assert held and max(held) <= MEMORY_MB, held
    assert r.usage['memory_peak_mb'] <= MEMORY_MB + 0.5
    assert host.growth()['Shmem'] < MEMORY_MB + SLACK_MB, host.growth()
    assert_nothing_survives(r)


@kinds
def test_without_a_cgroup_memory_no_process_maps_is_denied_and_tmp_inodes_are_capped(kind, monkeypatch):
    """Root on a host that gives no cgroup (``make_call_cgroup`` answers None, as it does then)."""
    require(kind)
    monkeypatch.setattr(process, 'make_call_cgroup', lambda *a, **k: None)
    with HostMemory() as host:
        r = asyncio.run(run_python(SHARED_HOG, isolation=kind, memory_mb=MEMORY_MB, timeout_s=60))
    assert r.error_kind == '' and not r.usage, (r.error_kind, r.output[-400:])
    _check_unbounded_mode(r.output, host.growth())
    assert_nothing_survives(r)
    with HostMemory() as host:
        r = asyncio.run(run_python(FILE_FLOOD, isolation=kind, memory_mb=64, tmp_mb=64, timeout_s=120))
    assert r.error_kind == '', r.output
    _check_flood(r.output, host.growth(), 64)
    assert_nothing_survives(r)
    r = asyncio.run(run_python(EPOLL, isolation=kind, timeout_s=60))
    assert r.error_kind == '', r.output
    _check_epoll(r.output, bounded=False)


@kinds
def test_with_a_cgroup_memfd_and_shm_stay_allowed(kind):
    """The extra denials are for calls no cgroup bounds only: with one, programs keep them."""
    require(kind)
    if not cgroup.support().version:
        pytest.skip(cgroup.support().describe())
    code = ('import ctypes, os\nfd = os.memfd_create("ok")\nos.write(fd, b"x" * 4096)\n'
            'print("shmget", ctypes.CDLL(None).shmget(0, 1 << 20, 0o1600) >= 0)')
    r = asyncio.run(run_python(code, isolation=kind, timeout_s=30))
    assert (r.error_kind, r.output) == ('', 'shmget True\n')
    r = asyncio.run(run_python(EPOLL, isolation=kind, timeout_s=60))
    assert r.error_kind == '', r.output
    _check_epoll(r.output, bounded=True)


_ROOTLESS = textwrap.dedent('''
    import asyncio, sys
    from mtflow.tools.sandbox import run_python
    for name, kw in (("shared", {"memory_mb": int(sys.argv[3])}), ("flood", {"memory_mb": 64, "tmp_mb": 64})):
        r = asyncio.run(run_python(sys.argv[1] if name == "shared" else sys.argv[2], isolation="bwrap",
                                   timeout_s=120, **kw))
        print("call", name, repr(r.error_kind), repr(r.usage), flush=True)
        print(r.output, flush=True)
    r = asyncio.run(run_python(sys.argv[4], isolation="bwrap", timeout_s=60))
    print("call pid1", repr(r.error_kind), " ".join(r.output.split()), flush=True)
    r = asyncio.run(run_python(sys.argv[5], isolation="bwrap", timeout_s=60))
    print("call epoll", repr(r.error_kind), flush=True)
    print(r.output, flush=True)
''')

#: PID 1 keeps the capability it mounted nothing with (the launcher did): the program, without
#: it, may not open PID 1's memory or environment; nor has the program any capability left
PID1 = textwrap.dedent('''
    import os
    for path in ("/proc/1/mem", "/proc/1/environ"):
        try:
            open(path, "rb").close()
            print(path, "open")
        except OSError as exc:
            print(path, "errno", exc.errno)
    print([line.split()[1] for line in open("/proc/self/status") if line.startswith(("CapPrm", "CapEff", "CapAmb"))])
''')


def test_rootless_memory_no_process_maps_is_denied_and_tmp_inodes_are_capped():
    """As a normal user (an unprivileged uid: as root a leased one, so nothing else runs as it; as a
    normal user, this user): no cgroup can be
    made, so the filter's extra denials and the launcher's own ``/tmp`` (with ``nr_inodes``) are
    what bound the call; the host is sampled while both attacks run."""
    with unprivileged_uid() as (uid, exe, env):
        with HostMemory() as host:
            proc = subprocess.run(as_uid(uid) + [exe, '-c', _ROOTLESS, SHARED_HOG, FILE_FLOOD, str(MEMORY_MB), PID1,
                                                 EPOLL], env=env, capture_output=True, text=True, timeout=300, cwd='/')
        out = proc.stdout
        assert proc.returncode == 0, proc.stderr[-2000:]
        if "call shared ''" not in out and 'user namespace' in out + proc.stderr:
            pytest.skip(f'unprivileged user namespaces are not available here: {out[-300:]}')
        assert "call shared '' {}" in out and "call flood '' {}" in out, out  # no cgroup: no usage
        assert (f"call pid1 '' /proc/1/mem errno {errno.EACCES} /proc/1/environ errno {errno.EACCES} "
                "['0000000000000000', '0000000000000000', '0000000000000000']") in out, out
        assert "call epoll ''" in out, out
        _check_epoll(out.split("call epoll ''\n")[1], bounded=False)
        shared, flood = out.split('call pid1')[0].split('call flood')
        _check_unbounded_mode(shared, host.growth())
        _check_flood(flood, host.growth(), 64)
        assert _stopped(flood, 'flood')[1] == str(errno.ENOSPC), flood  # the inode cap, rootless too
        assert_nothing_left_as(uid)
