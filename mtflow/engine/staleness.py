"""Bounded staleness of a stream: what a weight update does to the work in flight.

A stream (:mod:`mtflow.engine.stream`) stamps every generated turn with a policy version
(:mod:`mtflow.engine.versions`). This module holds the policy over those stamps, apart from the
driving:

* ``max_staleness=k``: a group whose oldest turn is more than ``k`` versions behind is never
  delivered. It is checked when an update makes a group in flight too stale (the group is
  *doomed*: its generations in flight are cancelled and its members wind down), when the group
  finishes, and when the consumer takes it (:meth:`StalenessMixin.take_back`);
* ``stale=``: such a group runs again from fresh copies of its prompts (``'restart'``) or is
  discarded (``'drop'``); once the stream is stopping it is handed back unfinished instead;
* ``on_update=``: ``'keep'`` lets a generation in flight finish across an update, ``'abort'``
  cancels it and issues it again under the new version, ``'resume'`` cancels it and continues
  from the ids it had (:mod:`mtflow.engine.stream_resume`).

:class:`StalenessMixin` is the part of :class:`~mtflow.engine.stream.StreamDriver` that applies
it; it works on the driver's groups, tasks and counts.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Deque, Dict, List, Optional

from mtflow.core.calls import RAISED, Outcome
from mtflow.core.machine import RequestRecord
from mtflow.core.calls import is_async_callable
from mtflow.engine.in_flight import Stopped
from mtflow.engine.partial import UnfinishedRequest
from mtflow.engine.resume import is_resumable
from mtflow.engine.run_state import uuid_of
from mtflow.engine.stream_groups import InFlightGroup, StreamGroup, fresh_copy
from mtflow.engine.versions import versions_of

__all__ = ['STALE_POLICIES', 'UPDATE_POLICIES', 'check_policies', 'oldest_version', 'StalenessMixin']

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


class StalenessMixin:
    """The staleness half of the stream driver (see the module docstring). It reads the driver's
    ``in_flight`` (its groups; each member's record holds its own), ``flight`` (its tasks), ``stats``,
    ``clock``, ``stopping`` and calls its ``admit``, ``wind_down``, ``restore_record`` and
    ``generate``."""
    run: Any
    clock: Any
    in_flight: Dict[int, InFlightGroup]
    flight: Any
    stats: Dict[str, int]
    stopping: bool

    def init_staleness(self, max_staleness: Optional[int], stale: str, on_update: str) -> None:
        self.max_staleness = max_staleness
        self.stale_policy = stale
        self.on_update = on_update
        self.seen_version = self.clock.current(self.run.settings.rollout_fn)
        #: groups the consumer found too stale when it took them, to run again (its thread appends)
        self.returned: Deque[StreamGroup] = deque()
        #: guards ``returned`` against the driver's end: a group the consumer sends back after
        #: the driver ended is handed back (``unfinished``) in the consumer's thread instead
        self.returned_lock = threading.Lock()
        self.ended = False

    # ---- the bound -----------------------------------------------------------------------------
    def oldest(self, group: InFlightGroup) -> Optional[int]:
        return oldest_version(group.records)

    def too_stale(self, group: InFlightGroup) -> bool:
        if self.max_staleness is None:
            return False
        oldest = self.oldest(group)
        return oldest is not None and self.seen_version - oldest > self.max_staleness

    def doomed(self, rec: RequestRecord) -> bool:
        """Whether ``rec``'s group will not be delivered (marked so now if an update made it too
        stale): its members get no more work."""
        group = rec.group
        if group is not None and (group.doomed or self.too_stale(group)):
            group.doomed = True
            return True
        return False

    def check_version(self) -> None:
        """A new version: with ``on_update='abort'``, cancel the generations in flight (issued
        again under it); with ``max_staleness``, wind down every group it makes too stale."""
        current = self.clock.current(self.run.settings.rollout_fn)
        if current == self.seen_version or self.stopping:
            return
        self.seen_version = current
        for rec, task in self.flight.generations():
            group = rec.group
            if self.on_update != 'keep' or (group is not None and self.too_stale(group)):
                task.cancel()
        if self.max_staleness is not None:
            for group in list(self.in_flight.values()):
                if not group.doomed and self.too_stale(group):
                    group.doomed = True

    def cancelled_by_update(self, rec: RequestRecord, turn: int, outcome: Outcome) -> bool:
        """A generation cancelled by an update (not by the budget): its group wound down when it
        is now too stale, else the turn issued again from the exact record it had, under the new
        version. ``False``: not such a completion."""
        if not (outcome.kind == RAISED and isinstance(outcome.value, Stopped)) or self.stopping:
            return False
        self.restore_record(rec)
        if self.doomed(rec):
            self.wind_down(rec)
        else:
            self.stats['aborted_generations'] += 1
            self.generate(rec, turn)
        return True

    # ---- a group that will not be delivered ------------------------------------------------------
    def rerun_if_stale(self, group: InFlightGroup) -> bool:
        """A finished group too stale to deliver: dropped, or admitted again from fresh copies of
        its prompts (``True``); ``False``: deliver it."""
        if not (group.doomed or self.too_stale(group)):
            return False
        if self.stale_policy == 'drop':
            self.stats['dropped_groups'] += 1
            self.release(rec.uuid for rec in group.records)
            return True
        self.stats['restarted_groups'] += 1
        group.restarts += 1
        prompts = group.prompts
        group.prompts = [fresh_copy(p) for p in prompts]
        self.admit(group, prompts)
        return True

    def consumer_caught_up(self) -> bool:
        """With ``max_staleness``, a group is checked again when the consumer takes it (it may
        come back to run again): the stream ends only once every group handed out was taken."""
        return self.max_staleness is None or (self.taken >= self.handed_out and not self.returned)

    def take_back(self, group: StreamGroup) -> None:
        """The consumer found ``group`` too stale (its thread): run it again, or, once the driver
        has ended, hand it back unfinished at once."""
        with self.returned_lock:
            if not self.ended:
                self.returned.append(group)
                return
        self.hand_back_group(group)

    def hand_back_group(self, stale: StreamGroup) -> None:
        """A stale group that cannot run again here (the stream is stopping or over): not
        delivered after all; its members go back in :attr:`unfinished` as fresh prompts (not
        started), so that ``Executor(mode='async').run(stream.unfinished)`` or ``mtflow run
        --resume`` runs them."""
        self.uncount(stale)
        self.hand_back_prompts(stale.prompts)

    def hand_back_prompts(self, prompts: List[Any]) -> None:
        """A group that will not be delivered goes back in :attr:`unfinished` as fresh prompts."""
        self.stats['handed_back_groups'] += 1
        for prompt in prompts:
            index = self.next_index
            self.next_index += 1
            self.unfinished.append(UnfinishedRequest(RequestRecord(index, uuid_of(prompt, index), prompt), False))

    def uncount(self, stale: StreamGroup) -> None:
        self.delivered_groups -= 1
        self.delivered_requests -= len(stale.outputs)
        self.delivered_tokens -= stale.tokens

    def readmit_returned(self) -> None:
        """Run again, from their prompts, the groups the consumer found too stale (handed back
        instead when the stream is stopping)."""
        with self.returned_lock:
            returned = list(self.returned)
            self.returned.clear()
        for stale in returned:
            if self.stopping:
                self.hand_back_group(stale)
                continue
            self.uncount(stale)
            self.stats['restarted_groups'] += 1
            group = InFlightGroup(stale.seq, [fresh_copy(p) for p in stale.prompts], restarts=stale.restarts + 1)
            self.admit(group, stale.prompts)

    def end_returns(self) -> List[StreamGroup]:
        """The driver ended: what the consumer sends back from now on is handed back at once;
        returns the groups it had sent back meanwhile."""
        with self.returned_lock:
            self.ended = True
            left = list(self.returned)
            self.returned.clear()
        return left
