"""Attacks on kernel state the namespaces do not separate (keyrings, memory outside any process,
kernel memory, tracing, nested namespaces), each run with every isolation tool that works here,
and checked on the host afterwards: the driver's keys, the call's cgroup, the processes left."""
from __future__ import annotations

import ctypes
import errno
import os
import uuid

import pytest

from mtflow.tools import cgroup, seccomp

from .sandbox_util import KINDS, assert_nothing_survives, run

kinds = pytest.mark.parametrize('kind', KINDS)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
SESSION, USER = -3, -4  # KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING


def _nr(name: str) -> int:
    import pyseccomp
    return int(pyseccomp.resolve_syscall(pyseccomp.system_arch(), name))


def add_key(description: str, payload: bytes, keyring: int) -> int:
    """A key in ``keyring``; made in the session keyring (so the driver possesses it) and linked."""
    key = _libc.syscall(ctypes.c_long(_nr('add_key')), b'user', description.encode(), payload,
                        ctypes.c_size_t(len(payload)), ctypes.c_int(SESSION))
    if key < 0:
        pytest.skip(f'kernel keyrings are not available here (errno {ctypes.get_errno()})')
    _libc.syscall(ctypes.c_long(_nr('keyctl')), ctypes.c_long(5), ctypes.c_int(key), ctypes.c_uint(0x3f3f0000))
    if keyring != SESSION:
        assert _libc.syscall(ctypes.c_long(_nr('keyctl')), ctypes.c_long(8), ctypes.c_int(key),
                             ctypes.c_int(keyring)) == 0, ctypes.get_errno()
    return key


def read_key(key: int) -> bytes:
    buf = ctypes.create_string_buffer(4096)
    n = _libc.syscall(ctypes.c_long(_nr('keyctl')), ctypes.c_long(11), ctypes.c_int(key), buf, ctypes.c_size_t(4096))
    assert n >= 0, f'the driver cannot read its own key {key} (errno {ctypes.get_errno()})'
    return buf.raw[:n]


def keyring_ids(keyring: int) -> list:
    raw = read_key(_libc.syscall(ctypes.c_long(_nr('keyctl')), ctypes.c_long(0), ctypes.c_int(keyring),
                                 ctypes.c_int(1)))
    return [int.from_bytes(raw[i:i + 4], 'little') for i in range(0, len(raw), 4)]


def unlink_key(key: int, keyring: int) -> None:
    _libc.syscall(ctypes.c_long(_nr('keyctl')), ctypes.c_long(9), ctypes.c_int(key), ctypes.c_int(keyring))


#: the program: every key operation of the issue's attack, through raw syscalls (no keyutils)
_KEY_ATTACK = '''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ADD_KEY, KEYCTL, REQUEST_KEY = {add_key}, {keyctl}, {request_key}
def errno_of(r):
    return "ok %d" % r if r >= 0 else "errno %d" % ctypes.get_errno()
buf = ctypes.create_string_buffer(4096)
for name, ring in (("session", -3), ("user", -4), ("user-session", -5)):
    found = libc.syscall(KEYCTL, 10, ctypes.c_int(ring), b"user", {desc!r}.encode(), 0)  # SEARCH
    print("search", name, errno_of(found))
    print("read", name, errno_of(libc.syscall(KEYCTL, 11, ctypes.c_int(found if found > 0 else {key}), buf, 4096)))
print("read by id", errno_of(libc.syscall(KEYCTL, 11, ctypes.c_int({key}), buf, 4096)))
print("overwrite", errno_of(libc.syscall(KEYCTL, 2, ctypes.c_int({key}), b"pwned", 5)))  # UPDATE
for ring in (-3, -4, -5):
    print("plant", ring, errno_of(libc.syscall(ADD_KEY, b"user", {planted!r}.encode(), b"msg", 3, ctypes.c_int(ring))))
print("request", errno_of(libc.syscall(REQUEST_KEY, b"user", {desc!r}.encode(), None, ctypes.c_int(-3))))
print("join", errno_of(libc.syscall(KEYCTL, 1, None)))
print("secret" if buf.raw.startswith({secret!r}.encode()) else "no secret")
'''


