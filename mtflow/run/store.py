"""The run directory, written so that no crash loses or corrupts a finished trajectory.

``mtflow run`` (and the Ray driver) stream every finished request through a :class:`RunStore`::

    store = RunStore.open('runs/x', mode='new', fingerprint=fp)   # or 'resume' / 'overwrite'
    for request in requests:
        if store.is_done(request.uuid):            # written by an earlier attempt
            continue
        ...
        store.write(trajectory_dict, trace_event_dicts)   # when that request finishes
    store.close(status='complete', summary={...})

Files (``docs/cli.md``):

* ``trajectories.jsonl``: one line per finished request, in the order they finished. **A request
  is done exactly when its line is whole in this file.**
* ``trace.jsonl``: the trace events of those requests (``docs/trace-format.md``), each request's
  events together, written and fsynced *before* its trajectory line. So every done request has
  all its events; a crash between the two leaves events of a request that is not done, and
  opening the directory with ``mode='resume'`` drops them.
* ``interrupted.jsonl``: requests cut short by a signal (finish reason ``interrupted``): their
  partial trajectory with its events under ``trace``. They are not done; a resume runs them again
  (and starts this file afresh).
* ``trees.jsonl``: a branched run's trees (``docs/branching.md``), one line per prompt, written
  once its leaves are on disk (a resume that runs the prompt again writes it again: the last
  line of a root counts).
* ``run.json``: the fingerprint of what the run rolls out (config and dataset, see
  ``mtflow/run/fingerprint.py``) and one entry per attempt (started, ended, status, counts).
* ``summary.json``: written by :meth:`RunStore.close` (atomically); absent while a run is going
  or after it was killed. Its ``status`` is ``complete``, ``interrupted`` or ``failed``.
* ``run.lock``: held (``flock``) by the process writing the directory, so two runs never write
  the same files.

Writes are whole lines only: lines are collected in memory and written in small groups (every
``flush_every`` requests or ``flush_interval_s`` seconds, whichever comes first; :meth:`tick`
checks the clock between writes), each group with one ``write`` per file followed by ``fsync``.
A line cut by ``SIGKILL`` or a full disk is the last line of its file; on resume a torn last
line is detected and dropped (a bad line anywhere else is corruption, reported with file and
line). Nothing here knows about executors or threads: records are plain dicts (or objects with
``to_dict``), and one lock makes every method safe to call from any thread.

The parts: :mod:`mtflow.run.files` (the file names, whole-line and atomic writes, the lock),
:mod:`mtflow.run.recovery` (what ``mode='resume'`` checks and repairs), :mod:`mtflow.run.groups`
(the grouped, fsynced writes); this module opens, writes and closes a directory with them.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence, Set, Tuple, Union

from mtflow.run.files import (FORMAT, INTERRUPTED_FILE, LOCK, RUN_FILES, RUN_INFO, SUMMARY, TRACE, TRAJECTORIES,
                              TREES, DirLock, FingerprintMismatch, Record, RunDirError, WriteRefused, append_file,
                              json_line, not_empty_message, set_aside, utc_now, write_json_atomic)
from mtflow.run.groups import GroupWriter
from mtflow.run.images import ImageStore
from mtflow.run.recovery import Recovery, fingerprint_changes, read_run_info, recover
from mtflow.run.tally import RunTally
from mtflow.run.trees import prompts_of
from mtflow.run.trajectories import finished_to_record

__all__ = [
    'RunStore', 'RunDirError', 'WriteRefused', 'FingerprintMismatch', 'Recovery', 'finished_to_record', 'fingerprint_changes',
    'TRAJECTORIES', 'TRACE', 'INTERRUPTED_FILE', 'TREES', 'RUN_INFO', 'SUMMARY', 'LOCK', 'RUN_FILES', 'FORMAT'
]

Mode = Literal['new', 'resume', 'overwrite']
MODES = ('new', 'resume', 'overwrite')


class RunStore:
    """The writer of one run directory (see the module docstring). Open it with :meth:`open`.

    Attributes:
        out_dir: the directory.
        mode: how it was opened (``'new'``, ``'resume'``, ``'overwrite'``); a resume of an empty
            or missing directory starts a new run (``resumed`` is then False).
        done: uuids whose trajectory is on disk or pending in this store (a uuid is written once).
        branched: the directory holds a branched run's trees (``trees.jsonl``, or lines of forks'
            children): each prompt is a tree of leaves (``mtflow/run/trees.py``).
        started_prompts: on resume of a branched run, the prompts with a leaf on disk
            (:meth:`prompt_done`).
        tally: counters over every request written, earlier attempts included (``summary.json``).
        recovery: what opening found and repaired (``mode='resume'``).
        set_aside: where ``mode='overwrite'`` moved the old directory (``None`` if nothing was there
            or it was deleted).
        info: the contents of ``run.json``.
    """

    def __init__(self, out_dir: Path, *, fsync: bool = True, flush_every: int = 256,
                 flush_interval_s: float = 2.0) -> None:
        self.out_dir = out_dir
        self.groups = GroupWriter(out_dir, fsync=fsync, flush_every=flush_every, flush_interval_s=flush_interval_s)
        self.images = ImageStore(out_dir, fsync=fsync)  # <run>/images, each image once (mtflow.run.images)
        self.mode: str = 'new'
        self.resumed = False
        self.done: Set[str] = set()
        self.started_prompts: Set[str] = set()
        self.branched = False
        self.tally = RunTally()
        self.recovery = Recovery()
        self.set_aside: Optional[Path] = None
        self.info: Dict[str, Any] = {}
        self.written = 0  # by this attempt
        self.interrupted = 0  # by this attempt
        self._lock = threading.RLock()
        self._dir_lock: Optional[DirLock] = None
        self._created_dir = False
        self.closed = False

    @property
    def flushes(self) -> int:
        return self.groups.flushes

    @property
    def fsync_s(self) -> float:
        """Time spent writing and fsyncing groups (the durability cost)."""
        return self.groups.fsync_s

    # ---- opening ------------------------------------------------------------------------------
    @classmethod
    def open(cls, out_dir: Union[str, Path], mode: Mode = 'new', fingerprint: Optional[Dict[str, Any]] = None, *,
             delete_old: bool = False, fsync: bool = True, flush_every: int = 256,
             flush_interval_s: float = 2.0, meta: Optional[Dict[str, Any]] = None,
             accept_changed: bool = False) -> 'RunStore':
        """Open ``out_dir`` for writing.

        * ``'new'``: the directory must be missing or empty; otherwise :class:`RunDirError`
          says to pass ``--resume`` or ``--overwrite`` (nothing in it is touched).
        * ``'resume'``: continue the run in it: the stored fingerprint must equal
          ``fingerprint`` (else :class:`FingerprintMismatch`, naming each change), torn last
          lines are dropped, trace events of unfinished requests removed, and ``done`` holds
          every uuid already written. A missing or empty directory starts a new run. With
          ``accept_changed``, changed code and files the config names (the fingerprint's
          ``code`` and ``files.scheduler``) are gone past, recorded in ``run.json`` (the attempt's
          ``accepted_changes``, and the new fingerprint).
        * ``'overwrite'``: start afresh; an existing non-empty directory is moved to
          ``<out>.old-<UTC time>``, or with ``delete_old`` its mtflow files are deleted.

        ``meta`` (JSON values) goes into a new run's ``run.json`` as it is (``mtflow run``: the
        config file and the ``replay_format`` of the trajectory lines' ``turns``).
        """
        if mode not in MODES:
            raise ValueError(f'mode must be one of {", ".join(MODES)}, not {mode!r}')
        out = Path(out_dir)
        if out.exists() and not out.is_dir():
            raise RunDirError(f'output path {out} is a file, not a directory')
        if fingerprint is not None:  # compared with what run.json gives back, so as JSON
            fingerprint = json.loads(json.dumps(fingerprint, default=str))
        store = cls(out, fsync=fsync, flush_every=flush_every, flush_interval_s=flush_interval_s)
        store.mode = mode
        if mode == 'overwrite' and out.is_dir() and any(e != LOCK for e in os.listdir(out)):
            store.set_aside = set_aside(out, delete_old)
        store._created_dir = not out.exists()
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirError(f'cannot create output directory {out}: {exc.strerror or exc}') from None
        store._dir_lock = DirLock(out / LOCK)
        try:
            entries = sorted(e for e in os.listdir(out) if e != LOCK)
            if entries and mode == 'resume':
                store._open_existing(entries, fingerprint, accept_changed)
            elif entries:
                raise RunDirError(not_empty_message(out, entries))
            else:
                store._open_new(fingerprint, meta)
            store._dir_lock.claim()
        except BaseException:
            store.groups.close_files()
            store._dir_lock.release(unlink=not store._dir_lock.existed)
            store._dir_lock = None
            raise
        return store

    def _open_new(self, fingerprint: Optional[Dict[str, Any]], meta: Optional[Dict[str, Any]] = None) -> None:
        self.info = {'format': FORMAT, 'created': utc_now(), 'started_unix': time.time(),
                     'fingerprint': fingerprint or {}, **(meta or {}), 'attempts': []}
        for name in (TRAJECTORIES, TRACE):
            fd = os.open(self.out_dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.close(fd)
        self._start_attempt()

    def _open_existing(self, entries: List[str], fingerprint: Optional[Dict[str, Any]],
                       accept_changed: bool = False) -> None:
        self.info, accepted = read_run_info(self.out_dir, entries, fingerprint, accept_changed)
        self.resumed = True
        self.recovery = recover(self.out_dir, self.info, self.done, self.tally)
        self.branched = bool(self.tally.forked) or (self.out_dir / TREES).exists()
        if self.branched:  # a leaf names its prompt
            self.started_prompts = prompts_of(self.done)
        self.recovery.accepted_changes = accepted
        self._start_attempt()

    def _start_attempt(self) -> None:
        attempts = self.info.setdefault('attempts', [])
        attempts.append({'attempt': len(attempts) + 1, 'mode': self.mode if self.resumed or self.mode != 'resume'
                         else 'new', 'pid': os.getpid(), 'started': utc_now(), 'done_at_start': len(self.done),
                         'ended': None, 'status': 'running',
                         **({'accepted_changes': self.recovery.accepted_changes} if self.recovery.accepted_changes
                            else {})})
        write_json_atomic(self.out_dir / RUN_INFO, self.info)
        self.groups.open()

    # ---- writing ------------------------------------------------------------------------------
    @property
    def started_unix(self) -> float:
        """When the run's first attempt started (trace times count from there)."""
        return float(self.info.get('started_unix') or 0.0)

    def is_done(self, uuid: str) -> bool:
        return str(uuid) in self.done

    def prompt_done(self, uuid: str) -> bool:
        """Whether prompt ``uuid`` is not to be run again: its line is on disk, or (a branched run)
        a leaf of its tree is (``mtflow/run/trees.py``: a prompt never runs twice into one tree)."""
        return str(uuid) in self.done or str(uuid) in self.started_prompts

    def write(self, record: Record, events: Sequence[Record] = ()) -> None:
        """One finished request: its trajectory line (needs ``uuid``) and its trace events.

        Kept in memory until the group is flushed (see :meth:`flush`); a uuid already written
        raises :class:`WriteRefused` (the line is not kept); a group that cannot be written (a
        full disk) raises :class:`RunDirError`, its lines kept for the next flush."""
        self.write_together([(record, events)])

    def write_together(self, items: Sequence[Tuple[Record, Sequence[Record]]]) -> None:
        """Finished requests that belong together (the roles of one episode, ``docs/multi-agent.md``):
        as :meth:`write` each, in one group of the files, so a crash never leaves some of them
        written and the others not; one uuid already written (or twice among them) refuses them all."""
        lines = []
        for record, events in items:
            rec = record if isinstance(record, dict) else record.to_dict()
            evs = [e if isinstance(e, dict) else e.to_dict() for e in events]
            lines.append((str(rec['uuid']), rec, evs, json_line(rec) + '\n', ''.join(json_line(e) + '\n' for e in evs)))
        with self._lock:
            self._check_open()
            seen: Set[str] = set()
            for uuid, *_ in lines:
                if uuid in self.done or uuid in seen:
                    raise WriteRefused(f'request {uuid} is already written to {self.out_dir / TRAJECTORIES}: '
                                       f'a request is written once')
                seen.add(uuid)
            for k, (uuid, rec, evs, line, trace_lines) in enumerate(lines):
                self.done.add(uuid)
                self.written += 1
                self.tally.add(rec, evs)
                self.groups.add(trace_lines, line, flush=k == len(lines) - 1)

    def write_interrupted(self, record: Record, events: Sequence[Record] = ()) -> None:
        """A request cut short by a stop: kept in ``interrupted.jsonl`` (its events under
        ``trace``), not done, so a resume runs it again."""
        rec = dict(record if isinstance(record, dict) else record.to_dict())
        rec['trace'] = [e if isinstance(e, dict) else e.to_dict() for e in events]
        line = json_line(rec) + '\n'
        with self._lock:
            self._check_open()
            self.groups.add_interrupted(line)
            self.interrupted += 1

    def write_trees(self, trees: Sequence[Dict[str, Any]]) -> None:
        """A branched run's trees whose leaves were written: the pending lines are flushed first,
        so a tree on disk always has its leaves on disk."""
        if not trees:
            return
        self.branched = True
        data = ''.join(json_line(tree) + '\n' for tree in trees).encode('utf-8')
        with self._lock:
            self._check_open()
            self.groups.flush()
            try:
                append_file(self.out_dir / TREES, data, self.groups.fsync)
            except OSError as exc:
                raise RunDirError(f'cannot write to {self.out_dir / TREES}: {exc.strerror or exc}') from exc

    def tick(self) -> None:
        """Flush the pending group if it is older than ``flush_interval_s`` (call it between
        turns, so that a request finished early in a long batch reaches the disk soon)."""
        with self._lock:
            self.groups.tick()

    def flush(self) -> None:
        """Write every pending line now: the trace events first, fsync, then the trajectory
        lines, fsync (so a trajectory on disk always has its events on disk)."""
        with self._lock:
            self.groups.flush()

    def _check_open(self) -> None:
        if self.closed:
            raise WriteRefused(f'the run store of {self.out_dir} is closed')

    # ---- closing ------------------------------------------------------------------------------
    def close(self, status: str = 'complete', summary: Optional[Dict[str, Any]] = None,
              attempt: Optional[Dict[str, Any]] = None) -> None:
        """Flush, record this attempt in ``run.json`` (``status``: ``complete``,
        ``interrupted``, ``failed``; ``attempt``: extra figures), write ``summary.json`` when
        given (``status`` and ``out`` added), release the directory."""
        with self._lock:
            if self.closed:
                return
            try:
                self.groups.flush()
                entry = self.info['attempts'][-1]
                entry.update(attempt or {})
                entry.update({'ended': utc_now(), 'status': status, 'written': self.written,
                              'interrupted': self.interrupted})
                write_json_atomic(self.out_dir / RUN_INFO, self.info)
                if summary is not None:
                    write_json_atomic(self.out_dir / SUMMARY, {'status': status, **summary})
            finally:
                self._release()

    def abandon(self) -> None:
        """Close without a summary after an unexpected error: flush what is finished (best
        effort), mark the attempt ``failed``, release the directory."""
        with self._lock:
            if self.closed:
                return
            try:
                self.close(status='failed')
            except Exception:
                self._release()

    def discard(self) -> None:
        """Undo opening a fresh run that never wrote a request (the backend would not start, the
        first signal came during the model load): remove the files :meth:`open` created, so the
        next run into the directory is not refused. A resumed run, or one that wrote anything,
        is closed as ``failed`` instead."""
        with self._lock:
            if self.closed:
                return
            if self.resumed or self.written or self.interrupted or self.groups.holds_lines:
                self.abandon()
                return
            self.groups.close_files()
            for name in (TRAJECTORIES, TRACE, RUN_INFO):
                try:
                    os.unlink(self.out_dir / name)
                except FileNotFoundError:
                    pass
            self._release()
            if self._created_dir:
                try:
                    self.out_dir.rmdir()
                except OSError:
                    pass

    def _release(self) -> None:
        self.groups.close_files()
        if self._dir_lock is not None:
            self._dir_lock.release()
            self._dir_lock = None
        self.closed = True

    def __enter__(self) -> 'RunStore':
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()

    def counts(self) -> Dict[str, int]:
        """Requests written (all attempts), by this attempt, and interrupted in this attempt."""
        return {'done': len(self.done), 'written': self.written, 'interrupted': self.interrupted}

