"""Adversarial programs in the ``python`` tool's sandbox, with each isolation tool that works
here (bubblewrap, and the unshare fallback). Every test checks the host afterwards, not only the
tool's reply: no process of the call survives it, no file appeared, no connection arrived, the
rollout process and a sentinel process are alive, no secret reached the output."""
from __future__ import annotations

import asyncio
import os
import select
import socket
import subprocess
import sys
import time
import uuid

import pytest

from mtflow.tools import ToolRunner, isolation, tool_from_callable
from mtflow.tools.sandbox import make_python_tool, run_python

from .sandbox_util import (BOUNDED_FORKS, KINDS, assert_nothing_survives, processes_in_pid_namespace, processes_with,
                           require, run)

pytestmark = pytest.mark.parametrize('kind', KINDS)


def token() -> str:
    return 'mtflow-' + uuid.uuid4().hex


def test_benign_program_returns_its_output(kind):
    r = run('import sys\nprint("out")\nprint("err", file=sys.stderr)\nprint(sum(range(10)))', kind)
    assert (r.output, r.returncode, r.error_kind, r.isolation) == ('out\nerr\n45\n', 0, '', kind)
    assert_nothing_survives(r)


def test_infinite_loop_is_a_timeout(kind):
    r = run('print("looping", flush=True)\nwhile True: pass', kind, timeout_s=5)
    assert r.error_kind == 'timeout' and r.timed_out and r.output.startswith('looping')
    assert r.as_observation().endswith('TimeoutError: execution timed out after 5 s')
    assert_nothing_survives(r)


def test_cpu_time_limit_is_a_timeout(kind):
    r = run('while True: pass', kind, timeout_s=60, cpu_s=1)
    assert r.error_kind == 'timeout' and not r.timed_out and r.headline() == 'TimeoutError: CPU time limit exceeded'
    assert_nothing_survives(r)


_FORK_BOMB = '''
import os
told = False
while True:
    try:
        os.fork()
    except OSError:
        if not told:
            print("limit hit", flush=True)
            told = True
'''


def test_fork_bomb_is_stopped_by_the_process_limit(kind):
    # first a bounded program shows the limit binds in this sandbox; only then the real bomb
    probe = run(BOUNDED_FORKS, kind, max_processes=8, timeout_s=20)
    assert probe.output.split() == ['7', '33'], probe.output  # 7 children + the program itself = 8
    assert_nothing_survives(probe)
    r = run(_FORK_BOMB, kind, max_processes=8, timeout_s=5)
    assert r.error_kind == 'timeout' and 'limit hit' in r.output
    assert_nothing_survives(r)


def test_memory_bomb_is_a_memory_error(kind):
    r = run('blocks = []\nwhile True:\n    blocks.append(bytearray(16 * 1024 * 1024))', kind, memory_mb=128)
    assert r.error_kind == 'memory' and 'MemoryError' in r.output
    assert r.headline() == 'MemoryError: out of memory (limit 128 MB)'
    assert_nothing_survives(r)


def test_writes_outside_its_directory_reach_nothing(kind, tmp_path):
    name = token()
    host_targets = [f'/tmp/{name}', str(tmp_path / name), f'/usr/{name}', os.path.join(os.getcwd(), name),
                    os.path.expanduser(f'~/{name}')]
    code = (f'import os\nfor path in {host_targets!r}:\n'
            '    try:\n        open(path, "w").write("x")\n        print("wrote", path)\n'
            '    except OSError as exc:\n        print("refused", path, type(exc).__name__)\n'
            'open("here.txt", "w").write("mine")\nprint(sorted(os.listdir(".")), os.getcwd())')
    r = run(code, kind)
    assert r.error_kind == ''
    # /tmp is the sandbox's own tmpfs: the write succeeds there and never reaches the host's /tmp
    assert f'wrote /tmp/{name}' in r.output
    for path in host_targets[1:]:
        assert f'refused {path}' in r.output
    assert "['here.txt', 'main.py'" in r.output
    for path in host_targets:
        assert not os.path.exists(path), f'{path} appeared on the host'
    assert_nothing_survives(r)