@kinds
def test_kernel_keyrings_are_out_of_reach(kind):
    secret, desc, planted = (f'mtflow-{uuid.uuid4().hex}' for _ in range(3))
    session_key = add_key(desc, secret.encode(), SESSION)
    user_key = add_key(desc + '-user', secret.encode(), USER)
    try:
        before = sorted(keyring_ids(SESSION))
        code = _KEY_ATTACK.format(add_key=_nr('add_key'), keyctl=_nr('keyctl'), request_key=_nr('request_key'),
                                  desc=desc, key=session_key, planted=planted, secret=secret)
        first = run(code, kind)
        second = run(code.replace(f'ctypes.c_int({session_key})', f'ctypes.c_int({user_key})'), kind)
        for r in (first, second):
            assert r.error_kind == '', r.output
            lines = r.output.splitlines()
            assert lines[-1] == 'no secret' and secret not in r.output
            denied = [line for line in lines[:-1] if not line.endswith(f'errno {errno.EPERM}')]
            assert denied == [], f'key syscalls that were not denied: {denied}'
            assert_nothing_survives(r)
        # on the host: the driver's keys unchanged, nothing planted in its keyrings or anywhere visible
        assert read_key(session_key) == secret.encode() and read_key(user_key) == secret.encode()
        assert sorted(keyring_ids(SESSION)) == before
        with open('/proc/keys', encoding='utf-8') as f:
            assert planted not in f.read()
    finally:
        unlink_key(session_key, SESSION)
        unlink_key(user_key, USER)
        unlink_key(user_key, SESSION)


def test_each_sandbox_starts_in_a_fresh_session_keyring():
    """Even unconfined (``isolation: none``, no filter), a call's session keyring is a new one:
    the driver's session key is not found in it, and two calls do not share one."""
    secret, desc = f'mtflow-{uuid.uuid4().hex}', f'mtflow-{uuid.uuid4().hex}'
    key = add_key(desc, secret.encode(), SESSION)
    try:
        code = (f'import ctypes\nl = ctypes.CDLL(None, use_errno=True)\nl.syscall.restype = ctypes.c_long\n'
                f'print(l.syscall({_nr("keyctl")}, 0, ctypes.c_int(-3), 0), '
                f'l.syscall({_nr("keyctl")}, 10, ctypes.c_int(-3), b"user", {desc!r}.encode(), 0), ctypes.get_errno())')
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            import asyncio
            from mtflow.tools.sandbox import run_python
            outs = [asyncio.run(run_python(code, isolation='none')).output.split() for _ in range(2)]
        mine = _libc.syscall(ctypes.c_long(_nr('keyctl')), ctypes.c_long(0), ctypes.c_int(SESSION), ctypes.c_int(0))
        for ring, found, err in outs:
            assert found == '-1' and int(err) == errno.ENOKEY, outs
            assert int(ring) != mine
        assert outs[0][0] != outs[1][0], 'two calls shared a session keyring'
        assert read_key(key) == secret.encode()
    finally:
        unlink_key(key, SESSION)


_DENIED_PROGRAM = r'''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(name, nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    print(name, "ok" if r >= 0 else "errno %d" % ctypes.get_errno())
NR = {nrs!r}
call("ptrace_attach_pid1", NR["ptrace"], 16, 1, 0, 0)        # PTRACE_ATTACH to the namespace's PID 1
call("ptrace_traceme", NR["ptrace"], 0, 0, 0, 0)
call("process_vm_readv", NR["process_vm_readv"], 1, 0, 0, 0, 0, 0)
call("unshare_user", NR["unshare"], 0x10000000)
call("unshare_mount", NR["unshare"], 0x00020000)
call("clone_newuser", NR["clone"], 0x10000000 | 17, 0, 0, 0, 0)
call("setns", NR["setns"], 0, 0)
call("mount", NR["mount"], 0, 0, 0, 0, 0)
call("bpf", NR["bpf"], 0, 0, 0)
call("perf_event_open", NR["perf_event_open"], 0, 0, -1, -1, 0)
call("userfaultfd", NR["userfaultfd"], 0)
call("io_uring_setup", NR["io_uring_setup"], 8, 0)
call("inotify_init1", NR["inotify_init1"], 0)
call("kexec_load", NR["kexec_load"], 0, 0, 0, 0)
call("init_module", NR["init_module"], 0, 0, 0)
call("pivot_root", NR["pivot_root"], 0, 0)
import threading, subprocess, sys
t = threading.Thread(target=lambda: print("thread ok")); t.start(); t.join()
print("child", subprocess.run([sys.executable, "-c", "print(7)"], capture_output=True).stdout.strip())
'''

