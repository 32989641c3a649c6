"""Admission control: one bound over what a rollout holds in flight, with queues, not failures.

A fleet fails at high concurrency in the places a model server never sees: sandboxes that will not
start (SkyRL #9, uni-agent #47), environment servers out of sessions. :class:`Admission` is the
one controller over the three kinds of capacity a run uses (``docs/admission.md``):

=================  ================================================================================
resource           bound, and who waits
=================  ================================================================================
``model``          requests one server holds: the OpenAI backend's ``max_in_flight_per_replica``
                   (a queue in its router; its figures are reported beside these)
``tool_calls``     tool and sandbox calls in flight across every tool of the run (beside each
                   tool's own ``max_concurrency``): a call waits in :class:`Gate.hold`
``env_sessions``   environment sessions open (a request holds one from its reset to its close):
                   the drivers start a request only when a session is free (async mode, streams;
                   lockstep runs its batch together, so a batch larger than the bound is refused
                   and ``mtflow run`` makes its batches that small)
=================  ================================================================================

A branched run (``docs/branching.md``) forks a request's session with it: a prompt's tree holds up
to its leaf budget of sessions at once (a finished leaf closes its session before a top-up copy
opens one), so the drivers count prompts by :func:`sessions_per_prompt`: a prompt starts only when
its whole tree fits, and its children never wait for a session they already hold.

Each :class:`Gate` counts what it saw whether it bounds or not: the peak in flight, how many
waited and for how long; ``summary()`` is the ``admission`` block of ``summary.json``. A gate's
bound holds per event loop (one run has one), its figures across them.
"""
from __future__ import annotations

import asyncio
import threading
import weakref
from contextlib import asynccontextmanager
from time import perf_counter
from typing import Any, AsyncIterator, Dict, Optional, Tuple

__all__ = ['Admission', 'Gate', 'RESOURCES', 'sessions_per_prompt']

RESOURCES = ('tool_calls', 'env_sessions')


class Gate:
    """One bounded resource (``limit=None``: counted, not bounded)."""

    def __init__(self, name: str, limit: Optional[int] = None) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f'admission.{name} must be a positive int or None, not {limit!r}')
        self.name, self.limit = name, limit
        self.in_flight = 0
        self.peak = 0
        self.entered = 0
        self.queued = 0  # entries that had to wait
        self.queued_s = 0.0  # their time waiting, summed
        self._lock = threading.Lock()
        self._sems: 'weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]' = \
            weakref.WeakKeyDictionary()

    def _semaphore(self) -> Optional[asyncio.Semaphore]:
        if self.limit is None:
            return None
        loop = asyncio.get_running_loop()
        sem = self._sems.get(loop)
        if sem is None:
            sem = self._sems[loop] = asyncio.Semaphore(self.limit)
        return sem

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """One unit for the ``async with`` body, waiting (a queue) while ``limit`` are held."""
        sem = self._semaphore()
        waited = 0.0
        if sem is not None:
            if sem.locked():
                t = perf_counter()
                await sem.acquire()
                waited = perf_counter() - t
                self.waited(waited)
            else:
                await sem.acquire()
        self.opened()
        try:
            yield
        finally:
            self.closed()
            if sem is not None:
                sem.release()

    # ---- counting what someone else bounds (the drivers, for sessions) --------------------------
    def opened(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.entered += 1
            self.peak = max(self.peak, self.in_flight)

    def closed(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def waited(self, seconds: float) -> None:
        with self._lock:
            self.queued += 1
            self.queued_s += max(0.0, seconds)

    def summary(self) -> Dict[str, Any]:
        return {'limit': self.limit, 'peak': self.peak, 'entered': self.entered, 'in_flight': self.in_flight,
                'queued': self.queued, 'queued_s': round(self.queued_s, 4)}


class Admission:
    """The run's bounds: ``Executor(..., admission=Admission(tool_calls=8, env_sessions=32))``, or
    the run config's ``admission: {tool_calls: 8, env_sessions: 32}``. The executor hands it to
    the scheduler (``scheduler.use_admission(admission)``, which the YAML scheduler gives its tool
    runner and its environments) and the drivers start requests within ``env_sessions``."""

    def __init__(self, tool_calls: Optional[int] = None, env_sessions: Optional[int] = None) -> None:
        self.tool_calls = Gate('tool_calls', tool_calls)
        self.env_sessions = Gate('env_sessions', env_sessions)

    @classmethod
    def coerce(cls, value: Any) -> Optional['Admission']:
        """An :class:`Admission` from itself, a mapping of bounds, or ``None``."""
        if value is None or isinstance(value, Admission):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(RESOURCES))
            if unknown:
                raise ValueError(f'admission: unknown key(s) {", ".join(unknown)} (expected: {", ".join(RESOURCES)})')
            return cls(**value)
        raise TypeError(f'admission must be an Admission or a dict of bounds, not {type(value).__name__}')

    def session_bound(self, scheduler: Any) -> Optional[int]:
        """``env_sessions`` when ``scheduler`` opens one session per request
        (``scheduler.opens_env_sessions``), else ``None`` (nothing for the drivers to hold back)."""
        if self.env_sessions.limit is None or not getattr(scheduler, 'opens_env_sessions', False):
            return None
        return self.env_sessions.limit

    def session_bounds(self, scheduler: Any, branching: Any) -> Tuple[Optional[int], int]:
        """``(session_bound(scheduler), the sessions one prompt may hold)`` (:func:`sessions_per_prompt`)."""
        bound = self.session_bound(scheduler)
        return bound, sessions_per_prompt(bound, branching)

    def give_to(self, scheduler: Any) -> None:
        """Hand the bounds to ``scheduler`` (``use_admission(admission)``, when it has that method:
        the YAML scheduler gives them to its tool runner and its environments)."""
        use = getattr(scheduler, 'use_admission', None)
        if callable(use):
            use(self)

    def summary(self) -> Dict[str, Any]:
        return {name: getattr(self, name).summary() for name in RESOURCES}


def sessions_per_prompt(bound: Optional[int], branching: Any) -> int:
    """The environment sessions one prompt may hold at once under the bound ``bound``: 1, or, for a
    branched run, its tree's leaf budget (``branch.leaves``). A tree without a budget, or with one
    larger than the bound, cannot be kept within it: refused, with what to change."""
    if bound is None or branching is None:
        return 1
    leaves = branching.leaves
    if leaves is None:
        raise ValueError(f'admission.env_sessions is {bound}, but branch has no leaves budget: a fork opens a session '
                         'for each child, so a tree could hold any number at once; give branch.leaves (at most '
                         f'{bound}), the sessions one prompt may hold')
    if leaves > bound:
        raise ValueError(f'branch.leaves is {leaves}: a tree holds up to {leaves} environment sessions at once (one '
                         f'per leaf), more than admission.env_sessions ({bound}); raise the bound or lower the budget')
    return leaves
