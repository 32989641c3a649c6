"""A cgroup per sandboxed call, where the host lets this process make one.

Rlimits bound each process; a cgroup bounds the call: its memory counts what rlimits cannot see
(``memfd`` and ``tmpfs`` pages, page cache, and the kernel memory charged to it, such as the
inodes and dentries of a flood of empty files), with no swap; ``pids`` bounds its tasks whatever
uid they run as; ``cpu`` (where this process can make a group of it) gives the whole call one
scheduling weight, however many processes and sessions it starts, and its ``cpu_cores`` of CPU
bandwidth (a quota per period); and its peak memory and CPU time are read back for ``trace_info``.

Both hierarchies are supported:

- cgroup v2 (``memory.max``, ``memory.swap.max``, ``pids.max``, ``cpu.max``; ``memory.peak``,
  ``cpu.stat``, ``memory.events``), under this process's own cgroup when its
  ``cgroup.subtree_control`` has (or can be given) ``memory`` and ``pids`` (and ``cpu``, where it
  can): the root, or a delegated subtree (``systemd-run -p Delegate=yes``);
- cgroup v1 controllers (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes``, ``pids.max``,
  ``cpu.cfs_quota_us``; ``memory.max_usage_in_bytes``, ``cpuacct.usage``, ``memory.oom_control``),
  one directory per hierarchy under this process's own group, as on hybrid hosts.

The sandbox's outer process joins its groups before it execs bwrap/unshare (:func:`join_argv`),
so everything the call starts is charged from its first page. Where no group can be made,
:func:`support` says why, and the limits are the rlimits alone.
"""
from __future__ import annotations

import errno
import functools
import itertools
import os
import re
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

__all__ = ['CgroupSupport', 'CallCgroup', 'support', 'make_call_cgroup', 'join_argv', 'EXTRA_TASKS',
           'DEFAULT_CPU_CORES']

#: tasks of a call besides the program's ``max_processes``: the outer bwrap/unshare, the
#: namespace's PID 1 and (unshare) the chroot helper
EXTRA_TASKS = 3

_PREFIX = 'mtflow-sbx-'

#: the v1 controllers a call's groups use (``cpu`` where it can be made: :attr:`CgroupSupport.cpu`)
V1_CONTROLLERS = ('memory', 'pids', 'cpuacct', 'cpu')

#: the CPU bandwidth period (µs) of a call's group: ``cpu_cores`` x this is its quota per period
CPU_PERIOD_US = 100_000

#: the ``python`` tool's default ``cpu_cores``: one core's worth of CPU time per second for the
#: whole call, however many processes it runs (``None`` in the options: no quota, the weight only)
DEFAULT_CPU_CORES = 1.0
_counter = itertools.count()


@dataclass(frozen=True)
class CgroupSupport:
    """What this process can make: ``version`` 2 or 1 with the parent directory per controller
    (v2: the key ``''``), or ``version`` 0 and ``detail`` saying why not. ``cpu``: whether the
    call's group has the CPU controller (v1: the ``cpu`` key of ``parents``; v2: enabled for
    children), else ``cpu_detail`` says why not."""
    version: int
    parents: Dict[str, str] = field(default_factory=dict)
    detail: str = ''
    cpu: bool = False
    cpu_detail: str = ''

    def describe(self) -> str:
        if not self.version:
            return f'no cgroup per call ({self.detail}): rlimits only, no CPU bound (cpu_cores)'
        where = ', '.join(sorted(set(self.parents.values())))
        cpu = 'cpu (one weight per call, cpu_cores)' if self.cpu else f'no CPU bound ({self.cpu_detail})'
        return f'a cgroup v{self.version} per call (memory without swap, pids, {cpu}; under {where})'


def _own_paths() -> Dict[str, str]:
    """controller (``''`` for v2) -> this process's cgroup path, from ``/proc/self/cgroup``."""
    out: Dict[str, str] = {}
    with open('/proc/self/cgroup', encoding='ascii') as f:
        for line in f:
            _id, controllers, path = line.rstrip('\n').split(':', 2)
            for c in (controllers.split(',') if controllers else ['']):
                out[c] = path
    return out