_NAMES = ('ptrace', 'process_vm_readv', 'unshare', 'clone', 'setns', 'mount', 'bpf', 'perf_event_open', 'userfaultfd',
          'io_uring_setup', 'inotify_init1', 'kexec_load', 'init_module', 'pivot_root')


@kinds
def test_the_seccomp_filter_denies_tracing_namespaces_and_kernel_interfaces(kind):
    r = run(_DENIED_PROGRAM.format(nrs={n: _nr(n) for n in _NAMES}), kind)
    assert r.error_kind == '', r.output
    lines = r.output.splitlines()
    assert lines[-2:] == ['thread ok', "child b'7'"]  # threads and processes still work
    allowed = [line for line in lines[:-2] if not line.endswith(f'errno {errno.EPERM}')]
    assert allowed == [], f'not denied: {allowed}'
    assert_nothing_survives(r)


@kinds
def test_a_program_that_catches_sigxcpu_is_a_timeout(kind):
    code = 'import signal\nsignal.signal(signal.SIGXCPU, lambda *a: None)\nprint("caught", flush=True)\nwhile True: pass'
    r = run(code, kind, timeout_s=60, cpu_s=1)
    assert r.error_kind == 'timeout' and not r.timed_out, (r.signal, r.usage, r.output)
    assert r.headline() == 'TimeoutError: CPU time limit exceeded'
    assert_nothing_survives(r)


def _cgroups_or_skip() -> None:
    sup = cgroup.support()
    if not sup.version:
        pytest.skip(sup.describe())


#: 64 memfds of 15 MB each (under RLIMIT_FSIZE and RLIMIT_NOFILE): 960 MB that no process maps,
#: invisible to RLIMIT_AS and to the OOM killer's view of resident memory
_MEMFD_HOG = '''
import os
held, chunk = 0, b"x" * (1 << 20)
fds = []
for n in range(60):
    fds.append(os.memfd_create("hog%d" % n))
    for _ in range(15):
        os.write(fds[-1], chunk)
        held += 1
    print("held", held, flush=True)
print("held all", held)
'''


@kinds
def test_memfd_memory_is_bounded_by_the_calls_cgroup(kind):
    _cgroups_or_skip()
    r = run(_MEMFD_HOG, kind, memory_mb=128)
    assert r.error_kind == 'memory' and r.oom_killed, (r.error_kind, r.output[-300:])
    assert 'held all' not in r.output
    held = [int(line.split()[1]) for line in r.output.splitlines() if line.startswith('held ')]
    assert held and max(held) <= 128, held
    assert r.usage['memory_peak_mb'] <= 128.5  # the host-side figure: the cgroup's own peak
    assert r.headline().startswith('MemoryError: the call ran out of memory (limit 128 MB')
    assert_nothing_survives(r)


_FILE_FLOOD = '''
import os
n = 0
try:
    while n < 2000000:
        open("f%d" % n, "w").close()
        n += 1
except OSError as exc:
    print("stopped", n, exc.errno, flush=True)
'''


@kinds
def test_a_flood_of_empty_files_is_bounded(kind):
    """The inodes and dentries are kernel memory: the call's cgroup counts them (and the unshare
    fallback's /tmp has an ``nr_inodes`` cap too), so a flood ends at ``memory_mb``."""
    _cgroups_or_skip()
    r = run(_FILE_FLOOD, kind, memory_mb=64, tmp_mb=64)
    assert r.error_kind in ('memory', ''), (r.error_kind, r.output)
    if r.error_kind == '':  # the inode cap ended it first (ENOSPC)
        assert r.output.startswith('stopped') and int(r.output.split()[2]) == errno.ENOSPC
        assert int(r.output.split()[1]) <= 64 * 256
    assert r.usage['memory_peak_mb'] <= 64.5
    assert_nothing_survives(r)


