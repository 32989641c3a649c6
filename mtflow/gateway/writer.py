"""Writing finished sessions into the run directory: the gateway's only writer.

A consumer thread takes each finished session from the gateway's stream; the writer thread writes
it (:class:`mtflow.run.driver.StreamingRun`'s writer: the trajectory line with its ``turns``, the
trace events, ``interrupted.jsonl`` for an interrupted one). A session that a limit ended (not the
client's finish, nor idle, nor an interrupt) is *parked* until its client's finish brings the
reward (:meth:`SessionWriter.parked`), or for ``grace_s`` at most; then it is written as it is.
The writer's ticks also sweep the sessions idle past their timeout (:meth:`SessionTable.idle`).

A session whose line cannot be written at all (its uuid is written already, a value JSON cannot
hold) gets a 500 on its finish, never a summary, and the gateway ends with that error naming it.
A session counts as written (its client's ``POST /finish`` is answered, a later finish gets its
summary) only once its line is durable: the writer writes every job queued at the moment, then
flushes the run store (its lines written and fsynced, :meth:`mtflow.run.store.RunStore.flush`),
then answers them all. Concurrent finishes share one fsync; a ``SIGKILL`` after an answer never
loses the session it answered.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Dict, List, Optional, Tuple

from mtflow.accounting.segments_split import segments_of
from mtflow.core.machine import CLIENT_FINISHED, IDLE_TIMEOUT, INTERRUPTED
from mtflow.core.records import FinishedRequest
from mtflow.gateway.sessions import Session, SessionTable

__all__ = ['SessionWriter', 'NOT_PARKED']

#: finish reasons written at once: the client's finish came with them, or none will come
NOT_PARKED = frozenset((CLIENT_FINISHED, IDLE_TIMEOUT, INTERRUPTED))
_STOP = object()


class SessionWriter:
    """The consumer and writer threads of one gateway (see the module docstring).

    Args:
        stream: the gateway's :class:`mtflow.engine.stream.Stream`.
        table: its sessions.
        run: the :class:`mtflow.run.driver.StreamingRun` whose writer writes the lines.
        grace_s: how long a parked session waits for its reward.
        idle_timeout_s: how long a session's step waits for its next call.
        t_offset: seconds from the run's start to the stream's (added to the events' times).
    """

    def __init__(self, stream: Any, table: SessionTable, run: Any, grace_s: float, t_offset: float,
                 idle_timeout_s: float) -> None:
        self.stream, self.table, self.run = stream, table, run
        self.grace_s, self.t_offset, self.idle_timeout_s = grace_s, t_offset, idle_timeout_s
        self.jobs: 'queue.Queue[Any]' = queue.Queue()
        self.written = 0
        #: sessions written but not yet durable: ``(name, summary)``, answered after the next flush
        self.unsynced: List[Tuple[str, Dict[str, Any]]] = []
        self.syncs = 0  # flushes made to answer finishes (one per batch of sessions written together)
        self.error: Optional[BaseException] = None
        self.threads: List[threading.Thread] = []

    def start(self) -> None:
        for target, name in ((self._consume, 'mtflow-gateway-consumer'), (self._write_loop, 'mtflow-gateway-writer')):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self.threads.append(thread)

    def join(self) -> None:
        """After the stream was asked to stop: wait until everything it delivered is written."""
        for thread in self.threads:
            thread.join()

    def parked(self, name: str, parked: Any) -> None:
        """A parked session's reward came (:meth:`SessionTable.post_finish`): write it now."""
        self.jobs.put(('parked', name, parked))

    # ---- the threads ---------------------------------------------------------------------------
    def _consume(self) -> None:
        try:
            for group in self.stream:
                self.jobs.put(('group', group))
        except BaseException as exc:  # the stream failed: said when the gateway closes
            self.error = exc
        finally:
            self.jobs.put(_STOP)

    def _write_loop(self) -> None:
        tick = min(0.5, max(0.05, min(self.grace_s, self.idle_timeout_s) / 4))
        store = self.run.store
        while True:
            try:
                jobs = [self.jobs.get(timeout=tick)]
            except queue.Empty:
                jobs = []
            while jobs and jobs[-1] is not _STOP:  # everything queued now: written together, one fsync
                try:
                    jobs.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            for job in jobs:
                if job is _STOP:
                    self._guarded(self._last_writes, store)
                    return
                self._guarded(self._handle, job)  # one job failing never drops the others
            self._guarded(self._tick, store)

    def _guarded(self, fn: Any, *args: Any) -> None:
        """``fn(*args)``; a failure (a full disk) is kept (the first one), said when the gateway
        closes, and the writer goes on with what it can."""
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - see the docstring
            self.error = self.error or exc

    def _tick(self, store: Any) -> None:
        for session, parked in self.table.expired(self.grace_s):
            self._write(session, *parked)
        self._sync(store)
        self.table.idle(self.idle_timeout_s)
        store.tick()

    def _last_writes(self, store: Any) -> None:
        """The stream ended: the parked sessions as they are, then the last sync."""
        for session, parked in self.table.close():
            self._write(session, *parked)
        self._sync(store)

    def _handle(self, job: Any) -> None:
        if job[0] == 'group':
            self._delivered(job[1])
            return
        session = self.table.get(job[1])
        if session is not None:
            self._write(session, *job[2])

    def _sync(self, store: Any) -> None:
        """Make the sessions written since the last sync durable, then answer their finishes."""
        if not self.unsynced:
            return
        store.flush()  # raises on a full disk: the finishes stay unanswered (their clients time out)
        self.syncs += 1
        done, self.unsynced = self.unsynced, []
        for name, summary in done:
            self.table.written(name, summary)

    def _delivered(self, group: Any) -> None:
        failures = {f.uuid: f for f in group.failures}
        for k, uuid in enumerate(group.uuids):
            reason = group.finish_reasons[k]
            finished = FinishedRequest(0, uuid, group.outputs[k], reason, failures.get(uuid), group.events[k])
            session = self.table.finished_output(uuid, (finished, group.requests[k]), reason not in NOT_PARKED)
            if session is not None:
                self._write(session, finished, group.requests[k])

    def _write(self, session: Session, finished: FinishedRequest, request: Any) -> None:
        """One session's line (the client's reward and info added when a limit ended it first);
        the finish calls waiting get its summary once it is durable."""
        infos = getattr(finished.output, 'rollout_infos', None)
        finish = session.finish
        if isinstance(infos, dict) and finish is not None and 'reward' not in infos:
            if finish.reward is not None:
                infos['reward'] = finish.reward
            infos['gateway_finish'] = finish.info
        lost = len(self.run.lost)
        self.run.write_finished(finished, session.index, request, self.t_offset, live=request)
        if len(self.run.lost) > lost:  # its line is nowhere: its finish is told so, and the gateway fails
            try:
                self.run.check_lost()
            except BaseException as exc:  # noqa: BLE001 - the RunDirError naming it
                self.error = self.error or exc
            _, why = self.run.lost[-1]
            self.table.not_written(session.name, str(why))
            return
        self.written += 1
        summary: Dict[str, Any] = {'session': session.name, 'finish_reason': finished.finish_reason,
                                   'turns': (infos or {}).get('num_turns'),
                                   'segments': len(segments_of(finished.output)), 'reward': (infos or {}).get('reward')}
        self.unsynced.append((session.name, summary))  # answered once durable (:meth:`_sync`)