def _mounts() -> Dict[str, Tuple[str, str]]:
    """controller (``''`` for v2) -> (mount point, root of the hierarchy it shows)."""
    out: Dict[str, Tuple[str, str]] = {}
    with open('/proc/self/mountinfo', encoding='utf-8') as f:
        for line in f:
            left, _, right = line.partition(' - ')
            parts, rparts = left.split(), right.split()
            if len(parts) < 5 or len(rparts) < 3:
                continue
            root, point, fstype, opts = parts[3], parts[4], rparts[0], rparts[2].split(',')
            if fstype == 'cgroup2':
                out.setdefault('', (point, root))
            elif fstype == 'cgroup':
                for c in V1_CONTROLLERS:
                    if c in opts:
                        out.setdefault(c, (point, root))
    return out


def _dir_of(controller: str, own: Dict[str, str], mounts: Dict[str, Tuple[str, str]]) -> Optional[str]:
    if controller not in mounts or controller not in own:
        return None
    point, root = mounts[controller]
    path = own[controller]
    if root != '/' and (path == root or path.startswith(root.rstrip('/') + '/')):
        path = path[len(root.rstrip('/')):] or '/'
    return os.path.join(point, path.lstrip('/'))


def _probe() -> CgroupSupport:
    try:
        own, mounts = _own_paths(), _mounts()
    except OSError as exc:
        return CgroupSupport(0, detail=f'cannot read /proc/self/cgroup or mountinfo: {exc}')
    reasons = []
    v2 = _dir_of('', own, mounts)
    if v2 is not None:
        found = _try_v2(v2)
        if isinstance(found, CgroupSupport):
            return found
        reasons.append(f'v2 at {v2}: {found}')
    dirs = {c: _dir_of(c, own, mounts) for c in V1_CONTROLLERS}
    if dirs['memory'] and dirs['pids']:
        found = _try_v1({c: d for c, d in dirs.items() if d})
        if isinstance(found, CgroupSupport):
            return found
        reasons.append(f'v1: {found}')
    elif not v2:
        reasons.append('no cgroup v2 mount and no v1 memory and pids controllers')
    else:
        reasons.append('no v1 memory and pids controllers either')
    return CgroupSupport(0, detail='; '.join(reasons))


def _try_v2(parent: str) -> Union[CgroupSupport, str]:
    """What a v2 group under ``parent`` can have, or why none can be made."""
    try:
        with open(os.path.join(parent, 'cgroup.controllers'), encoding='ascii') as f:
            available = f.read().split()
    except OSError as exc:
        return str(exc)
    missing = [c for c in ('memory', 'pids') if c not in available]
    if missing:
        return f'controllers {missing} not available (cgroup.controllers: {" ".join(available) or "empty"})'
    control = os.path.join(parent, 'cgroup.subtree_control')
    cpu_detail = '' if 'cpu' in available else 'the cpu controller is not available here'
    try:
        with open(control, encoding='ascii') as f:
            enabled = f.read().split()
        wanted = [c for c in ('memory', 'pids', 'cpu') if c not in enabled and (c != 'cpu' or not cpu_detail)]
        if wanted:
            try:
                _write(parent, 'cgroup.subtree_control', ' '.join('+' + c for c in wanted))
            except OSError as exc:
                if 'cpu' not in wanted:
                    raise
                # (cpu not delegated, or a real-time task in the way): the others alone
                cpu_detail = f'cannot enable cpu for child groups ({exc.strerror})'
                rest = [c for c in wanted if c != 'cpu']
                if rest:
                    _write(parent, 'cgroup.subtree_control', ' '.join('+' + c for c in rest))
    except OSError as exc:
        return (f'cannot enable memory and pids for child groups ({exc.strerror}); run the driver in a '
                'delegated subtree (systemd-run -p Delegate=yes) or as root in its own cgroup')
    found = CgroupSupport(2, {'': parent}, cpu=not cpu_detail, cpu_detail=cpu_detail)
    why = _try_make(found)
    if why is not None and found.cpu:  # a quota it could not write: the group without one
        found = CgroupSupport(2, {'': parent}, cpu_detail=why)
        why = _try_make(found)
    return found if why is None else why