@kinds
def test_usage_of_the_call_is_reported(kind):
    _cgroups_or_skip()
    r = run('x = bytearray(40 << 20)\nsum(range(3_000_000))\nprint("ok")', kind, memory_mb=256)
    assert r.error_kind == '' and r.output == 'ok\n'
    assert 40 <= r.usage['memory_peak_mb'] <= 256 and r.usage['cpu_s'] > 0


@kinds
def test_root_and_dev_are_read_only_and_dev_shm_is_the_calls_own(kind):
    code = ('import os\nfor d in ["/", "/dev", "/dev/shm", "/usr", "/tmp"]:\n    try:\n'
            '        open(os.path.join(d, "mtflow-w"), "w").close()\n        print("writable", d)\n'
            '    except OSError as e:\n        print("denied", d)\n')
    r = run(code, kind)
    assert r.output.split('\n')[:5] == ['denied /', 'denied /dev', 'writable /dev/shm', 'denied /usr', 'writable /tmp']
    assert_nothing_survives(r)


def test_the_filter_is_built_with_libseccomp():
    bpf = seccomp.filter_bpf()
    assert len(bpf) % 8 == 0 and len(bpf) // 8 > len(seccomp.DENIED) // 2


def test_the_calls_usage_reaches_trace_info():
    _cgroups_or_skip()
    import asyncio

    from mtflow.tools import ToolRunner, tool_from_callable
    from mtflow.tools.sandbox import make_python_tool
    runner = ToolRunner([tool_from_callable(make_python_tool({'timeout_s': 30, 'warm_pool': 0}), 'python')])
    try:
        ok, bad = asyncio.run(runner.call_all([('python', {'code': 'x = bytearray(30 << 20)\nprint(1)'}),
                                               ('python', {'code': '1/0'})]))
    finally:
        runner.close()
    for r in (ok, bad):
        info = r.to_info()
        assert set(info['usage']) == {'memory_peak_mb', 'cpu_s'} and info['usage']['cpu_s'] > 0, info
    assert ok.output == '1\n' and ok.to_info()['usage']['memory_peak_mb'] >= 30
    assert bad.to_info()['error_kind'] == 'exit'


def test_the_load_time_report_names_the_filter_and_the_cgroup():
    from mtflow.tools import isolation
    iso = isolation.resolve_isolation('auto')
    if not iso.available:
        pytest.skip(iso.detail)
    text = iso.describe()
    assert 'seccomp filter (' in text and cgroup.support().describe() in text


