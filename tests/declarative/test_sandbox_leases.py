"""uid leases as root: one root-only directory per host, so two drivers (whatever their
``$TMPDIR``) never share a uid, and a directory another user made is refused, not followed; and
across containers on one kernel (each with its own lease directory), a uid some process runs as is
never run on: the launcher's check with the kernel's count of the uid's tasks (issue 39, item 6)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from mtflow.tools import isolation
from mtflow.tools.isolation import LeaseDirUnsafe, UidLease, open_lease_dir
from mtflow.tools import make_builtin
from mtflow.tools.sandbox import run_python
from mtflow.tools.sandbox.python_tool import refusal

from .sandbox_util import KINDS, require

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason='uid leases are made as root only')


@pytest.fixture
def lease_dir(tmp_path, monkeypatch):
    """Point the leases at ``tmp_path/leases`` (its parent made root-only, as /run is)."""
    os.chmod(tmp_path, 0o755)
    UidLease.forget_dir()
    monkeypatch.setattr(UidLease, 'lease_dir', str(tmp_path / 'leases'))
    yield tmp_path / 'leases'
    UidLease.forget_dir()


def test_the_lease_directory_is_root_only_and_under_run():
    assert isolation.LEASE_DIR.startswith('/run/')
    lease = UidLease()
    try:
        st = os.stat(isolation.LEASE_DIR)
        assert (st.st_uid, st.st_mode & 0o777) == (0, 0o700)
        # not the block pre-v2 drivers lease through $TMPDIR (1200000000 + 4096): old and new never collide
        assert not 1_200_000_000 <= lease.uid < 1_200_000_000 + isolation.UID_BLOCK
    finally:
        lease.release()


_OTHER_DRIVER = textwrap.dedent('''
    import sys
    from mtflow.tools.isolation import UidLease
    UidLease._first = staticmethod(lambda: int(sys.argv[1]))  # start where the first driver's lease is
    print(UidLease().uid)
''')


def test_two_drivers_with_their_own_tmpdir_never_share_a_uid(tmp_path):
    held = UidLease()
    try:
        start = held.uid - isolation._uid_base()
        env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=ROOT)
        out = subprocess.run([sys.executable, '-c', _OTHER_DRIVER, str(start)], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        # the scan went on past the held uid (other drivers on this host may hold the next ones)
        assert int(out.stdout) != held.uid and 0 <= int(out.stdout) - isolation._uid_base() < isolation.UID_BLOCK
    finally:
        held.release()


def test_a_symlinked_lease_directory_is_refused(lease_dir, tmp_path):
    target = tmp_path / 'elsewhere'
    target.mkdir()
    os.chmod(target, 0o700)
    lease_dir.symlink_to(target)
    with pytest.raises(LeaseDirUnsafe, match='symlink') as info:
        UidLease()
    assert os.listdir(target) == []  # nothing created where the link points
    assert 'isolation: none' not in refusal(str(info.value))


@pytest.mark.parametrize('owner, mode, problem', [(65534, 0o700, 'owned by uid 65534'),
                                                  (0, 0o777, 'lets others in'), (0, 0o755, 'lets others in')])
def test_a_lease_directory_of_another_user_or_open_to_others_is_refused(lease_dir, owner, mode, problem):
    lease_dir.mkdir()
    os.chown(lease_dir, owner, owner)
    os.chmod(lease_dir, mode)
    with pytest.raises(LeaseDirUnsafe, match=problem) as info:
        UidLease()
    assert os.listdir(lease_dir) == []
    message = refusal(str(info.value))
    assert str(lease_dir) in message and 'isolation: none' not in message


def test_a_planted_link_inside_the_directory_is_not_followed(lease_dir, tmp_path):
    base = isolation._uid_base()
    lease_dir.mkdir(mode=0o700)
    victim = tmp_path / 'victim'
    for k in range(isolation.UID_BLOCK):
        (lease_dir / str(base + k)).symlink_to(victim)
    with pytest.raises(LeaseDirUnsafe, match='cannot open the lease file'):
        UidLease()
    assert not victim.exists()


def test_a_good_directory_gives_leases(lease_dir):
    fd = open_lease_dir(str(lease_dir))
    os.close(fd)
    a, b = UidLease(), UidLease()
    try:
        assert a.uid != b.uid
        for uid in (a.uid, b.uid):
            st = os.lstat(lease_dir / str(uid))
            assert st.st_uid == 0 and st.st_mode & 0o777 == 0o600
    finally:
        a.release()
        b.release()


# ---- two containers on one kernel (issue 39, item 6) ----------------------------------------------
#: one driver of a "container": its own lease directory (each container has its own /run), the
#: lease scan pinned to start at ``argv[2]`` (two containers then lease the same uid first, as they
#: always did with one random seed), and the python tool of a YAML scheduler (``argv[3]``) running
#: ``argv[4]``; it prints the call's result
_CONTAINER = textwrap.dedent('''
    import asyncio, random, sys
    from mtflow.tools import isolation
    from mtflow.declarative import load_scheduler
    start = int(sys.argv[2])
    random.seed(0)
    random.randrange = lambda n: start  # (the scan's start before issue 39)
    isolation.UidLease._first = staticmethod(lambda: start)
    isolation.UidLease.lease_dir = sys.argv[1]
    scheduler = load_scheduler(sys.argv[3])
    async def main():
        result, = await scheduler.runner.call_all([("python", {"code": sys.argv[4]})])
        print("result", result.ok, " | ".join((result.output or result.error).split("\\n")), flush=True)
    try:
        asyncio.run(main())
    finally:
        scheduler.close()
''')

#: the first container's call: 14 forked children and one marked process (the sign, seen on the
#: host, that it holds all 16 tasks ``max_processes`` allows); it ends when that one is killed
_HOLDER = textwrap.dedent('''
    import os, subprocess, sys, time
    kids = 0
    for _ in range(14):
        if os.fork() == 0:
            time.sleep(300)
            os._exit(0)
        kids += 1
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "{marker}", "holding"]).wait()
    print("held", kids + 2, os.getuid())
''')

#: the second container's call: 10 forks, then a marked process carrying how many succeeded
_FORKER = textwrap.dedent('''
    import os, subprocess, sys, time
    ok = 0
    for _ in range(10):
        try:
            pid = os.fork()
        except OSError:
            continue
        if pid == 0:
            time.sleep(300)
            os._exit(0)
        ok += 1
    try:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "{marker}", "forked", str(ok)]).wait()
    except OSError as e:
        print("no marker", e.errno)
    print("forks", ok, os.getuid())
''')

_SCHEDULER = ('name: py\ntools:\n  - name: python\n    timeout_s: 200\n'
              '    options: {max_processes: 16, timeout_s: 150, warm_pool: 0}\n')


def _marked(marker: str) -> dict:
    """pid -> (argv after the marker, real uid as the host sees it) of the processes carrying ``marker``."""
    found = {}
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            with open(f'/proc/{name}/cmdline', 'rb') as f:
                argv = f.read().decode(errors='replace').rstrip('\0').split('\0')
            if marker not in argv:
                continue
            with open(f'/proc/{name}/status', encoding='ascii') as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith('Uid:'))
        except (OSError, StopIteration):
            continue
        found[int(name)] = (argv[argv.index(marker) + 1:], uid)
    return found


def _wait_marked(marker: str, driver: subprocess.Popen, timeout_s: float = 180.0) -> dict:
    """The marked processes once there are any, or ``{}`` when the driver ended first (or after
    ``timeout_s``, a bound for a broken run only: it does not decide the outcome)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = _marked(marker)
        if found or driver.poll() is not None:
            return found
        time.sleep(0.05)
    return {}


