"""A cgroup per sandboxed call, where the host lets this process make one.

Rlimits bound each process; a cgroup bounds the call: its memory counts what rlimits cannot see
(``memfd`` and ``tmpfs`` pages, page cache, and the kernel memory charged to it, such as the
inodes and dentries of a flood of empty files), with no swap; ``pids`` bounds its tasks whatever
uid they run as; and its peak memory and CPU time are read back for ``trace_info``.

Both hierarchies are supported:

- cgroup v2 (``memory.max``, ``memory.swap.max``, ``pids.max``; ``memory.peak``, ``cpu.stat``,
  ``memory.events``), under this process's own cgroup when its ``cgroup.subtree_control`` has
  (or can be given) ``memory`` and ``pids``: the root, or a delegated subtree (``systemd-run
  -p Delegate=yes``);
- cgroup v1 controllers (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes``, ``pids.max``;
  ``memory.max_usage_in_bytes``, ``cpuacct.usage``, ``memory.oom_control``), one directory per
  controller under this process's own group, as on hybrid hosts.

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
from typing import Dict, List, Optional, Tuple

__all__ = ['CgroupSupport', 'CallCgroup', 'support', 'make_call_cgroup', 'join_argv', 'EXTRA_TASKS']

#: tasks of a call besides the program's ``max_processes``: the outer bwrap/unshare, the
#: namespace's PID 1 and (unshare) the chroot helper
EXTRA_TASKS = 3

_PREFIX = 'mtflow-sbx-'
_counter = itertools.count()


@dataclass(frozen=True)
class CgroupSupport:
    """What this process can make: ``version`` 2 or 1 with the parent directory per controller
    (v2: the key ``''``), or ``version`` 0 and ``detail`` saying why not."""
    version: int
    parents: Dict[str, str] = field(default_factory=dict)
    detail: str = ''

    def describe(self) -> str:
        if not self.version:
            return f'no cgroup per call ({self.detail}): rlimits only'
        where = ', '.join(sorted(set(self.parents.values())))
        return f'a cgroup v{self.version} per call (memory without swap, pids; under {where})'


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
                for c in ('memory', 'pids', 'cpuacct'):
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
        why = _try_v2(v2)
        if why is None:
            return CgroupSupport(2, {'': v2})
        reasons.append(f'v2 at {v2}: {why}')
    dirs = {c: _dir_of(c, own, mounts) for c in ('memory', 'pids', 'cpuacct')}
    if dirs['memory'] and dirs['pids']:
        parents = {c: d for c, d in dirs.items() if d}
        why = _try_v1(parents)
        if why is None:
            return CgroupSupport(1, parents)
        reasons.append(f'v1: {why}')
    elif not v2:
        reasons.append('no cgroup v2 mount and no v1 memory and pids controllers')
    else:
        reasons.append('no v1 memory and pids controllers either')
    return CgroupSupport(0, detail='; '.join(reasons))


def _try_v2(parent: str) -> Optional[str]:
    try:
        with open(os.path.join(parent, 'cgroup.controllers'), encoding='ascii') as f:
            available = f.read().split()
    except OSError as exc:
        return str(exc)
    missing = [c for c in ('memory', 'pids') if c not in available]
    if missing:
        return f'controllers {missing} not available (cgroup.controllers: {" ".join(available) or "empty"})'
    try:
        with open(os.path.join(parent, 'cgroup.subtree_control'), encoding='ascii') as f:
            enabled = f.read().split()
        if not all(c in enabled for c in ('memory', 'pids')):
            with open(os.path.join(parent, 'cgroup.subtree_control'), 'w', encoding='ascii') as f:
                f.write('+memory +pids')
    except OSError as exc:
        return (f'cannot enable memory and pids for child groups ({exc.strerror}); run the driver in a '
                'delegated subtree (systemd-run -p Delegate=yes) or as root in its own cgroup')
    return _try_make({'': parent}, 2)


def _try_v1(parents: Dict[str, str]) -> Optional[str]:
    return _try_make(parents, 1)


def _try_make(parents: Dict[str, str], version: int) -> Optional[str]:
    _remove_stale(parents)
    try:
        group = CallCgroup.create(CgroupSupport(version, parents), 64, 8)
    except OSError as exc:
        return f'cannot create a child group ({exc.strerror or exc})'
    group.remove()
    return None


def _remove_stale(parents: Dict[str, str]) -> None:
    """Remove empty groups left by a driver that died (``mtflow-sbx-<pid>-...`` of a dead pid)."""
    for parent in set(parents.values()):
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            m = re.match(re.escape(_PREFIX) + r'(\d+)-', name)
            if m and not os.path.exists(f'/proc/{m.group(1)}'):
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
    def create(cls, sup: CgroupSupport, memory_mb: int, max_tasks: int) -> 'CallCgroup':
        name = f'{_PREFIX}{os.getpid()}-{next(_counter)}-{os.urandom(3).hex()}'
        dirs: Dict[str, str] = {}
        group = cls(sup.version, dirs)
        limit = memory_mb * 1024 * 1024
        try:
            for controller, parent in sup.parents.items():
                path = os.path.join(parent, name)
                os.mkdir(path, 0o700)
                dirs[controller] = path
            if sup.version == 2:
                d = dirs['']
                _write(d, 'memory.max', limit)
                _write(d, 'memory.swap.max', 0, optional=True)
                _write(d, 'pids.max', max_tasks)
            else:
                m = dirs['memory']
                _write(m, 'memory.limit_in_bytes', limit)
                _write(m, 'memory.memsw.limit_in_bytes', limit, optional=True)  # no swap
                _write(dirs['pids'], 'pids.max', max_tasks)
        except BaseException:
            group.remove()
            raise
        return group

    def procs_files(self) -> List[str]:
        return [os.path.join(d, 'cgroup.procs') for d in self.dirs.values()]

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


def _write(d: str, name: str, value: int, optional: bool = False) -> None:
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


def make_call_cgroup(memory_mb: int, max_processes: int) -> Optional[CallCgroup]:
    """The groups for one call, or None where this host gives none (see :func:`support`)."""
    sup = support()
    if not sup.version:
        return None
    return CallCgroup.create(sup, memory_mb, max_processes + EXTRA_TASKS)


#: the outer wrapper: joins the call's groups (writing its own pid), then execs the sandbox, so
#: that nothing of the call runs outside them; a failed write ends it with status 125
_JOIN = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'


def join_argv(group: Optional[CallCgroup], argv: List[str]) -> List[str]:
    if group is None:
        return argv
    files = group.procs_files()
    return ['/bin/sh', '-c', _JOIN, 'mtflow-cgroup', str(len(files)), *files, *argv]
