"""Each call's own writable ``/dev/shm`` (issue 39, item 9): a ``tmpfs`` of ``shm_mb``, inside the
call's memory bound, so ``multiprocessing.Pool``, ``Queue`` and ``shared_memory`` work as on any
machine; full at ``shm_mb``; nothing of it reaches the host's ``/dev/shm`` or the next call."""
from __future__ import annotations

import os
import subprocess
import textwrap
import uuid

import pytest

from mtflow.tools import cgroup
from mtflow.tools.sandbox import check_python_options

from .sandbox_util import KINDS, as_uid, assert_nothing_survives, normal_user, run, run_as, unprivileged_uid

kinds = pytest.mark.parametrize('kind', KINDS)

#: Pool with functions the program defines (pickled by name from its __main__), a Queue between
#: processes, shared_memory, then /dev/shm filled to its bound
PROGRAM = textwrap.dedent('''
    import multiprocessing as mp, os, sys
    from multiprocessing import shared_memory
    def square(x):
        return x * x
    def produce(q):
        q.put(sum(range(10)))
    if __name__ == "__main__":
        with mp.Pool(2) as pool:
            print("pool", sum(pool.map(square, range(100))))
        q = mp.Queue()
        p = mp.Process(target=produce, args=(q,))
        p.start()
        print("queue", q.get(timeout=20))
        p.join()
        shm = shared_memory.SharedMemory(create=True, size=1 << 20)
        shm.buf[:5] = b"hello"
        other = shared_memory.SharedMemory(shm.name)
        print("shared_memory", bytes(other.buf[:5]).decode())
        other.close()
        shm.close()
        shm.unlink()
        st = os.statvfs("/dev/shm")
        print("size_mb", st.f_blocks * st.f_frsize >> 20)
        print("leftover", os.listdir("/dev/shm"))
        open("/dev/shm/{marker}", "w").write("x")
        written = 0
        try:
            with open("/dev/shm/fill", "wb") as f:
                while written < 64:
                    f.write(b"x" * (1 << 20))
                    f.flush()
                    written += 1
        except OSError as e:
            print("full", e.errno, written < {shm_mb})
''')


def _expected(shm_mb: int):
    return ['pool 328350', 'queue 45', 'shared_memory hello', f'size_mb {shm_mb}', 'leftover []', 'full 28 True']


def _host_shm() -> set:
    return set(os.listdir('/dev/shm'))


@kinds
def test_multiprocessing_works_in_a_private_bounded_dev_shm(kind):
    marker = 'mtflow-' + uuid.uuid4().hex
    before = _host_shm()
    r = run(PROGRAM.format(marker=marker, shm_mb=8), kind, shm_mb=8, memory_mb=256)
    assert r.error_kind == '', r.output
    assert r.output.splitlines() == _expected(8)
    assert marker not in _host_shm() and not {n for n in _host_shm() - before if n.startswith(('sem.', 'psm_'))}
    if cgroup.support().version:  # the call's cgroup counted the tmpfs pages
        assert r.usage['memory_peak_mb'] >= 7, r.usage
    again = run(f'import os\nprint(os.listdir("/dev/shm"))', kind)
    assert again.output == '[]\n'  # the next call's /dev/shm is its own
    assert_nothing_survives(r)


def test_shm_mb_is_an_option_inside_memory_mb():
    assert check_python_options({'shm_mb': 32})['shm_mb'] == 32
    with pytest.raises(ValueError, match="'shm_mb' \\(600\\) must not exceed memory_mb \\(512\\)"):
        check_python_options({'shm_mb': 600})
    with pytest.raises(ValueError, match="'shm_mb' must be at least 1"):
        check_python_options({'shm_mb': 0})


ROOTLESS = textwrap.dedent('''
    import asyncio, sys
    from mtflow.tools.sandbox import run_python
    r = asyncio.run(run_python(sys.argv[1], isolation="bwrap", timeout_s=60, shm_mb=8, memory_mb=256))
    print(r.error_kind or "ok")
    print(r.output.rstrip())
''')


def test_rootless_multiprocessing_works_in_a_private_bounded_dev_shm():
    marker = 'mtflow-' + uuid.uuid4().hex
    with unprivileged_uid() as (uid, exe, env):
        before = _host_shm()
        proc = subprocess.run(as_uid(uid) + [exe, '-c', ROOTLESS, PROGRAM.format(marker=marker, shm_mb=8)], env=env,
                              capture_output=True, text=True, timeout=300, cwd='/')
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ['ok'] + _expected(8), proc.stdout
    assert marker not in _host_shm() and _host_shm() - before == set()


#: issue 52, 6: a Pool and a Process on a function the program defines, with every start method.
#: spawn and forkserver start a fresh interpreter, which finds the function by running the
#: program's file again as __mp_main__ (the reason for the __main__ guard): the launcher tells
#: multiprocessing where that file is (/tmp/main.py). Without it, their workers died at once and
#: the Pool waited for them to the timeout.
START_METHODS = textwrap.dedent('''
    import multiprocessing as mp
    def square(x):
        return x * x
    def put(q, method):
        q.put(method)
    if __name__ == "__main__":
        for method in ("fork", "spawn", "forkserver"):
            ctx = mp.get_context(method)
            with ctx.Pool(2) as pool:
                total = sum(pool.map(square, range(10)))
            q = ctx.Queue()
            p = ctx.Process(target=put, args=(q, method))
            p.start()
            print(method, total, q.get(timeout=20), flush=True)
            p.join()
''')
START_METHODS_EXPECTED = ['fork 285 fork', 'spawn 285 spawn', 'forkserver 285 forkserver']


@kinds
def test_every_start_method_runs_the_programs_own_functions(kind):
    r = run(START_METHODS, kind, memory_mb=256, timeout_s=60)
    assert (r.error_kind, r.output.splitlines()) == ('', START_METHODS_EXPECTED), r.output
    assert_nothing_survives(r)


def test_rootless_every_start_method_runs_the_programs_own_functions():
    with normal_user() as (uid, exe, env):
        out = run_as(uid, exe, env, ROOTLESS.replace('shm_mb=8, memory_mb=256', 'memory_mb=256'), START_METHODS)
    assert out.splitlines() == ['ok'] + START_METHODS_EXPECTED, out