def test_two_containers_with_their_own_lease_directories_never_run_on_one_uid(tmp_path):
    """Two lease directories (two containers' ``/run``) and the same first uid: the second call
    finds the uid in use by the first call's processes (the kernel's count of the uid's tasks, which
    every container on the kernel shares) and runs on another; all its forks succeed (before: 0 of 10)."""
    os.chmod(tmp_path, 0o755)
    (tmp_path / 'sched.yaml').write_text(_SCHEDULER)
    start = int.from_bytes(os.urandom(2), 'little') % isolation.UID_BLOCK
    marker = f'mtflow-{uuid.uuid4().hex}'
    env = dict(os.environ, PYTHONPATH=ROOT)
    drivers = []
    try:
        for name, program in (('a', _HOLDER), ('b', _FORKER)):
            argv = [sys.executable, '-c', _CONTAINER, str(tmp_path / f'leases-{name}'), str(start),
                    str(tmp_path / 'sched.yaml'), program.format(marker=marker + name)]
            drivers.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            marked = _wait_marked(marker + name, drivers[-1])
            assert marked, drivers[-1].communicate(timeout=60)
        holder, forker = _marked(marker + 'a'), _marked(marker + 'b')
        (_, uid_a), = holder.values()
        (forked_argv, uid_b), = forker.values()
        assert len(isolation.processes_of_uid(uid_a)) == 16  # the first call holds all it may, on the host
        for pid in list(holder) + list(forker):
            os.kill(pid, signal.SIGKILL)  # (the test's own marked processes) each call then ends
        outs = [d.communicate(timeout=120) for d in drivers]
    finally:
        for d in drivers:
            if d.poll() is None:
                d.kill()
                d.wait()
    assert [d.returncode for d in drivers] == [0, 0], outs
    assert outs[0][0].split()[:4] == ['result', 'True', 'held', '16'], outs
    assert forked_argv == ['forked', '10'], (forked_argv, outs)
    assert uid_a != uid_b and outs[1][0].split()[:5] == ['result', 'True', 'forks', '10', str(uid_b)], outs
    assert isolation.wait_uid_gone(uid_a) and isolation.wait_uid_gone(uid_b)