def _try_v1(parents: Dict[str, str]) -> Union[CgroupSupport, str]:
    """What v1 groups under ``parents`` can have (``cpu`` where it can be made), or why none."""
    if 'cpu' not in parents:
        found = CgroupSupport(1, parents, cpu_detail='no v1 cpu controller mounted')
        why = _try_make(found)
        return found if why is None else why
    found = CgroupSupport(1, parents, cpu=True)
    why = _try_make(found)
    if why is None:
        return found
    found = CgroupSupport(1, {c: d for c, d in parents.items() if c != 'cpu'}, cpu_detail=f'cpu: {why}')
    return found if _try_make(found) is None else why


def _try_make(sup: CgroupSupport) -> Optional[str]:
    """``None`` when a call's group can be made as ``sup`` says (with a CPU quota where it has
    ``cpu``), else why not."""
    _remove_stale(sup.parents)
    try:
        group = CallCgroup.create(sup, 64, 8, cpu_cores=1.0 if sup.cpu else None)
    except OSError as exc:
        return f'cannot create a child group ({exc.strerror or exc})'
    group.remove()
    return None


def _pid_namespace() -> str:
    """This process's PID namespace (the inode of ``/proc/self/ns/pid``; ``0`` where unknown)."""
    try:
        return str(os.stat('/proc/self/ns/pid').st_ino)
    except OSError:
        return '0'


_PID_NS = _pid_namespace()
_NAME = re.compile(re.escape(_PREFIX) + r'(\d+)-\d+-[0-9a-f]+(?:-ns(\d+))?$')


def _remove_stale(parents: Dict[str, str]) -> None:
    """Remove empty groups left by a driver that died (``mtflow-sbx-<pid>-...`` of a pid that is
    gone). A group's name carries its driver's PID namespace: a driver in another container on
    this kernel (its pids not in our ``/proc``) may share a parent group with this one, and its
    live calls' groups, empty for a moment between ``mkdir`` and the call joining them, are not
    ours to remove. (A name without one is of a driver before that: removed as before.)"""
    for parent in set(parents.values()):
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            m = _NAME.match(name)
            if m and m.group(2) in (None, _PID_NS) and not os.path.exists(f'/proc/{m.group(1)}'):
                try:
                    os.rmdir(os.path.join(parent, name))
                except OSError:
                    pass


@functools.lru_cache(maxsize=None)
def support() -> CgroupSupport:
    """What this process can make, probed once (a probe is idempotent: two threads racing on the
    first call both get the same answer)."""
    return _probe()