def test_cgroup_v2_files_on_a_fake_hierarchy(tmp_path, monkeypatch):
    """This host (and CI) has cgroup v1 controllers; the v2 protocol is checked on plain files laid
    out like a delegated v2 group: the limits written, the usage and the OOM kill read back."""
    parent = tmp_path / 'delegated'
    parent.mkdir()
    (parent / 'cgroup.controllers').write_text('cpuset cpu io memory pids\n')
    (parent / 'cgroup.subtree_control').write_text('')
    monkeypatch.setattr(cgroup, '_own_paths', lambda: {'': '/delegated'})
    monkeypatch.setattr(cgroup, '_mounts', lambda: {'': (str(tmp_path), '/')})
    sup = cgroup._probe()
    assert (sup.version, sup.parents, sup.cpu) == (2, {'': str(parent)}, True), sup.detail
    assert (parent / 'cgroup.subtree_control').read_text() == '+memory +pids +cpu'
    group = cgroup.CallCgroup.create(sup, 96, 11, cpu_cores=0.25)
    d = group.dirs['']
    assert [open(os.path.join(d, n)).read() for n in ('memory.max', 'memory.swap.max', 'pids.max', 'cpu.max')] == \
        [str(96 << 20), '0', '11', '25000 100000']
    assert group.procs_files() == [os.path.join(d, 'cgroup.procs')]
    with open(os.path.join(d, 'memory.peak'), 'w') as f:
        f.write(str(50 << 20))
    with open(os.path.join(d, 'cpu.stat'), 'w') as f:
        f.write('usage_usec 1500000\nuser_usec 1000000\n')
    with open(os.path.join(d, 'memory.events'), 'w') as f:
        f.write('low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n')
    assert (group.peak_mb(), group.cpu_s(), group.oom_killed()) == (50.0, 1.5, True)
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    group.remove()
    assert not os.path.exists(d)
    # no cpu controller: groups without a CPU bound, said at load time
    (parent / 'cgroup.controllers').write_text('io memory pids\n')
    (parent / 'cgroup.subtree_control').write_text('')
    sup = cgroup._probe()
    assert (sup.version, sup.cpu) == (2, False) and (parent / 'cgroup.subtree_control').read_text() == '+memory +pids'
    assert 'no CPU bound (the cpu controller is not available here)' in sup.describe()
    # cpu listed but not to be enabled for children (not delegated): the others, without a CPU bound
    (parent / 'cgroup.controllers').write_text('cpu io memory pids\n')
    for enabled in ('', '+memory +pids'):
        (parent / 'cgroup.subtree_control').write_text(enabled)
        real_write = cgroup._write

        def refuse_cpu(d, name, value, optional=False):
            if name == 'cgroup.subtree_control' and 'cpu' in str(value):
                raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
            real_write(d, name, value, optional)
        monkeypatch.setattr(cgroup, '_write', refuse_cpu)
        sup = cgroup._probe()
        monkeypatch.setattr(cgroup, '_write', real_write)
        assert (sup.version, sup.cpu) == (2, False), sup
        assert 'no CPU bound (cannot enable cpu for child groups' in sup.describe()
        assert (parent / 'cgroup.subtree_control').read_text() == '+memory +pids'
    # a v2 group whose controllers cannot be given to children: said at load time, v1 not tried
    (parent / 'cgroup.controllers').write_text('cpu io\n')
    sup = cgroup._probe()
    assert sup.version == 0 and "controllers ['memory', 'pids'] not available" in sup.detail
    assert sup.describe().startswith('no cgroup per call (')
    assert sup.describe().endswith('rlimits only, no CPU bound (cpu_cores)')


def test_stale_groups_of_another_pid_namespace_are_not_removed(tmp_path):
    """A parent group shared with a driver in another container (another PID namespace, whose pids
    this /proc does not show): its calls' groups are never taken for a dead driver's."""
    ours, other = cgroup._PID_NS, str(int(cgroup._PID_NS) + 1)
    dead = 4_000_000_000  # above any pid_max
    names = {f'mtflow-sbx-{dead}-1-abcdef-ns{other}': True, f'mtflow-sbx-{dead}-2-abcdef-ns{ours}': False,
             f'mtflow-sbx-{dead}-3-abcdef': False, f'mtflow-sbx-{os.getpid()}-4-abcdef-ns{ours}': True}
    for name in names:
        (tmp_path / name).mkdir()
    cgroup._remove_stale({'memory': str(tmp_path)})
    assert {n: (tmp_path / n).exists() for n in names} == names
    (tmp_path / 'm').mkdir()
    group = cgroup.CallCgroup.create(cgroup.CgroupSupport(1, {'memory': str(tmp_path / 'm'), 'pids': str(tmp_path)}),
                                     64, 8)
    assert os.path.basename(group.dirs['pids']).endswith(f'-ns{ours}')
    for d in group.dirs.values():
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
    group.remove()


#: what the program sees of the kernel's key lists (masked: both empty)
_PROC_KEYS = 'for p in ("/proc/keys", "/proc/key-users"):\n    print(p, len(open(p).read()))'


@kinds
def test_proc_keys_and_key_users_are_masked(kind):
    desc = f'mtflow-{uuid.uuid4().hex}'
    key = add_key(desc, b'payload', SESSION)
    try:
        r = run(_PROC_KEYS, kind)
    finally:
        unlink_key(key, SESSION)
    assert r.output.splitlines() == ['/proc/keys 0', '/proc/key-users 0'], r.output
    assert desc not in r.output
