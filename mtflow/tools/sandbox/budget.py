"""Rootless, the driver's share of its user's process limit: sandboxes start only while it keeps
room for the driver's own threads and processes.

The kernel counts every task of a user namespace for the namespace's creator as well, up to the
first namespace (per-namespace ``RLIMIT_NPROC`` counts since Linux 5.14), and a rootless sandbox's
namespaces are created by the driver's user, on a subordinate uid (:mod:`mtflow.tools.subuid`) or
not. So the tasks of every call count against the driver's ``ulimit -u``: with the limit at 121,
three calls took it all and the driver could not start a thread or a subprocess (issue 52, 4).
As root there is no such count (root's limit is not enforced; each call's leased uid has its own).

So, rootless under a finite ``RLIMIT_NPROC``, a sandbox is started only when its tasks fit beside
everything else: the tasks in view that count against this user (the driver's threads, its other
processes, other drivers' sandboxes and containers on its subordinate uids: :func:`user_tasks`),
the tasks this driver's running sandboxes may reach (``max_processes`` + 2: the outer bwrap and the
namespace's PID 1), and :func:`reserve` kept for the driver. A call waits for room (up to its
``timeout_s``), and one that could not fit even alone is refused at once, saying why.
"""
from __future__ import annotations

import asyncio
import functools
import os
import pwd
import resource
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from mtflow.tools import subuid
from mtflow.tools.isolation import IsolationUnavailable, rootless

__all__ = ['NoProcessRoom', 'ProcessBudget', 'Ticket', 'budget', 'call_tasks', 'reserve', 'take_room', 'room']

#: tasks of a rootless call besides its program's ``max_processes``: the outer bwrap, PID 1 (sh)
EXTRA_TASKS = 2

#: how long a count of this user's tasks is used before it is taken again (a count reads the
#: status of every process: about 5 ms for 130 processes on a loaded machine)
COUNT_TTL_S = 1.0


def call_tasks(max_processes: int) -> int:
    """The tasks a rootless call may reach."""
    return max_processes + EXTRA_TASKS


