"""Bounded staleness of a stream: what a weight update does to the work in flight.

A stream (:mod:`mtflow.engine.stream`) stamps every generated turn with a policy version
(:mod:`mtflow.engine.versions`). This module holds the policy over those stamps, apart from the
driving:

* ``max_staleness=k``: a group whose oldest turn is more than ``k`` versions behind is never
  delivered. It is checked when an update makes a group in flight too stale (the group is
  *doomed*: its generations in flight are cancelled and its members wind down), when the group
  finishes, and when the consumer takes it (:meth:`Staleness.too_old`);
* ``stale=``: such a group runs again from fresh copies of its prompts (``'restart'``) or is
  discarded (``'drop'``); once the stream is stopping it is handed back unfinished instead;
* ``on_update=``: ``'keep'`` lets a generation in flight finish across an update, ``'abort'``
  cancels it and issues it again under the new version, ``'resume'`` cancels it and continues
  from the ids it had (:mod:`mtflow.engine.stream_resume`).

:class:`Staleness` is the policy, an object the stream driver holds (``driver.staleness``): it
answers the questions (is this group too stale, does an update cancel this generation, what
happens to a stale group) from the versions it has seen; the driver acts on the answers (cancels
tasks, winds members down, admits a group again), so the policy never touches the driver.
"""
from __future__ import annotations

from typing import Any, List, Optional

from mtflow.core.calls import is_async_callable
from mtflow.core.machine import RequestRecord
from mtflow.engine.resume import is_resumable
from mtflow.engine.stream_groups import InFlightGroup
from mtflow.engine.versions import versions_of

__all__ = ['STALE_POLICIES', 'UPDATE_POLICIES', 'check_policies', 'oldest_version', 'Staleness']

#: what happens to a group that would be delivered too stale
STALE_POLICIES = ('restart', 'drop')
#: what happens to the generations in flight when the weights change
UPDATE_POLICIES = ('keep', 'abort', 'resume')


def check_policies(max_staleness: Optional[int], stale: str, on_update: str, rollout_fn: Any) -> None:
    """``Executor.stream``'s staleness options, checked before the driver starts."""
    if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                      or max_staleness < 0):
        raise ValueError(f'stream: max_staleness must be None or an int >= 0, not {max_staleness!r}')
    if stale not in STALE_POLICIES:
        raise ValueError(f'stream: stale must be one of {STALE_POLICIES}, not {stale!r}')
    if on_update not in UPDATE_POLICIES:
        raise ValueError(f'stream: on_update must be one of {UPDATE_POLICIES}, not {on_update!r}')
    if on_update != 'keep' and not is_async_callable(rollout_fn):
        raise ValueError(f"stream: on_update={on_update!r} needs an async rollout_fn (a generation in a thread "
                         'cannot be cancelled; a backend\'s async_rollout_fn() is one)')
    if on_update == 'resume' and not is_resumable(rollout_fn):
        raise ValueError("stream: on_update='resume' needs a rollout_fn that returns what it generated when it is "
                         "cut (resumable = True; mtflow.engine.resume); use 'abort' to generate the turn again")


def oldest_version(records: List[RequestRecord]) -> Optional[int]:
    """The oldest version that sampled any turn of ``records`` (``None``: nothing generated)."""
    versions = [v for rec in records for v in versions_of(rec)]
    return min(versions) if versions else None


class Staleness:
    """A stream's staleness policy (see the module docstring), held by its driver. It keeps the
    newest version it has seen (:meth:`update`) and judges groups and generations against it."""

    def __init__(self, max_staleness: Optional[int], stale: str, on_update: str, version: int) -> None:
        self.max_staleness = max_staleness
        #: what becomes of a group too stale to deliver: ``'restart'`` or ``'drop'``
        self.stale = stale
        self.on_update = on_update
        #: the newest policy version the driver has seen
        self.seen_version = version

    def update(self, current: int) -> bool:
        """The clock reads ``current``: ``True`` when it is a new version (then the driver asks
        :meth:`cancels` of each generation in flight and :meth:`too_stale` of each group)."""
        if current == self.seen_version:
            return False
        self.seen_version = current
        return True

    def too_stale(self, group: InFlightGroup) -> bool:
        """Whether ``group``'s oldest turn is more than ``max_staleness`` versions behind."""
        if self.max_staleness is None:
            return False
        oldest = oldest_version(group.records)
        return oldest is not None and self.too_old(self.seen_version - oldest)

    def too_old(self, age: int) -> bool:
        """Whether a delivered group of this ``age`` (versions behind now) is past the bound (the
        consumer's check when it takes one: the weights may have moved while it waited)."""
        return self.max_staleness is not None and age > self.max_staleness

    def doomed(self, rec: RequestRecord) -> bool:
        """Whether ``rec``'s group will not be delivered (marked so now if an update made it too
        stale): its members get no more work."""
        group = rec.group
        if group is not None and (group.doomed or self.too_stale(group)):
            group.doomed = True
            return True
        return False

    def cancels(self, rec: RequestRecord) -> bool:
        """At a new version: whether ``rec``'s generation in flight is cancelled (``abort`` and
        ``resume`` cancel every one; ``keep`` only those of a group now too stale)."""
        group = rec.group
        return self.on_update != 'keep' or (group is not None and self.too_stale(group))

    @property
    def rechecks_taken(self) -> bool:
        """Whether a group is judged again when the consumer takes it (it may come back to run
        again), so that the stream ends only once every group handed out was taken."""
        return self.max_staleness is not None