def test_secrets_of_the_parent_home_and_project_are_out_of_reach(kind, monkeypatch, tmp_path):
    require(kind)
    secret = token()
    monkeypatch.setenv('MTFLOW_TEST_SECRET', secret)
    # the secret is planted in the driver's home and working directory (the project); where whoever
    # runs the tests cannot write there (another user's checkout, HOME=/), a fresh directory stands in
    if not os.access(os.getcwd(), os.W_OK):
        (tmp_path / 'project').mkdir()
        monkeypatch.chdir(tmp_path / 'project')
    if not os.access(os.path.expanduser('~'), os.W_OK):
        (tmp_path / 'home').mkdir()
        monkeypatch.setenv('HOME', str(tmp_path / 'home'))
    home_file = os.path.expanduser(f'~/.{token()}')
    project_file = os.path.join(os.getcwd(), f'.{token()}')
    planted = []
    code = f'''
import glob, os
print(sorted(os.environ))
for path in ["/proc/self/environ", "/proc/%d/environ" % os.getppid(), "/proc/1/environ", {home_file!r},
             {project_file!r}] + glob.glob("/proc/*/environ"):
    try:
        print(path, open(path, "rb").read().replace(b"\\0", b" ")[:200])
    except OSError as exc:
        print(path, type(exc).__name__)
for d in ["/root", {os.getcwd()!r}, "/home", "/etc", "/proc/{os.getpid()}"]:
    print(d, os.path.exists(d) and (os.listdir(d) if os.access(d, os.R_OK) else "unreadable"))
'''
    try:
        for path in (home_file, project_file):
            with open(path, 'w') as f:
                f.write(secret)
            planted.append(path)
        r = run(code, kind)
    finally:
        for path in planted:
            os.unlink(path)
    assert r.error_kind == '', r.output
    assert secret not in r.output
    # an empty environment (bwrap sets PWD for its --chdir, Python coerces the C locale)
    assert set(eval(r.output.splitlines()[0])) <= {'PWD', 'LC_CTYPE'}
    assert f'{home_file} FileNotFoundError' in r.output and f'{project_file} FileNotFoundError' in r.output
    assert f'{os.getcwd()} False' in r.output and '/etc False' in r.output
    assert_nothing_survives(r)


def test_no_network_even_to_loopback(kind):
    listener = socket.socket()
    listener.bind(('127.0.0.1', 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    try:
        code = (f'import socket\ntry:\n    s = socket.create_connection(("127.0.0.1", {port}), timeout=3)\n'
                '    s.sendall(b"exfiltrated")\n    print("connected")\nexcept OSError as exc:\n'
                '    print("no connection:", type(exc).__name__)\n'
                'print(open("/proc/net/dev").read().split("\\n")[2:])')
        r = run(code, kind)
        readable, _, _ = select.select([listener], [], [], 0.5)
        assert readable == [], 'the listener on 127.0.0.1 got a connection'
    finally:
        listener.close()
    assert 'no connection:' in r.output and 'connected\n' not in r.output
    assert "'    lo:" in r.output and r.output.count(':') >= 2  # only lo in the interface list
    assert_nothing_survives(r)


def test_background_and_detached_processes_die_with_the_call(kind):
    marker = token()
    code = f'''
import os, subprocess, sys
sleeper = [sys.executable, "-c", "import time; time.sleep(120)", {marker!r}]
subprocess.Popen(sleeper)                                  # a plain background child
subprocess.Popen(sleeper, start_new_session=True)          # a detached one
if os.fork() == 0:                                         # a double fork
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, sleeper)
    os._exit(0)
import time
time.sleep(0.5)
print("children:", len([p for p in os.listdir("/proc") if p.isdigit()]) - 1)
'''
    r = run(code, kind)
    assert r.error_kind == '' and 'children:' in r.output, r.output
    assert int(r.output.split()[-1]) >= 3
    assert_nothing_survives(r, marker)


def test_killing_its_parent_reaches_nothing_outside(kind):
    sentinel = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])
    try:
        code = f'''
import os, signal
for target in [os.getppid(), 1, {os.getpid()}, {sentinel.pid}, -1]:
    try:
        os.kill(target, signal.SIGKILL)
        print(target, "sent")
    except OSError as exc:
        print(target, type(exc).__name__)
print("still here")
'''
        r = run(code, kind)
        assert sentinel.poll() is None, 'the sandbox killed a host process'
    finally:
        sentinel.kill()
        sentinel.wait()
    # unshare: the program is PID 1 and its parent is outside (getppid() is 0: its own group); bwrap:
    # the parent is bwrap's init (another uid). Either way nothing outside was touched.
    assert r.error_kind in ('', 'killed'), r.output
    assert_nothing_survives(r)


def test_huge_stdout_is_cut_and_the_flood_stopped(kind):
    r = run('import sys\nwhile True: sys.stdout.write("y" * 65536)', kind, max_output_chars=100, timeout_s=30)
    assert r.error_kind == 'killed' and r.flooded and not r.timed_out and r.truncated
    assert r.output.startswith('y' * 100 + '\n... [output truncated:')
    assert_nothing_survives(r)
    once = run('print("x" * 10000)', kind, max_output_chars=100)
    assert once.error_kind == '' and once.truncated
    assert '[output truncated: 10001 bytes in total, 100 characters shown]' in once.output