def reserve(limit: int) -> int:
    """Tasks kept for the driver under a process limit of ``limit``: an eighth, at least 32 (its
    event loop, executor, spawner and pool threads, and the subprocesses it starts)."""
    return max(32, limit // 8)


class NoProcessRoom(IsolationUnavailable):
    """This user's process limit leaves no room for the call (the message says what holds it)."""


@dataclass
class Ticket:
    """Room for ``tasks`` tasks, held by one sandbox until :meth:`release`."""
    tasks: int
    owner: 'Optional[ProcessBudget]'

    def release(self) -> None:
        if self.owner is not None:
            self.owner._give(self.tasks)
            self.owner = None


class ProcessBudget:
    """The room the running sandboxes hold under this user's ``RLIMIT_NPROC`` (one per process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0  # tasks the running sandboxes may reach
        self.sandboxes = 0
        self._others = 0  # this user's other tasks, as last counted
        self._counted = -COUNT_TTL_S

    @staticmethod
    def limit() -> Optional[int]:
        """The soft ``RLIMIT_NPROC`` (read each time: a driver may lower it), or None: unlimited."""
        soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        return None if soft == resource.RLIM_INFINITY else soft

    def take(self, tasks: int) -> Optional[Ticket]:
        """Room for ``tasks`` now, or None; :class:`NoProcessRoom` when they can never fit."""
        limit = self.limit()
        if limit is None:
            return Ticket(tasks, None)
        if tasks + reserve(limit) > limit:
            raise NoProcessRoom(f'this user\'s process limit (ulimit -u {limit}) has no room for a call of {tasks} '
                                f'tasks (max_processes + {EXTRA_TASKS}) beside the {reserve(limit)} kept for the '
                                'driver: lower max_processes or raise the limit')
        with self._lock:
            for fresh in (False, True):
                others = self._count(fresh)
                if others + self.held + tasks + reserve(limit) <= limit:
                    self.held += tasks
                    self.sandboxes += 1
                    return Ticket(tasks, self)
            return None

    def describe(self, tasks: int) -> str:
        limit = self.limit()
        return (f'this user\'s process limit (ulimit -u {limit}) had no room for a call of {tasks} tasks: '
                f'{self.sandboxes} running calls may reach {self.held}, {self._others} other tasks count for this user, '
                f'{reserve(limit or 0)} are kept for the driver; run fewer calls at once, lower max_processes, or '
                'raise the limit')

    def _give(self, tasks: int) -> None:
        with self._lock:
            self.held -= tasks
            self.sandboxes -= 1

    def _count(self, fresh: bool) -> int:
        now = time.monotonic()
        if fresh or now - self._counted > COUNT_TTL_S:
            self._others = user_tasks()
            self._counted = now
        return self._others


def user_tasks() -> int:
    """The tasks (threads) in view that the kernel counts against this user: its own and its
    subordinate uids' (only namespaces this user made run as those: other drivers' sandboxes, its
    containers), in any PID namespace, but for those inside this process's own sandboxes (their
    descendants in other PID namespaces), whose room the budget holds already."""
    charged = charged_uids()
    found: Dict[int, Tuple[int, int]] = {}  # pid -> (parent, threads) of the tasks counted for this user
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            with open(f'/proc/{name}/status', 'rb') as f:
                fields = dict(line.split(b':', 1) for line in f.read().splitlines() if b':' in line)
            uid = int(fields[b'Uid'].split()[0])
            if any(first <= uid < first + count for first, count in charged):
                found[int(name)] = (int(fields[b'PPid']), int(fields[b'Threads']))
        except (OSError, ValueError, KeyError):  # gone meanwhile
            pass
    children: Dict[int, List[int]] = {}
    for pid, (parent, _) in found.items():
        children.setdefault(parent, []).append(pid)
    mine, inside, todo = os.readlink('/proc/self/ns/pid'), set(), list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            if os.readlink(f'/proc/{pid}/ns/pid') != mine:
                inside.add(pid)
        except OSError:  # not ours to read: counted, to be safe
            pass
    return sum(threads for pid, (_, threads) in found.items() if pid not in inside)


@functools.lru_cache(maxsize=None)
def charged_uids() -> Tuple[Tuple[int, int], ...]:
    """``(first, count)`` of the host uids whose tasks count against this user: its own uid and
    its subordinate ranges (:func:`mtflow.tools.subuid.ranges`)."""
    uid = os.getuid()
    try:
        found = subuid.ranges(subuid.SUBUID, pwd.getpwuid(uid).pw_name, uid)
    except (KeyError, subuid.SubuidUnavailable):
        found = []
    return ((uid, 1), *found)


_budget: Optional[ProcessBudget] = None
_budget_lock = threading.Lock()


def budget() -> Optional[ProcessBudget]:
    """This process's budget, rootless; None as root (whose limit the kernel does not enforce)."""
    global _budget
    if not rootless():
        return None
    with _budget_lock:
        if _budget is None:
            _budget = ProcessBudget()
        return _budget


def take_room(max_processes: int) -> Optional[Ticket]:
    """Room for a sandbox of ``max_processes`` now (rootless; None as root), else
    :class:`NoProcessRoom` (a warm pool tries again later)."""
    found = budget()
    if found is None:
        return None
    tasks = call_tasks(max_processes)
    ticket = found.take(tasks)
    if ticket is None:
        raise NoProcessRoom(found.describe(tasks))
    return ticket


async def room(max_processes: int, timeout_s: float) -> Optional[Ticket]:
    """Room for a call's sandbox (rootless; None as root), waited for up to ``timeout_s``;
    :class:`NoProcessRoom` after that, or at once for a call that can never fit."""
    found = budget()
    if found is None:
        return None
    tasks = call_tasks(max_processes)
    deadline = time.monotonic() + timeout_s
    pause = 0.01
    while True:
        ticket = found.take(tasks)
        if ticket is not None:
            return ticket
        if time.monotonic() > deadline:
            raise NoProcessRoom(f'{found.describe(tasks)} (waited {timeout_s:g} s)')
        await asyncio.sleep(pause)
        pause = min(2 * pause, 0.2)
