"""A CPU bound per call (issue 39, item 10): where this process can make a group of the CPU
controller, each call's processes share one group, so one scheduling weight however many processes
and sessions it starts (a new session no longer gets an autogroup of its own), and ``cpu_cores``
of CPU bandwidth (the group's quota per period). Checked on the host while the call runs (the
group's quota, its tasks, its CPU time), through a YAML scheduler's ``python`` tool. Without such a
group (rootless here) the load-time report says there is no CPU bound. The effect on a neighbour's
latency is a figure, not a test: ``benchmarks/sandbox.py --neighbour`` and docs/benchmarks.md."""
from __future__ import annotations

import asyncio
import os
import subprocess
import textwrap

import pytest

from mtflow.declarative import load_scheduler
from mtflow.tools import cgroup
from mtflow.tools.sandbox import check_python_options

from .sandbox_util import KINDS, HostSampler, as_uid, require, unprivileged_uid

#: four processes, each in a session of its own (each would have had an autogroup of its own),
#: spinning for 3 s of wall time, then the CPU time each got
SPINNERS = textwrap.dedent('''
    import os, time
    kids = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            os.setsid()
            end = time.monotonic() + 3
            while time.monotonic() < end:
                pass
            os._exit(0)
        kids.append(pid)
    for pid in kids:
        os.waitpid(pid, 0)
    print("spun", len(kids))
''')

CORES = 0.1


class CallGroups(HostSampler):
    """Samples, from the host, the CPU groups this process makes for its calls: the quota each
    was given and the most tasks each held at once."""

    every_s = 0.02

    def __init__(self) -> None:
        sup = cgroup.support()
        self.v1 = sup.version == 1
        self.parent = sup.parents.get('cpu' if self.v1 else '')
        self.prefix = f'mtflow-sbx-{os.getpid()}-'
        self.quota: dict = {}
        self.tasks: dict = {}

    def _read(self, group: str, name: str) -> str:
        with open(os.path.join(self.parent, group, name), encoding='ascii') as f:
            return f.read()

    def sample(self) -> None:
        for group in [n for n in os.listdir(self.parent) if n.startswith(self.prefix)]:
            try:
                quota = self._read(group, 'cpu.cfs_quota_us' if self.v1 else 'cpu.max').split()[0]
                tasks = len(self._read(group, 'cgroup.procs').split())
            except OSError:  # removed after its call
                continue
            self.quota[group] = quota
            self.tasks[group] = max(self.tasks.get(group, 0), tasks)


@pytest.mark.parametrize('kind', KINDS)
def test_a_call_with_many_sessions_stays_within_its_cpu_cores(kind):
    require(kind)
    sup = cgroup.support()
    if not sup.cpu:
        pytest.skip(sup.describe())
    scheduler = load_scheduler({'name': 'cpu', 'tools': [{'name': 'python', 'timeout_s': 120, 'options': {
        'isolation': kind, 'timeout_s': 90, 'cpu_cores': CORES, 'warm_pool': 0}}]})
    try:
        with CallGroups() as groups:
            result, = asyncio.run(scheduler.runner.call_all([('python', {'code': SPINNERS})]))
    finally:
        scheduler.close()
    assert result.ok and result.output == 'spun 4\n', result.error
    # the quota the call's group had on the host (other groups of this process: warm pools of
    # earlier tests, with the default quota)
    group, = [g for g, quota in groups.quota.items() if quota == str(round(CORES * cgroup.CPU_PERIOD_US))]
    # the program, its 4 spinners (in sessions of their own), PID 1, bwrap/unshare: one group
    assert groups.tasks[group] >= 5, groups.tasks
    # CPU time within the quota: one period's worth and a scheduler tick per CPU beyond it at most
    # (a bound the kernel keeps, whatever the load; unbounded, 4 spinners take up to 4 x 3 s)
    assert result.usage['cpu_s'] <= CORES * result.duration_s + 0.05, (result.usage, result.duration_s)
    assert not os.path.exists(os.path.join(groups.parent, group))  # removed after the call


def test_cpu_cores_is_an_option_and_null_means_no_quota():
    assert check_python_options({'cpu_cores': 0.5})['cpu_cores'] == 0.5
    assert check_python_options({'cpu_cores': None})['cpu_cores'] is None
    assert check_python_options({'cpu_cores': 2})['cpu_cores'] == 2


def test_cpu_groups_of_a_co_mounted_hierarchy_are_made_once(tmp_path, monkeypatch):
    """cgroup v1 with ``cpu,cpuacct`` mounted together (most distributions): one directory for both,
    the quota written once, its ``cgroup.procs`` joined once."""
    for name in ('memory', 'pids', 'cpu,cpuacct'):
        (tmp_path / name).mkdir()
    parents = {'memory': str(tmp_path / 'memory'), 'pids': str(tmp_path / 'pids'),
               'cpuacct': str(tmp_path / 'cpu,cpuacct'), 'cpu': str(tmp_path / 'cpu,cpuacct')}
    group = cgroup.CallCgroup.create(cgroup.CgroupSupport(1, parents, cpu=True), 64, 8, cpu_cores=0.5)
    try:
        assert group.dirs['cpu'] == group.dirs['cpuacct'] and len(group.procs_files()) == 3
        with open(os.path.join(group.dirs['cpu'], 'cpu.cfs_quota_us'), encoding='ascii') as f:
            assert f.read() == str(cgroup.CPU_PERIOD_US // 2)
    finally:
        for d in set(group.dirs.values()):
            for name in os.listdir(d):
                os.unlink(os.path.join(d, name))
        group.remove()
    assert os.listdir(tmp_path / 'cpu,cpuacct') == []


_ROOTLESS = textwrap.dedent('''
    import asyncio, sys
    from mtflow.tools import isolation
    from mtflow.tools.sandbox import run_python
    r = asyncio.run(run_python("print(6 * 7)", isolation="bwrap", timeout_s=60, cpu_cores=0.1))
    print(r.error_kind or "ok", r.output.strip())
    print(isolation.resolve_isolation("bwrap").describe())
''')


def test_rootless_there_is_no_cpu_bound_and_the_report_says_so():
    with unprivileged_uid() as (uid, exe, env):
        proc = subprocess.run(as_uid(uid) + [exe, '-c', _ROOTLESS], env=env, capture_output=True, text=True,
                              timeout=300, cwd='/')
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == 'ok 42', proc.stdout
    assert 'no cgroup per call (' in lines[1] and 'no CPU bound (cpu_cores)' in lines[1], lines[1]