#: issue 52, 5: 32 processes writing 1 MB at a time, so the output pipe is full again the moment
#: the driver reads it. The flood's kill made util-linux 2.38's unshare write ``sigprocmask
#: unblock failed`` about its killed child into that full pipe, which nobody read any more: the
#: call hung to its timeout and raised CancelledError out of the tool (3 of 8 calls here)
FULL_PIPE_FLOOD = 'import os\nfor _ in range(5):\n    os.fork()\nos.write(1, b"x" * (1 << 20))\n'


def test_a_flood_that_fills_the_pipe_ends_every_call_at_once(kind):
    require(kind)

    async def calls():
        out = []
        for _ in range(6):
            started = time.monotonic()
            r = await run_python(FULL_PIPE_FLOOD, isolation=kind, timeout_s=30, max_output_chars=100)
            out.append((r, time.monotonic() - started))
        return out

    for r, took in asyncio.run(calls()):
        assert (r.error_kind, r.flooded, r.timed_out) == ('killed', True, False), (r, took)
        assert r.output.startswith('x' * 100) and 'unshare' not in r.output
        assert_nothing_survives(r)


def test_an_outer_timeout_shorter_than_the_sandbox_kills_the_tree(kind):
    require(kind)
    marker = token()
    tool = tool_from_callable(make_python_tool({'timeout_s': 120, 'isolation': kind}), 'python', timeout_s=10.0)
    runner = ToolRunner([tool])
    code = (f'import subprocess, sys\nsubprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", '
            f'{marker!r}], start_new_session=True)\nprint("started", flush=True)\nwhile True: pass')

    async def call_and_watch():
        task = asyncio.ensure_future(runner.call_all([('python', {'code': code})]))
        seen = False
        while not task.done() and not seen:  # the detached child is alive while the call runs
            seen = bool(processes_with(marker))
            await asyncio.sleep(0.05)
        return seen, await task

    try:
        seen, [result] = asyncio.run(call_and_watch())
    finally:
        runner.close()
    assert seen, 'the program never started its child before the outer timeout'
    assert (result.ok, result.error_kind) == (False, 'timeout') and 'timed out after 10 s' in result.error
    assert processes_with(marker) == [], 'the cancelled call left its processes running'


# ---- warm pool: prepared sandboxes, each used for one program ----------------------------------
def _warm(kind, **options):
    require(kind)
    tool = make_python_tool({'isolation': kind, 'warm_pool': 2, **options})
    pool = tool.pool
    pool.start()
    deadline = time.monotonic() + 60
    while pool.ready() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.ready() == 2
    return tool, pool


def test_warm_sandboxes_run_one_program_each_and_contain_it(kind):
    tool, pool = _warm(kind, timeout_s=30)
    marker = token()
    code = (f'import os, subprocess, sys\nsubprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", '
            f'{marker!r}], start_new_session=True)\nprint(os.getuid(), os.readlink("/proc/self/ns/pid"), '
            'repr(sys.stdin.read()), sorted(os.environ))')

    async def calls():
        out = []
        for _ in range(3):
            out.append(await run_python(code, isolation=kind, timeout_s=30, pool=pool))
        return out

    try:
        results = asyncio.run(calls())
    finally:
        tool.close()
    # each program in a PID namespace of its own (and, as root, on a uid of its own)
    assert len({r.pid_namespace for r in results}) == 3, 'a sandbox was used for two programs'
    if not isolation.rootless():
        assert len({r.uid for r in results}) == 3, 'a sandbox was used for two programs'
    for r in results:
        inside_uid = isolation.ROOTLESS_UID if isolation.rootless() else r.uid  # rootless: nobody inside
        assert r.error_kind == '' and r.output.split()[:3] == [str(inside_uid), f'pid:[{r.pid_namespace}]', "''"], \
            r.output
        assert_nothing_survives(r, marker)
    assert pool.ready() == 0  # closed: the idle ones are torn down
    loop_r = asyncio.run(run_python('while True: pass', isolation=kind, timeout_s=30, cpu_s=1, pool=pool))
    assert loop_r.error_kind == 'timeout'  # a closed pool just gives nothing: the call starts its own
    assert_nothing_survives(loop_r)


def test_closing_a_pool_leaves_no_idle_sandbox(kind):
    tool, pool = _warm(kind)
    idle = list(pool._ready)
    deadline = time.monotonic() + 60
    while not all(sb.pid_namespace() for sb in idle) and time.monotonic() < deadline:
        time.sleep(0.05)  # an idle sandbox's launcher reports its PID namespace, then waits for its program
    namespaces = [(sb.pid_namespace(), sb.lease.uid if sb.lease else os.getuid()) for sb in idle]
    assert len(namespaces) == 2 and all(ns for ns, _ in namespaces), namespaces
    assert all(processes_in_pid_namespace(ns, uid) for ns, uid in namespaces)  # alive while idle
    tool.close()
    for ns, uid in namespaces:
        assert processes_in_pid_namespace(ns, uid) == []
        if not isolation.rootless():
            assert isolation.processes_of_uid(uid) == []