@pytest.fixture
def outsider(monkeypatch):
    """A uid of the block that this host's leases call free but a process runs as (what a sandbox
    of another container on this kernel looks like from here), and the lease scan pinned to start
    at it; yields ``(uid, pid)``; the process is ended after the test."""
    lease = UidLease()
    uid = lease.uid
    proc = subprocess.Popen(['setpriv', f'--reuid={uid}', f'--regid={uid}', '--clear-groups', '--', 'sleep', '600'])
    lease.release()
    monkeypatch.setattr(UidLease, '_first', staticmethod(lambda: uid - isolation._uid_base()))
    monkeypatch.setattr(UidLease, '_busy', {})
    try:
        while isolation.processes_of_uid(uid) != [proc.pid]:  # (setpriv has switched)
            assert proc.poll() is None
            time.sleep(0.01)
        yield uid, proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize('kind', KINDS)
def test_a_uid_in_use_outside_the_leases_is_never_run_on(outsider, kind):
    require(kind)
    uid, pid = outsider
    tool = make_builtin('python', {'isolation': kind, 'timeout_s': 60, 'warm_pool': 2})
    try:
        results = [asyncio.run(tool(code='import os; print(os.getuid())')) for _ in range(2)]
    finally:
        tool.close()
    assert all(int(r) != uid for r in results), results
    assert UidLease._busy.get(uid), 'the uid found in use is skipped for a while'
    assert isolation.processes_of_uid(uid) == [pid]  # the other container's process, untouched


@pytest.mark.parametrize('code', ['raise SystemExit(118)', 'import os; os._exit(118)'])
def test_a_programs_own_status_118_is_its_exit_not_a_busy_uid(code):
    require('bwrap')
    r = asyncio.run(run_python('print("ran")\n' + code, isolation='bwrap', timeout_s=60))
    assert (r.error_kind, r.returncode, r.output) == ('exit', isolation.UID_BUSY_STATUS, 'ran\n')
