"""The streaming producer (``Executor.stream``): a source of requests in, finished groups out.

A fully-async trainer wants rollouts that keep the engine busy while it trains, in constant
memory, and with a bound on how stale the data is. :class:`StreamDriver` is the async driver
(:mod:`mtflow.engine.async_driver`: the same handlers, moves and outputs, one request at a time)
fed from an iterator instead of a list:

* the source yields requests, or lists of requests (a GRPO group: its copies of one prompt); a
  request alone is a group of one. Members are admitted while fewer than ``max_concurrency``
  requests are in flight, a group is pulled from the source only when the queue is empty, and a
  group is handed out the moment its last member finishes (:class:`StreamGroup`);
* **backpressure**: at most ``buffer`` finished groups wait for the consumer; past that the
  driver admits nothing new (what is in flight goes on);
* **constant memory**: a record lives from its admission to its group's delivery; the trace is
  kept per request (:attr:`StreamGroup.events`), never for the whole run;
* **policy versions** (:mod:`mtflow.engine.versions`): every generated turn is stamped with the
  version current when it was issued; each group carries its ``version_span`` (newest - oldest)
  and ``age`` (the version at delivery - its oldest);
* **bounded staleness** (``max_staleness=k``): a group whose oldest turn would be more than ``k``
  versions behind at delivery is never delivered: ``stale='restart'`` runs it again from its
  prompts, ``'drop'`` discards it. Such a group is interrupted as soon as an update makes it
  stale (its generations in flight are cancelled), not when it finishes. ``on_update='abort'``
  also cancels every generation in flight at an update and issues it again under the new weights
  from the exact token record it had (the turn is generated again); ``'resume'`` (a resumable
  ``rollout_fn``, :mod:`mtflow.engine.resume`) cancels them too but continues each from the
  exact ids it had generated, under the new version (AReaL's interruptible generation);
  ``'keep'`` (default) lets it finish.

The driver runs in its own thread (:class:`Stream`), so the engine keeps generating while the
consumer trains; ``stream.close()`` (or leaving its ``with`` block, or the budget ``until``)
stops it: the generations in flight are cancelled and their requests handed back in
:attr:`Stream.unfinished`, exactly as a partial rollout hands them back.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from time import perf_counter
from collections import deque
from typing import (Any, AsyncIterator, Callable, ClassVar, Deque, Dict, Iterable, Iterator, List, Optional, Tuple,
                    Union)

from mtflow.core.calls import OK, RAISED, Outcome, wrapped_methods
from mtflow.core.keys import coerce_fields
from mtflow.core.machine import FINISHED, RequestRecord
from mtflow.engine.async_driver import AsyncDriver
from mtflow.engine.branching import plant, tree_record, trees_of
from mtflow.engine.in_flight import Stopped
from mtflow.engine.moves import interrupt_all
from mtflow.engine.partial import Budget, UnfinishedRequest
from mtflow.engine.resume import GenerationAborted
from mtflow.engine.run_state import RunSettings, RunState, uuid_of
from mtflow.engine.staleness import STALE_POLICIES, UPDATE_POLICIES, Staleness, check_policies
from mtflow.engine.stream_groups import (InFlightGroup, StreamGroup, completion_tokens, delivered_group, fresh_copy,
                                         span_and_age)
from mtflow.engine.stream_resume import Resumption
from mtflow.engine.versions import PolicyClock

__all__ = ['Stream', 'StreamGroup', 'StreamUntil', 'StreamDriver', 'STALE_POLICIES', 'UPDATE_POLICIES', 'open_stream',
           'DEFAULT_STREAM_CONCURRENCY', 'NOTHING_YET']

#: requests in flight when neither the stream nor the executor says (``max_concurrency``)
DEFAULT_STREAM_CONCURRENCY = 64

#: what a source yields when it has nothing now but is not done (a gateway waiting for its next
#: session): the driver takes nothing and waits until poked (:meth:`Stream.poke`) or other work
#: completes; a source that blocks in ``next`` instead would stall the requests in flight
NOTHING_YET = object()

_END = object()


@dataclass(frozen=True)
class StreamUntil(Budget):
    """When a stream stops: after ``requests`` delivered requests, ``groups`` delivered groups,
    ``seconds`` of streaming or ``tokens`` delivered completion tokens, whichever comes first."""
    COUNTS: ClassVar[Tuple[str, ...]] = ('requests', 'groups', 'tokens')
    requests: Optional[int] = None
    groups: Optional[int] = None
    seconds: Optional[float] = None
    tokens: Optional[int] = None

    def __post_init__(self) -> None:
        values = {k: getattr(self, k) for k in ('requests', 'groups', 'seconds', 'tokens')}
        if all(v is None for v in values.values()):
            raise ValueError('until needs one of requests=, groups=, seconds=, tokens=')
        for key, value in values.items():
            if value is None:
                continue
            number = (int, float) if key == 'seconds' else (int, )
            if isinstance(value, bool) or not isinstance(value, number) or value <= 0:
                kind = 'a number' if key == 'seconds' else 'an int'
                raise ValueError(f'until: {key} must be {kind} > 0, not {value!r}')

    @classmethod
    def coerce(cls, value: Any) -> Optional['StreamUntil']:
        """``None``, a :class:`StreamUntil`, or a dict like ``{'groups': 8}``."""
        return coerce_fields(cls, value, 'until')


class _NoEvents(list):
    """The run-wide trace list of a stream: kept per request instead (constant memory)."""

    def append(self, item: Any) -> None:  # noqa: D401 - a sink
        pass


def forget_fn(rollout_fn: Any) -> Optional[Callable[[str], None]]:
    """The ``forget(uuid)`` of a ``rollout_fn`` that keeps state per request (the scripted and
    replay backends), looked up through its wrappers (:func:`~mtflow.core.calls.wrapped_methods`),
    or ``None``. A stream calls it once for each request that is final, so that such a backend's
    memory stays flat however many requests stream through it."""
    found = wrapped_methods(rollout_fn, 'forget')
    return found[0] if found else None


class StreamDriver(AsyncDriver):
    """The async driver over a source (see the module docstring); runs in :class:`Stream`'s thread.
    It drives (the loop, admission, delivery, the budget) and acts on what the policies it holds
    answer: :attr:`staleness` (:class:`~mtflow.engine.staleness.Staleness`: what an update does to
    the work in flight) and :attr:`resumption` (:class:`~mtflow.engine.stream_resume.Resumption`:
    continuing a cut generation)."""
    stamp_always = True

    def __init__(self, run: RunState, source: Iterator[Any], clock: PolicyClock, *, max_concurrency: int,
                 buffer: int, until: Optional[StreamUntil], max_staleness: Optional[int], stale: str,
                 on_update: str, deliver: Any) -> None:
        super().__init__(run, None, clock)
        run.requests = {}  # not the caller's list: a step's next request is not written back anywhere
        run.keeps_records = False  # each record is kept by its group, from admission to delivery
        if run.recorder is not None:
            run.recorder.raw = _NoEvents()
        self.source = source
        self.source_done = False
        self.max_concurrency = max_concurrency if self.session_bound is None else min(max_concurrency,
                                                                                      self.session_bound)
        self.held: Optional[List[Any]] = None  # a group pulled that must wait for free sessions
        self.stream_started_rounds = 0
        self.buffer = buffer
        self.budget = until  # the stream's StreamUntil (the run's Until is the async driver's)
        self.deliver_fn = deliver
        self.forget_request = forget_fn(run.settings.rollout_fn)
        #: the groups in flight, by id (each member's record holds its own: ``record.group``)
        self.in_flight: Dict[int, InFlightGroup] = {}
        self.next_seq = 0
        self.delivered_groups = 0
        self.delivered_requests = 0
        self.delivered_tokens = 0
        self.taken = 0  # groups the consumer took (written by the consumer's thread)
        self.interrupting = False
        self.poked = False
        self.handed_out = 0  # groups put in the consumer's queue, ever
        self.unfinished: List[UnfinishedRequest] = []
        self.stats = {'restarted_groups': 0, 'dropped_groups': 0, 'aborted_generations': 0,
                      'resumed_generations': 0, 'handed_back_groups': 0,
                      'backpressure_waits': 0, 'max_active': 0}
        self.staleness = Staleness(max_staleness, stale, on_update, clock.current(run.settings.rollout_fn))
        self.resumption = Resumption()
        if on_update == 'resume':
            self.call_config = self.resumption.call_config  # a cut generation's max_tokens: what is left
        #: groups the consumer found too stale when it took them, to run again (its thread appends)
        self.returned: Deque[StreamGroup] = deque()
        #: guards ``returned`` against the driver's end: a group the consumer sends back after
        #: the driver ended is handed back (``unfinished``) in the consumer's thread instead
        self.returned_lock = threading.Lock()
        self.ended = False

    # ---- other threads -----------------------------------------------------------------------
    def poke(self) -> None:
        """Wake the driver from another thread (a group taken, a new version, close)."""
        self.poked = True
        loop, wake = self.run.loop, self.flight.wake
        if wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop closed meanwhile
                pass

    # ---- the loop ----------------------------------------------------------------------------
    def drive(self) -> None:  # type: ignore[override]
        flight = self.flight
        flight.start()
        self.t_start = perf_counter()
        try:
            while True:
                self.poked = False
                self.readmit_returned()
                self.check_version()
                if self.over_budget():
                    self.stop()
                elif not self.stopping:
                    self.fill_slots()
                if flight.idle():
                    if self.stopping or (self.source_done and not self.queue and self.active == 0
                                         and self.consumer_caught_up()):
                        break
                    self.stats['backpressure_waits'] += 1  # only the consumer can free a place now
                batch = flight.wait(self.has_news, self.budget_left())
                for kind, rec, turn, outcome in sorted(batch, key=lambda c: c[1].index):
                    self.on_completion(kind, rec, turn, outcome)
                    if self.over_budget():
                        self.stop()
        except BaseException as exc:
            with self.returned_lock:
                self.ended = True
            flight.cancel_all()
            flight.close(wait=False)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):  # user code raised it in this thread
                self.interrupted_here()
            raise
        flight.close(wait=not self.interrupting)  # a signal's stop never waits for a call that hangs
        self.restore_records()
        self.hand_back_whole()
        if self.interrupting and self.unfinished:
            self.deliver_interrupted()
        for stale in self.end_returns():  # sent back after the budget stopped the stream: run again on resume
            self.hand_back_group(stale)

    def interrupted_here(self) -> None:
        """An interrupt raised by user code in the driver's thread (a step's ``KeyboardInterrupt``)
        stops the stream as :meth:`Stream.interrupt` would: what finished is delivered, the requests
        in flight as one group of ``interrupted`` ones, before the interrupt reaches the consumer."""
        self.interrupting = True
        self.stop()
        self.hand_back_whole()
        if self.unfinished:
            self.deliver_interrupted()

    def hand_back_whole(self) -> None:
        """The stream stopped: every group still in flight goes back whole, its members together
        and in source order in :attr:`unfinished`. A member that finished while the rest of its
        group ran goes back finished (resuming the group returns its output as it is); on an
        interrupt it is delivered instead, under its group's ``seq``, before the last group of
        interrupted requests. A group too stale to deliver goes back as fresh prompts, as a stale
        group does."""
        in_flight = self.in_flight
        if not in_flight:
            return
        back = {item.record.index: item for item in self.unfinished}
        members = {rec.index for g in in_flight.values() for rec in g.records}
        rest = [item for item in self.unfinished if item.record.index not in members]
        grouped: List[UnfinishedRequest] = []
        for group in sorted(in_flight.values(), key=lambda g: min(r.index for r in g.records)):
            if group.doomed:  # too stale to deliver: its fresh prompts are appended to self.unfinished
                self.hand_back_prompts(group.prompts)
                continue
            members = group.records
            if self.interrupting:  # what finished is delivered under the group's seq, the rest interrupted
                done = [rec for rec in members if rec.state == FINISHED]
                if done:
                    self.handed_out += 1
                    cut = delivered_group(self.run, InFlightGroup(group.seq, [], done, len(done)),
                                          self.staleness.seen_version)
                    if self.run.branching is not None:  # the whole trees: a cut one's leaves are not done
                        cut.trees = [tree_record(tree) for tree in trees_of(members)]
                    self.deliver_fn(cut)
                members = [rec for rec in members if rec.state != FINISHED]
            grouped.extend(back.get(rec.index) or UnfinishedRequest(rec, True) for rec in members)
        moved = self.unfinished[len(back):]  # the doomed groups' fresh prompts, just appended
        self.unfinished = grouped + rest + moved
        self.in_flight = {}

    def deliver_interrupted(self) -> None:
        """An interrupt (:meth:`Stream.interrupt`): the requests handed back are finished with
        reason ``interrupted`` (partial outputs, as an interrupted run finishes them) and handed
        out as one last group, ``seq`` -1."""
        run = self.run
        records = [item.record for item in self.unfinished]
        self.unfinished = []
        run.records = records
        interrupt_all(run)
        run.records = []
        self.handed_out += 1
        self.deliver_fn(delivered_group(run, InFlightGroup(-1, [], records, len(records)), self.staleness.seen_version))

    def has_news(self) -> bool:
        return bool(self.flight.completions) or self.poked  # poked: a weight update or a taken group

    # ---- admission ---------------------------------------------------------------------------
    def backpressured(self) -> bool:
        return self.delivered_groups - self.taken >= self.buffer

    def fill_slots(self) -> None:
        while self.active < self.max_concurrency:
            self.admit_entering()
            if not self.queue and not self.pull():
                break
            super().fill_slots()
        self.stats['max_active'] = max(self.stats['max_active'], self.active)

    def pull(self) -> bool:
        """Take the next group from the source and admit its members; ``False``: nothing to take
        (the source is done, the consumer is behind, or the stream is stopping)."""
        if (self.source_done and self.held is None) or self.stopping or self.backpressured():
            return False
        if self.held is not None:
            members, self.held = self.held, None
        else:
            try:
                item = next(self.source)
            except StopIteration:
                self.source_done = True
                return False
            if item is NOTHING_YET:  # an open-ended source with nothing now: it pokes the driver when it has
                return False
            members = list(item) if isinstance(item, (list, tuple)) else [item]
        if not members:
            return True
        if not self.room_for(members):
            self.held = members
            return False
        group = InFlightGroup(self.next_seq, [fresh_copy(m) for m in members])
        self.next_seq += 1
        self.admit(group, members)
        return True

    def room_for(self, members: List[Any]) -> bool:
        """Under a session bound (``mtflow.engine.admission``): do ``members`` fit beside the
        requests started and not finished (each holds an environment session; a branched run's
        prompt, its tree's, :meth:`tree_room`)? A group larger than the bound never fits: an
        error, not a wait."""
        bound, each = self.session_bound, self.prompt_sessions
        if bound is None:
            return True
        if len(members) * each > bound:
            held = f', each a tree of up to {each} leaves,' if each > 1 else ''
            raise ValueError(f'a stream group of {len(members)} requests{held} is larger than admission.env_sessions '
                             f'({bound}): its members hold their sessions together')
        if each > 1:
            if self.tree_room() < len(members):
                return False
        else:
            started = self.active + len(self.queue)
            if started and started + len(members) > bound:
                return False
        if self.stream_started_rounds:
            self.run.options.admission.env_sessions.waited(perf_counter() - self.t_start)
        self.stream_started_rounds += 1
        return True

    def admit(self, group: InFlightGroup, requests: List[Any]) -> None:
        """``on_trajectory_start`` for the group's members and their place in the queue."""
        run = self.run
        records = []
        for request in requests:
            index = run.take_index()
            rec = RequestRecord(index, uuid_of(request, index), request)
            if run.recorder is not None:
                rec.events = []
            rec.group = group
            records.append(rec)
        group.records = records
        self.in_flight[id(group)] = group
        group.done = 0
        group.tokens = 0
        group.doomed = False
        plant(run.branching, records)
        if self.prompt_sessions > 1:  # their trees hold their sessions from now on (room_for)
            self.open_trees.extend(rec.branch.tree for rec in records if rec.branch is not None)
        self.begin(records)
        for rec in records:
            if rec.state == FINISHED:  # on_trajectory_start failed: finished before it took a slot
                self.active += 1
                self.release_finished(rec)
            else:
                self.queue.append(rec)

    # ---- issuing work ----------------------------------------------------------------------------
    def generate(self, rec: RequestRecord, turn: int) -> None:
        if self.staleness.doomed(rec):
            self.wind_down(rec)  # no more work for a group that will not be delivered
            return
        with self.resumption.prefixed(rec):
            super().generate(rec, turn)

    def on_completion(self, kind: str, rec: Any, turn: int, outcome: Any) -> None:
        if kind == 'generate':
            outcome = self.resumed(rec, turn, outcome)
            if outcome is None or self.cancelled_by_update(rec, turn, outcome):
                return
            if outcome.kind == OK:
                group = rec.group
                if group is not None:
                    group.tokens += completion_tokens(outcome.value)
        super().on_completion(kind, rec, turn, outcome)

    def on_generated(self, rec: RequestRecord, turn: int) -> None:
        super().on_generated(rec, turn)
        self.resumption.applied(rec, turn)

    # ---- what an update does to the work in flight (the policies' answers, acted on) -------------
    def check_version(self) -> None:
        """A new version: cancel the generations in flight it cancels (``on_update='abort'``,
        ``'resume'``: all; issued again under it), and wind down every group it makes too stale."""
        staleness = self.staleness
        if self.stopping or not staleness.update(self.clock.current(self.run.settings.rollout_fn)):
            return
        for rec, task in self.flight.generations():
            if staleness.cancels(rec):
                task.cancel()
        if staleness.max_staleness is not None:
            for group in list(self.in_flight.values()):
                if not group.doomed and staleness.too_stale(group):
                    group.doomed = True

    def resumed(self, rec: RequestRecord, turn: int, outcome: Outcome) -> Optional[Outcome]:
        """A generation's outcome seen through resumption: ``None`` when it was cut by an update
        and issued again from the ids it had (nothing more to do); else the outcome to handle, the
        whole turn when it was the last segment of a cut one. A cut once the budget stopped the
        stream is a plain cancellation (handed back; the turn is generated again on resume)."""
        if outcome.kind == RAISED and isinstance(outcome.value, GenerationAborted):
            if self.stopping:
                rec.resume_from = None
                return Outcome(RAISED, Stopped('cancelled'), outcome.duration)
            self.issue_again(rec, turn, 'resumed_generations', cut=outcome.value)
            return None
        if outcome.kind == OK and rec.resume_from is not None:
            return self.resumption.merge(rec, outcome)
        return outcome

    def cancelled_by_update(self, rec: RequestRecord, turn: int, outcome: Outcome) -> bool:
        """A generation cancelled by an update (not by the budget): its group wound down when it
        is now too stale, else the turn issued again from the exact record it had, under the new
        version. ``False``: not such a completion."""
        if not (outcome.kind == RAISED and isinstance(outcome.value, Stopped)) or self.stopping:
            return False
        self.issue_again(rec, turn, 'aborted_generations')
        return True

    def issue_again(self, rec: RequestRecord, turn: int, counted: str, cut: Optional[GenerationAborted] = None) -> None:
        """A generation an update stopped: ``rec`` back to the exact record it had (a cut's ids
        are in the resume prefix, not in the token record), then its group wound down when it is
        now too stale, else the turn issued again under the new version (from the ids ``cut``
        kept, when given) and counted in ``stats[counted]``."""
        self.restore_record(rec)
        if self.staleness.doomed(rec):
            rec.resume_from = None
            self.wind_down(rec)
            return
        if cut is not None:
            self.resumption.cut(rec, cut)
        self.stats[counted] += 1
        self.generate(rec, turn)

    def rerun_if_stale(self, group: InFlightGroup) -> bool:
        """A finished group too stale to deliver: dropped, or admitted again from fresh copies of
        its prompts (``True``); ``False``: deliver it."""
        if not (group.doomed or self.staleness.too_stale(group)):
            return False
        if self.staleness.stale == 'drop':
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
        """Whether every group handed out was taken (when the consumer judges them again, one may
        come back to run again: the stream ends only after that)."""
        return not self.staleness.rechecks_taken or (self.taken >= self.handed_out and not self.returned)

    def take_back(self, group: StreamGroup) -> None:
        """The consumer found ``group`` too stale (its thread): run it again, or, once the driver
        has ended, hand it back unfinished at once."""
        with self.returned_lock:
            if not self.ended:
                self.returned.append(group)
                return
        self.hand_back_group(group)

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
            index = self.run.take_index()
            self.unfinished.append(UnfinishedRequest(RequestRecord(index, uuid_of(prompt, index), prompt), False))

    def uncount(self, stale: StreamGroup) -> None:
        self.delivered_groups -= 1
        self.delivered_requests -= len(stale.outputs)
        self.delivered_tokens -= stale.tokens

    def restore_record(self, rec: RequestRecord) -> None:
        before, rec.sent_record = rec.sent_record, None
        self.dropped.append((rec, before))
        self.restore_records()
        self.dropped.clear()

    def wind_down(self, rec: RequestRecord) -> None:
        """A member of a doomed group stops where it is (its slot is free)."""
        self.active -= 1
        self.member_done(rec)

    # ---- delivery ------------------------------------------------------------------------------
    def release_finished(self, rec: RequestRecord) -> None:
        super().release_finished(rec)
        self.member_done(rec)

    def hand_back(self, rec: RequestRecord) -> None:
        super().hand_back(rec)
        self.unfinished.append(UnfinishedRequest(rec, True))  # its group goes back whole (hand_back_whole)

    def hand_back_resting(self, rec: RequestRecord) -> None:
        super().hand_back_resting(rec)
        self.unfinished.append(UnfinishedRequest(rec, True))  # its group goes back whole (hand_back_whole)

    def member_done(self, rec: RequestRecord) -> None:
        group = rec.group
        if group is None:
            return
        group.done += 1
        if group.done == len(group.records):
            self.complete(group)

    def complete(self, group: InFlightGroup) -> None:
        """The group's last member finished: delivered (or run again when too stale). Nothing
        else is kept for its members: what was in flight was on their records."""
        self.in_flight.pop(id(group), None)
        for rec in group.records:
            self.started.discard(rec.index)
        if self.rerun_if_stale(group):
            return
        delivered = delivered_group(self.run, group, self.staleness.seen_version)
        if self.run.branching is not None:
            delivered.trees = [tree_record(tree) for tree in trees_of(group.records)]
        self.handed_out += 1
        self.delivered_groups += 1
        self.delivered_requests += len(group.records)
        self.delivered_tokens += group.tokens
        self.deliver_fn(delivered)
        for rec in group.records:  # delivered: its members need their group no more (a cycle per group
            rec.group = None       # otherwise, which only the cyclic collector's slow full passes free)

    def release(self, uuids: Iterable[str]) -> None:
        """These requests are final (taken by the consumer, or dropped): the ``rollout_fn``'s
        ``forget`` drops what it keeps for them (:func:`forget_fn`). Not for a group that runs
        again (a restart replays from its prompts, as before) nor for a request handed back."""
        if self.forget_request is not None:
            for uuid in uuids:
                self.forget_request(uuid)

    # ---- the budget ------------------------------------------------------------------------------
    def done_counts(self) -> Dict[str, int]:
        return {'requests': self.delivered_requests, 'groups': self.delivered_groups, 'tokens': self.delivered_tokens}

    def stop(self) -> None:
        if self.stopping:
            return
        for rec in self.queue:  # admitted, never generated (no slot held): handed back as they are
            self.unfinished.append(UnfinishedRequest(rec, True))
        super().stop()
        if self.interrupting:  # a signal: a step (a tool that hangs) must not hold the stop up
            for task in self.flight.steps():
                task.cancel()


class Stream:
    """What :meth:`mtflow.Executor.stream` returns: an iterator of :class:`StreamGroup` (also a
    context manager). The driver runs in a daemon thread on its own event loop; ``close()`` stops
    it and hands back the requests in flight (:attr:`unfinished`); :attr:`stats` has its counts
    (delivered, restarted and dropped groups, aborted generations, the most requests in flight)."""

    def __init__(self, make_driver: Any, close_loop: Any, clock: PolicyClock) -> None:
        self._out: 'queue.Queue[Any]' = queue.Queue()
        self._error: Optional[BaseException] = None
        self._loop = asyncio.new_event_loop()
        self._close_loop = close_loop
        self.driver: StreamDriver = make_driver(self._loop, self._out.put)
        self._finished = False
        #: groups that finished but were not taken when the stream was closed (:meth:`close`)
        self.untaken: List[StreamGroup] = []
        self.dropped_when_taken = 0
        self._unlisten = clock.listen(lambda _version: self.driver.poke())
        self._thread = threading.Thread(target=self._main, name='mtflow-stream', daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            self.driver.drive()
            self.driver.end_trajectory(None)
        except BaseException as exc:  # handed to the consumer
            self._error = exc
        finally:
            self._unlisten()
            self._close_loop(self._loop)
            self._out.put(_END)

    def __iter__(self) -> 'Stream':
        return self

    def poke(self) -> None:
        """Wake the driver from any thread: an open-ended source that yielded
        :data:`NOTHING_YET` has something now."""
        self.driver.poke()

    def __next__(self) -> StreamGroup:
        while True:
            if self._finished:
                raise StopIteration
            item = self._out.get()
            if item is _END:
                self._finished = True
                self._thread.join()
                if self._error is not None:
                    raise self._error
                raise StopIteration
            fresh = self._fresh_enough(item)
            if fresh or self.driver.staleness.stale == 'drop':  # final: delivered, or dropped
                self.driver.release(item.uuids)
            self.driver.taken += 1
            self.driver.poke()
            if fresh:
                return item

    def _fresh_enough(self, group: StreamGroup) -> bool:
        """The bound again when the consumer takes a group (the weights may have moved while it
        waited in the buffer): its ``age`` and ``version`` are updated to now; a group now too
        stale goes back to the driver (``restart``) or is dropped, and the next one is taken."""
        driver = self.driver
        if not any(group.versions) or group.seq < 0:
            return True
        current = driver.clock.current(driver.run.settings.rollout_fn)
        group.version, group.age = current, span_and_age(group.versions, current)[1]
        if not driver.staleness.too_old(group.age):
            return True
        if driver.staleness.stale == 'drop':
            self.dropped_when_taken += 1
        else:
            driver.take_back(group)
        return False

    def stop(self, interrupt: bool = False) -> None:
        """Ask the driver to stop, from any thread, and return at once: iterating the stream then
        yields what is left (with ``interrupt``, as :meth:`interrupt` describes) and ends. For a
        consumer iterating in another thread (a gateway's)."""
        if not self._finished:
            if interrupt:
                self.driver.interrupting = True
            self.driver.closing = True
            self.driver.poke()

    def close(self) -> None:
        """Stop: nothing new is admitted, generations in flight are cancelled, their groups
        handed back whole (:attr:`unfinished`); groups already finished and not taken are kept in
        :attr:`untaken`."""
        if not self._finished:
            self.stop()
            self.untaken.extend(self)

    def interrupt(self) -> List[StreamGroup]:
        """Stop as :meth:`close` does, but finish the requests in flight with reason
        ``interrupted`` (partial outputs, what ``mtflow run`` keeps in ``interrupted.jsonl``).
        Returns what was not taken yet: the groups that finished (a group the interrupt cut
        comes as its finished members, under its ``seq``), then (when anything was in flight) one
        group of the interrupted requests, ``seq`` -1."""
        if self._finished:
            return []
        self.stop(interrupt=True)
        return list(self)

    def __enter__(self) -> 'Stream':
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def unfinished(self) -> List[UnfinishedRequest]:
        return self.driver.unfinished

    @property
    def stats(self) -> Dict[str, int]:
        d = self.driver
        return {'rollout_fn_calls': d.run.rollout_calls, 'delivered_groups': d.delivered_groups,
                'delivered_requests': d.delivered_requests,
                'delivered_tokens': d.delivered_tokens, **d.stats,
                'dropped_groups': d.stats['dropped_groups'] + self.dropped_when_taken}


async def aiter_stream(stream: Stream) -> AsyncIterator[StreamGroup]:
    """The async twin's iterator: each next group awaited in a worker thread."""
    try:
        while True:
            item = await asyncio.to_thread(next, stream, None)
            if item is None:
                return
            yield item
    finally:
        await asyncio.to_thread(stream.close)


def iterate(source: Union[Iterable[Any], Any]) -> Iterator[Any]:
    """An iterator over ``source``: an iterable, or an async iterator (pulled on a private loop
    in the driver's thread, one item at a time)."""
    if hasattr(source, '__anext__') or hasattr(source, '__aiter__'):
        return _sync_of_async(source)
    return iter(source)


def _sync_of_async(source: Any) -> Iterator[Any]:
    agen = source.__aiter__() if hasattr(source, '__aiter__') else source
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.close()


def open_stream(settings: RunSettings, clock: PolicyClock, close_loop: Any, source: Any, *,
                max_concurrency: Optional[int] = None, buffer: Optional[int] = None, until: Any = None,
                max_staleness: Optional[int] = None, stale: str = 'restart', on_update: str = 'keep') -> Stream:
    """:meth:`mtflow.Executor.stream`'s work: check the options, start the driver's thread."""
    def positive(name: str, value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f'stream: {name} must be None or an int >= 1, not {value!r}')

    positive('max_concurrency', max_concurrency)
    positive('buffer', buffer)
    check_policies(max_staleness, stale, on_update, settings.rollout_fn)
    if settings.options.gather_fn is not None:
        raise ValueError('stream: one rank per stream (no gather_fn): each rank streams its own source')
    budget = StreamUntil.coerce(until)
    concurrency = max_concurrency or settings.options.max_concurrency or DEFAULT_STREAM_CONCURRENCY
    items = iterate(source)

    def make(loop: asyncio.AbstractEventLoop, deliver: Any) -> StreamDriver:
        return StreamDriver(RunState(settings, loop, []), items, clock, max_concurrency=concurrency,
                            buffer=buffer or max(1, concurrency), until=budget, max_staleness=max_staleness,
                            stale=stale, on_update=on_update, deliver=deliver)

    return Stream(make, close_loop, clock)
