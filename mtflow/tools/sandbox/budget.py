"""Rootless, the driver's share of its user's process limit: sandboxes start only while it keeps
room for the driver's own threads and processes.

The kernel counts every task of a user namespace for the namespace's creator as well, up to the
first namespace (per-namespace ``RLIMIT_NPROC`` counts since Linux 5.14), and a rootless sandbox's
namespaces are created by the driver's user, on a subordinate uid (:mod:`mtflow.tools.subuid`) or
not. So the tasks of every call count against the driver's ``ulimit -u``: with the limit at 121,
three calls took it all and the driver could not start a thread or a subprocess (issue 52, 4).
As root there is no such count (root's limit is not enforced; each call's leased uid has its own).

So, rootless under a finite ``RLIMIT_NPROC``, a sandbox is started only when its tasks fit beside
everything else: this user's tasks in the driver's PID namespace (the driver's threads, other
processes of the user), the tasks every running sandbox may reach (``max_processes`` + 2: the outer
bwrap and the namespace's PID 1), and :func:`reserve` kept for the driver. A call waits for room
(up to its ``timeout_s``), and one that can never fit is refused at once, saying why.
"""
from __future__ import annotations

import asyncio
import os
import resource
import threading
import time
from dataclasses import dataclass
from typing import Optional

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
        with self._lock:
            for fresh in (False, True):
                others = self._count(fresh)
                if others + self.held + tasks + reserve(limit) <= limit:
                    self.held += tasks
                    self.sandboxes += 1
                    return Ticket(tasks, self)
            if others + tasks + reserve(limit) > limit:
                raise NoProcessRoom(f'this user\'s process limit (ulimit -u {limit}) has no room for a call of '
                                    f'{tasks} tasks (max_processes + {EXTRA_TASKS}) beside the {others} tasks this '
                                    f'user runs and the {reserve(limit)} kept for the driver: lower max_processes or '
                                    'raise the limit')
            return None

    def describe(self, tasks: int) -> str:
        limit = self.limit()
        return (f'this user\'s process limit (ulimit -u {limit}) had no room for a call of {tasks} tasks: '
                f'{self.sandboxes} running calls may reach {self.held}, this user runs {self._others} other tasks, '
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
    """The tasks (threads) this user runs in this PID namespace, sandboxes' own namespaces left
    out (their tasks are in the budget already; a subordinate uid's are not this user's anyway)."""
    uid = str(os.getuid()).encode()
    mine = os.readlink('/proc/self/ns/pid')
    total = 0
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            with open(f'/proc/{name}/status', 'rb') as f:
                status = f.read()
            at = status.index(b'\nUid:') + 5
            if status[at:status.index(b'\n', at)].split()[0] != uid:
                continue
            try:
                if os.readlink(f'/proc/{name}/ns/pid') != mine:
                    continue
            except OSError:  # not ours to read (not dumpable): counted, to be safe
                pass
            at = status.index(b'\nThreads:') + 9
            total += int(status[at:status.index(b'\n', at)])
        except (OSError, ValueError):  # gone meanwhile
            pass
    return total


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
