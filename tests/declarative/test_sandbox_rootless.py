"""Without root, bwrap isolates in its own user namespace (the program is ``nobody`` inside, this
user outside) and the process limit counts per namespace; unshare refuses. Run as an
unprivileged uid (as root, a leased one, so nothing else uses it; as a normal user, this user)
with an interpreter that uid can read (``sandbox_util.unprivileged_uid``)."""
from __future__ import annotations

import os
import subprocess
import textwrap
import uuid

import pytest

from .sandbox_util import BOUNDED_FORKS, as_uid, assert_nothing_left_as, unprivileged_uid

SCRIPT = textwrap.dedent('''
    import asyncio, os, sys
    from mtflow.tools import isolation
    from mtflow.tools.sandbox import run_python
    print("probe bwrap:", isolation.probe("bwrap"))
    print("probe unshare:", isolation.probe("unshare"))
    r = asyncio.run(run_python("import os; print(os.getuid(), sorted(os.listdir('/')))", isolation="bwrap"))
    print("benign:", r.error_kind or "ok", r.output.strip())
    forks = sys.argv[2]  # sandbox_util.BOUNDED_FORKS
    r = asyncio.run(run_python(forks, isolation="bwrap", max_processes=8, timeout_s=60))
    print("forks:", r.output.strip())
    marker = sys.argv[1]
    code = ("import subprocess, sys\\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', %r], "
            "start_new_session=True)\\nprint('started', flush=True)\\nwhile True: pass" % marker)
    r = asyncio.run(run_python(code, isolation="bwrap", timeout_s=5))
    print("loop:", r.error_kind, r.output.strip())
    attack = sys.argv[3]  # KERNEL_ATTACKS: ptrace of PID 1, key syscalls, inotify, writes to / and /dev
    r = asyncio.run(run_python(attack, isolation="bwrap", timeout_s=30))
    print("kernel:", r.error_kind or "ok", " ".join(r.output.split()))
    r = asyncio.run(run_python("import signal\\nsignal.signal(signal.SIGXCPU, lambda *a: None)\\nwhile True: pass",
                               isolation="bwrap", timeout_s=60, cpu_s=1))
    print("sigxcpu:", r.error_kind)
    print("report:", isolation.resolve_isolation("bwrap").describe())
''')

#: run rootless: every line must end in EPERM (1) or EROFS for the writes (but /dev/shm, the call's own)
KERNEL_ATTACKS = textwrap.dedent('''
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    def res(r):
        return "ok" if r >= 0 else "e%d" % ctypes.get_errno()
    print("ptrace_pid1", res(libc.syscall(101, 16, 1, 0, 0)))  # PTRACE_ATTACH (x86_64 numbers)
    print("keyctl", res(libc.syscall(250, 0, ctypes.c_int(-3), 0)))
    print("inotify", res(libc.syscall(294, 0)))
    print("mq_open", res(libc.syscall(240, b"mtflow", 0o102, 0o600, None)))  # RLIMIT_MSGQUEUE 0: EMFILE
    for d in ("/", "/dev", "/dev/shm"):
        try:
            open(os.path.join(d, "w"), "w").close()
            print("write", d, "ok")
        except OSError as e:
            print("write", d, "e%d" % e.errno)
''')


def test_rootless_bwrap_isolates_and_limits_processes():
    with unprivileged_uid() as (uid, exe, env):
        marker = 'mtflow-' + uuid.uuid4().hex
        proc = subprocess.run(as_uid(uid) + [exe, '-c', SCRIPT, marker, BOUNDED_FORKS, KERNEL_ATTACKS], env=env,
                              capture_output=True, text=True, timeout=300, cwd='/')
        out = proc.stdout
        assert proc.returncode == 0, proc.stderr
        if 'probe bwrap: None' not in out:
            pytest.skip(f'unprivileged user namespaces are not available here: {out.splitlines()[0]}')
        assert 'probe unshare: unshare needs root' in out
        assert "benign: ok 65534 ['bin', 'dev'" in out  # nobody inside its own namespace
        assert 'forks: 7 33' in out  # 7 children + the program: max_processes binds per namespace
        assert 'loop: timeout started' in out
        if os.uname().machine == 'x86_64':  # the attack uses x86_64 syscall numbers
            assert 'kernel: ok ptrace_pid1 e1 keyctl e1 inotify e1 mq_open e24 write / e30 write /dev e30 write /dev/shm ok' in out
        assert 'sigxcpu: timeout' in out
        assert 'seccomp filter' in out and 'no cgroup per call' in out  # said at load time
        if os.geteuid() == 0:  # a leased uid, no user of /etc/subuid: the calls run as it, and it says so
            assert 'as this user (no subordinate uids: uid ' in out and 'has no user name' in out
        assert_nothing_left_as(uid)
        assert not any(marker.encode() in _cmdline(p) for p in os.listdir('/proc') if p.isdigit())


def _cmdline(pid: str) -> bytes:
    try:
        with open(f'/proc/{pid}/cmdline', 'rb') as f:
            return f.read()
    except OSError:
        return b''


#: rootless the program is the driver's user outside its namespace: it would see that user's keys
_ROOTLESS_KEYS = textwrap.dedent('''
    import asyncio, ctypes, sys
    from mtflow.tools.sandbox import run_python
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    desc = sys.argv[1]
    key = libc.syscall(248, b"user", desc.encode(), b"payload", 7, ctypes.c_int(-4))  # add_key to the user keyring
    print("key", key > 0)
    with open("/proc/keys") as f:
        print("driver sees it", desc in f.read())
    code = "for p in ('/proc/keys', '/proc/key-users'):\\n    print(p, repr(open(p).read()))"
    r = asyncio.run(run_python(code, isolation="bwrap", timeout_s=60))
    print(r.error_kind or "ok")
    print(r.output.rstrip())
    libc.syscall(250, 3, ctypes.c_int(key))  # KEYCTL_REVOKE
''')


def test_rootless_proc_keys_are_masked():
    if os.uname().machine != 'x86_64':
        pytest.skip('the driver script uses x86_64 syscall numbers')
    with unprivileged_uid() as (uid, exe, env):
        desc = 'mtflow-' + uuid.uuid4().hex
        proc = subprocess.run(as_uid(uid) + [exe, '-c', _ROOTLESS_KEYS, desc], env=env, capture_output=True,
                              text=True, timeout=300, cwd='/')
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    if lines[:2] != ['key True', 'driver sees it True']:
        pytest.skip(f'kernel keyrings are not available to this user here: {proc.stdout[:200]}')
    assert lines[2:] == ['ok', "/proc/keys ''", "/proc/key-users ''"], proc.stdout
    assert desc not in proc.stdout.split('driver sees it')[1]