class CallCgroup:
    """The groups of one call (one directory per v1 controller, one for v2)."""

    def __init__(self, version: int, dirs: Dict[str, str]) -> None:
        self.version, self.dirs = version, dirs

    @classmethod
    def create(cls, sup: CgroupSupport, memory_mb: int, max_tasks: int,
               cpu_cores: Optional[float] = None) -> 'CallCgroup':
        """The groups of one call: ``memory_mb`` for all of it (no swap), ``max_tasks`` tasks, and,
        where ``sup`` has ``cpu``, one CPU weight for the call and ``cpu_cores`` of CPU bandwidth
        (``None``: no quota)."""
        name = f'{_PREFIX}{os.getpid()}-{next(_counter)}-{os.urandom(3).hex()}-ns{_PID_NS}'
        dirs: Dict[str, str] = {}
        group = cls(sup.version, dirs)
        limit = memory_mb * 1024 * 1024
        try:
            made: Dict[str, str] = {}  # parent -> the group (controllers mounted together share one)
            for controller, parent in sup.parents.items():
                if parent not in made:
                    made[parent] = os.path.join(parent, name)
                    os.mkdir(made[parent], 0o700)
                dirs[controller] = made[parent]
            quota = None if cpu_cores is None or not sup.cpu else max(1000, round(cpu_cores * CPU_PERIOD_US))
            if sup.version == 2:
                d = dirs['']
                _write(d, 'memory.max', limit)
                _write(d, 'memory.swap.max', 0, optional=True)
                _write(d, 'pids.max', max_tasks)
                if quota is not None:
                    _write(d, 'cpu.max', f'{quota} {CPU_PERIOD_US}')
            else:
                m = dirs['memory']
                _write(m, 'memory.limit_in_bytes', limit)
                _write(m, 'memory.memsw.limit_in_bytes', limit, optional=True)  # no swap
                _write(dirs['pids'], 'pids.max', max_tasks)
                if quota is not None:
                    _write(dirs['cpu'], 'cpu.cfs_period_us', CPU_PERIOD_US)
                    _write(dirs['cpu'], 'cpu.cfs_quota_us', quota)
        except BaseException:
            group.remove()
            raise
        return group

    def procs_files(self) -> List[str]:
        return [os.path.join(d, 'cgroup.procs') for d in sorted(set(self.dirs.values()))]

    def peak_mb(self) -> Optional[float]:
        key = ('', 'memory.peak') if self.version == 2 else ('memory', 'memory.max_usage_in_bytes')
        value = _read_int(self.dirs.get(key[0]), key[1])
        return None if value is None else round(value / (1024 * 1024), 3)

    def cpu_s(self) -> Optional[float]:
        if self.version == 2:
            stat = _read_keyed(self.dirs.get(''), 'cpu.stat')
            return None if 'usage_usec' not in stat else stat['usage_usec'] / 1e6
        value = _read_int(self.dirs.get('cpuacct'), 'cpuacct.usage')
        return None if value is None else value / 1e9

    def oom_killed(self) -> bool:
        """True when the kernel's OOM killer killed a task of this call (its memory limit)."""
        if self.version == 2:
            return _read_keyed(self.dirs.get(''), 'memory.events').get('oom_kill', 0) > 0
        return _read_keyed(self.dirs.get('memory'), 'memory.oom_control').get('oom_kill', 0) > 0

    def remove(self, wait_s: float = 5.0) -> None:
        """Remove the directories (once their tasks are gone; the kernel takes a moment after a
        kill)."""
        deadline = time.monotonic() + wait_s
        for key, path in list(self.dirs.items()):
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        break
                    time.sleep(0.005)
            self.dirs.pop(key, None)


def _write(d: str, name: str, value: Union[int, str], optional: bool = False) -> None:
    try:
        with open(os.path.join(d, name), 'w', encoding='ascii') as f:
            f.write(str(value))
    except FileNotFoundError:
        if not optional:
            raise


def _read_int(d: Optional[str], name: str) -> Optional[int]:
    if d is None:
        return None
    try:
        with open(os.path.join(d, name), encoding='ascii') as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _read_keyed(d: Optional[str], name: str) -> Dict[str, int]:
    out: Dict[str, int] = {}
    if d is None:
        return out
    try:
        with open(os.path.join(d, name), encoding='ascii') as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[1].lstrip('-').isdigit():
                    out[parts[0]] = int(parts[1])
    except OSError:
        pass
    return out


def make_call_cgroup(memory_mb: int, max_processes: int, cpu_cores: Optional[float] = None) -> Optional[CallCgroup]:
    """The groups for one call, or None where this host gives none (see :func:`support`);
    ``cpu_cores``: its CPU bandwidth where the host gives a CPU controller (``None``: no quota)."""
    sup = support()
    if not sup.version:
        return None
    return CallCgroup.create(sup, memory_mb, max_processes + EXTRA_TASKS, cpu_cores)


#: the outer wrapper: joins the call's groups (writing its own pid), then execs the sandbox, so
#: that nothing of the call runs outside them; a failed write ends it with status 125
_JOIN = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'


def join_argv(group: Optional[CallCgroup], argv: List[str]) -> List[str]:
    if group is None:
        return argv
    files = group.procs_files()
    return ['/bin/sh', '-c', _JOIN, 'mtflow-cgroup', str(len(files)), *files, *argv]
