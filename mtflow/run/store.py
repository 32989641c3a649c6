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
"""
from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Set, Tuple, Union

from mtflow.core.errors import MtflowError
from mtflow.run.signals import deferred_interrupts
from mtflow.run.tally import RunTally

__all__ = [
    'RunStore', 'RunDirError', 'FingerprintMismatch', 'Recovery', 'finished_to_record', 'fingerprint_changes',
    'TRAJECTORIES', 'TRACE', 'INTERRUPTED', 'RUN_INFO', 'SUMMARY', 'LOCK', 'RUN_FILES', 'FORMAT'
]

TRAJECTORIES = 'trajectories.jsonl'
TRACE = 'trace.jsonl'
INTERRUPTED = 'interrupted.jsonl'
RUN_INFO = 'run.json'
SUMMARY = 'summary.json'
LOCK = 'run.lock'
#: every file a run directory may hold (``--overwrite --delete-old`` deletes only these)
RUN_FILES = (TRAJECTORIES, TRACE, INTERRUPTED, RUN_INFO, SUMMARY, LOCK)
#: the ``format`` of ``run.json``
FORMAT = 'mtflow-run/1'

Mode = Literal['new', 'resume', 'overwrite']
MODES = ('new', 'resume', 'overwrite')
Record = Union[Dict[str, Any], Any]  # a dict, or an object with to_dict() (Trajectory, TraceEvent)


class RunDirError(MtflowError):
    """A run directory that cannot be opened as asked; the message says what to do."""


class FingerprintMismatch(RunDirError):
    """``--resume`` with another config or dataset than the run started with."""

    def __init__(self, message: str, changes: List[str]) -> None:
        super().__init__(message)
        self.changes = changes


@dataclass
class Recovery:
    """What opening a directory with ``mode='resume'`` found and repaired."""
    done: int = 0  # trajectories already written
    torn_trajectory_line: bool = False  # a torn last line of trajectories.jsonl was dropped
    torn_trace_line: bool = False  # a torn last line of trace.jsonl was dropped
    orphan_events: int = 0  # trace events of requests that were not done, dropped
    interrupted: int = 0  # requests the last attempt cut short (run again)
    attempts: int = 0  # earlier attempts

    def notes(self) -> List[str]:
        """One phrase per repair, for the command's message."""
        out = []
        if self.torn_trajectory_line:
            out.append(f'dropped a torn last line of {TRAJECTORIES}')
        if self.torn_trace_line:
            out.append(f'dropped a torn last line of {TRACE}')
        if self.orphan_events:
            out.append(f'dropped {self.orphan_events} trace event(s) of requests that were not finished')
        if self.interrupted:
            out.append(f'{self.interrupted} interrupted request(s) run again')
        return out


# ---- small file helpers -------------------------------------------------------------------------
def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec='seconds')


def _dumps(obj: Record) -> str:
    if not isinstance(obj, dict):
        obj = obj.to_dict()
    # json.dumps escapes newlines inside strings, so one record is always one line
    return json.dumps(obj, ensure_ascii=False, default=str)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. a filesystem without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + '.tmp')
    data = (json.dumps(obj, indent=2, ensure_ascii=False, default=str) + '\n').encode('utf-8')
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _count_lines(path: Path) -> int:
    n = 0
    try:
        with open(path, 'rb') as f:
            for chunk in iter(lambda: f.read(1 << 20), b''):
                n += chunk.count(b'\n')
    except OSError:
        return 0
    return n


def _scan_jsonl(path: Path, on_record: Callable[[Dict[str, Any], int], None]) -> bool:
    """Call ``on_record(obj, lineno)`` for each whole line of a JSONL file. A torn last line (no
    newline at the end, or not valid JSON) is cut off the file; returns whether one was. A bad
    line that is not the last one raises :class:`RunDirError` (file and line)."""
    if not path.exists():
        return False
    good_end = 0
    offset = 0
    torn = False
    with open(path, 'rb') as f:
        pending: Optional[Tuple[int, bytes]] = None  # one line of lookahead: is it the last?
        lineno = 0

        def handle(no: int, raw: bytes, is_last: bool) -> bool:
            nonlocal good_end, offset
            start = offset
            offset += len(raw)
            if not raw.strip():
                good_end = offset if raw.endswith(b'\n') else good_end
                return True
            whole = raw.endswith(b'\n')
            try:
                obj = json.loads(raw) if whole else None
            except ValueError:
                obj = None
            if obj is None or not isinstance(obj, dict):
                if is_last:
                    good_end = start
                    return False
                what = 'not a JSON object' if whole else 'a line without its end'
                raise RunDirError(f'{path}:{no}: {what} in the middle of the file: the directory is damaged '
                                  f'(not a torn last line); remove that line or start afresh with --overwrite')
            on_record(obj, no)
            good_end = offset
            return True

        for raw in f:
            lineno += 1
            if pending is not None:
                handle(pending[0], pending[1], False)
            pending = (lineno, raw)
        if pending is not None:
            torn = not handle(pending[0], pending[1], True)
    size = path.stat().st_size
    if good_end < size:
        torn = True
        with open(path, 'r+b') as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return torn


def fingerprint_changes(old: Any, new: Any, prefix: str = '') -> List[str]:
    """``['request_config.temperature: 0.7 -> 1.0', ...]``: what differs between two
    fingerprints (nested dicts), one entry per changed leaf."""

    def short(v: Any) -> str:
        s = json.dumps(v, default=str)
        return s if len(s) <= 60 else s[:57] + '...'

    if isinstance(old, dict) and isinstance(new, dict):
        out: List[str] = []
        for key in sorted(set(old) | set(new), key=str):
            name = f'{prefix}.{key}' if prefix else str(key)
            if key not in old:
                out.append(f'{name}: (absent) -> {short(new[key])}')
            elif key not in new:
                out.append(f'{name}: {short(old[key])} -> (absent)')
            else:
                out.extend(fingerprint_changes(old[key], new[key], name))
        return out
    return [] if old == new else [f'{prefix or "fingerprint"}: {short(old)} -> {short(new)}']


class _DirLock:
    """An exclusive ``flock`` on ``run.lock``; the file holds the owner's pid."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.existed = path.exists()  # left by a killed run: a refused open leaves it there
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = os.read(self.fd, 32).decode('ascii', 'replace').strip() or '?'
            os.close(self.fd)
            raise RunDirError(f'another mtflow run (pid {owner}) is writing to {path.parent}: wait for it to end, '
                              f'or stop it first') from None

    def claim(self) -> None:
        """Write this process's pid (once the directory is really ours, so a refused open leaves
        the file as it was)."""
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f'{os.getpid()}\n'.encode(), 0)

    def release(self, unlink: bool = True) -> None:
        if self.fd < 0:
            return
        if unlink:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1


def _set_aside(out: Path, delete_old: bool) -> Optional[Path]:
    """Make room for a fresh run in ``out``: move the directory to ``<out>.old-<UTC time>`` (the
    default), or delete mtflow's own files in it (``delete_old``; refused if it holds others)."""
    lock = _DirLock(out / LOCK)  # never move a directory another process is writing to
    try:
        entries = sorted(e for e in os.listdir(out) if e != LOCK)
        if delete_old:
            foreign = [e for e in entries if e not in RUN_FILES and not e.endswith('.tmp')]
            if foreign:
                raise RunDirError(f'--delete-old deletes only the files of an mtflow run, and {out} also holds '
                                  f'{", ".join(foreign[:5])}{" ..." if len(foreign) > 5 else ""}: move them, or '
                                  f'drop --delete-old (the directory is then moved aside)')
            for e in entries:
                os.unlink(out / e)
            _fsync_dir(out)
            return None
        resolved = out.resolve()
        if Path.cwd().resolve() == resolved or resolved in Path.cwd().resolve().parents:
            raise RunDirError(f'--overwrite cannot move {out} aside: it is the current directory or holds it; '
                              f'use another --out, or --delete-old')
        stamp = datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')
        dest = resolved.with_name(f'{resolved.name}.old-{stamp}')
        k = 1
        while dest.exists():
            k += 1
            dest = resolved.with_name(f'{resolved.name}.old-{stamp}-{k}')
        os.rename(resolved, dest)
        lock.path = dest / LOCK  # the lock file moved with its directory
        _fsync_dir(dest.parent)
        return dest
    finally:
        lock.release()


# ---- the store ------------------------------------------------------------------------------------
class RunStore:
    """The writer of one run directory (see the module docstring). Open it with :meth:`open`.

    Attributes:
        out_dir: the directory.
        mode: how it was opened (``'new'``, ``'resume'``, ``'overwrite'``); a resume of an empty
            or missing directory starts a new run (``resumed`` is then False).
        done: uuids whose trajectory is on disk or pending in this store (a uuid is written once).
        tally: counters over every request written, earlier attempts included (``summary.json``).
        recovery: what opening found and repaired (``mode='resume'``).
        set_aside: where ``mode='overwrite'`` moved the old directory (``None`` if nothing was there
            or it was deleted).
        info: the contents of ``run.json``.
    """

    def __init__(self, out_dir: Path, *, fsync: bool = True, flush_every: int = 256,
                 flush_interval_s: float = 2.0) -> None:
        if flush_every < 1:
            raise ValueError(f'flush_every must be >= 1, not {flush_every!r}')
        self.out_dir = out_dir
        self.fsync = fsync
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        self.mode: str = 'new'
        self.resumed = False
        self.done: Set[str] = set()
        self.tally = RunTally()
        self.recovery = Recovery()
        self.set_aside: Optional[Path] = None
        self.info: Dict[str, Any] = {}
        self.written = 0  # by this attempt
        self.interrupted = 0  # by this attempt
        self.flushes = 0
        self.fsync_s = 0.0  # time spent writing and fsyncing groups (the durability cost)
        self._pending: List[Tuple[str, str]] = []  # (trace lines, trajectory line) per request
        self._pending_interrupted: List[str] = []
        self._pending_since = 0.0
        self._lock = threading.RLock()
        self._dir_lock: Optional[_DirLock] = None
        self._fds: Dict[str, int] = {}
        self._sizes: Dict[str, int] = {}
        self._created_dir = False
        self.closed = False

    # ---- opening ------------------------------------------------------------------------------
    @classmethod
    def open(cls, out_dir: Union[str, Path], mode: Mode = 'new', fingerprint: Optional[Dict[str, Any]] = None, *,
             delete_old: bool = False, fsync: bool = True, flush_every: int = 256,
             flush_interval_s: float = 2.0) -> 'RunStore':
        """Open ``out_dir`` for writing.

        * ``'new'``: the directory must be missing or empty; otherwise :class:`RunDirError`
          says to pass ``--resume`` or ``--overwrite`` (nothing in it is touched).
        * ``'resume'``: continue the run in it: the stored fingerprint must equal
          ``fingerprint`` (else :class:`FingerprintMismatch`, naming each change), torn last
          lines are dropped, trace events of unfinished requests removed, and ``done`` holds
          every uuid already written. A missing or empty directory starts a new run.
        * ``'overwrite'``: start afresh; an existing non-empty directory is moved to
          ``<out>.old-<UTC time>``, or with ``delete_old`` its mtflow files are deleted.
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
            store.set_aside = _set_aside(out, delete_old)
        store._created_dir = not out.exists()
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirError(f'cannot create output directory {out}: {exc.strerror or exc}') from None
        store._dir_lock = _DirLock(out / LOCK)
        entries: List[str] = []
        try:
            entries = sorted(e for e in os.listdir(out) if e != LOCK)
            if entries and mode == 'resume':
                store._open_existing(entries, fingerprint)
            elif entries:
                raise RunDirError(_not_empty_message(out, entries))
            else:
                store._open_new(fingerprint)
            store._dir_lock.claim()
        except BaseException:
            store._release_fds()
            store._dir_lock.release(unlink=not store._dir_lock.existed)
            store._dir_lock = None
            raise
        return store

    def _open_new(self, fingerprint: Optional[Dict[str, Any]]) -> None:
        now = time.time()
        self.info = {'format': FORMAT, 'created': _utc_now(), 'started_unix': now,
                     'fingerprint': fingerprint or {}, 'attempts': []}
        for name in (TRAJECTORIES, TRACE):
            fd = os.open(self.out_dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.close(fd)
        self._start_attempt()

    def _open_existing(self, entries: List[str], fingerprint: Optional[Dict[str, Any]]) -> None:
        out = self.out_dir
        info_path = out / RUN_INFO
        if RUN_INFO not in entries:
            shown = ', '.join(entries[:5]) + (' ...' if len(entries) > 5 else '')
            raise RunDirError(f'cannot resume {out}: it holds no mtflow run (no {RUN_INFO}; found {shown}); '
                              f'choose another --out, or --overwrite to move it aside and start afresh')
        try:
            info = json.loads(info_path.read_text(encoding='utf-8'))
        except (OSError, ValueError) as exc:
            raise RunDirError(f'cannot resume {out}: {info_path} is unreadable ({exc}); '
                              f'--overwrite starts afresh') from None
        if not isinstance(info, dict) or info.get('format') != FORMAT:
            raise RunDirError(f'cannot resume {out}: {info_path} is not an mtflow run file (format {FORMAT})')
        if fingerprint is not None:
            changes = fingerprint_changes(info.get('fingerprint') or {}, fingerprint)
            if changes:
                listed = '; '.join(changes[:8]) + (f'; and {len(changes) - 8} more' if len(changes) > 8 else '')
                raise FingerprintMismatch(
                    f'cannot resume {out}: the run was started with another config or dataset ({listed}); '
                    f'resume with the original ones, or pass --overwrite to start afresh', changes)
        self.info = info
        self.resumed = True
        self._recover()
        self._start_attempt()

    def _recover(self) -> None:
        out, rec, done, tally = self.out_dir, self.recovery, self.done, self.tally
        rec.attempts = len(self.info.get('attempts') or [])
        traj_path, trace_path = out / TRAJECTORIES, out / TRACE

        def on_trajectory(obj: Dict[str, Any], lineno: int) -> None:
            uuid = obj.get('uuid')
            if uuid is None:
                raise RunDirError(f'{traj_path}:{lineno}: a trajectory without a uuid: the directory is damaged')
            uuid = str(uuid)
            if uuid in done:
                raise RunDirError(f'{traj_path}:{lineno}: request {uuid} is written twice: the directory is damaged')
            done.add(uuid)
            tally.add_record(obj)

        rec.torn_trajectory_line = _scan_jsonl(traj_path, on_trajectory)
        rec.done = len(done)
        orphans = [0]

        def on_event(obj: Dict[str, Any], lineno: int) -> None:
            if str(obj.get('uuid')) in done:
                tally.add_event(obj)
            else:
                orphans[0] += 1

        rec.torn_trace_line = _scan_jsonl(trace_path, on_event)
        rec.orphan_events = orphans[0]
        if orphans[0]:
            self._drop_orphan_events(trace_path)
        rec.interrupted = _count_lines(out / INTERRUPTED)
        for stale in (INTERRUPTED, SUMMARY):
            try:
                os.unlink(out / stale)
            except FileNotFoundError:
                pass
        for name in (TRAJECTORIES, TRACE):
            if not (out / name).exists():
                os.close(os.open(out / name, os.O_WRONLY | os.O_CREAT, 0o644))
        _fsync_dir(out)

    def _drop_orphan_events(self, trace_path: Path) -> None:
        """Rewrite trace.jsonl with only the events of done requests (atomically)."""
        tmp = trace_path.with_name(trace_path.name + '.tmp')
        with open(trace_path, 'rb') as src, open(tmp, 'wb') as dst:
            for raw in src:
                if raw.strip() and str(json.loads(raw).get('uuid')) in self.done:
                    dst.write(raw)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, trace_path)
        _fsync_dir(trace_path.parent)

    def _start_attempt(self) -> None:
        attempts = self.info.setdefault('attempts', [])
        attempts.append({'attempt': len(attempts) + 1, 'mode': self.mode if self.resumed or self.mode != 'resume'
                         else 'new', 'pid': os.getpid(), 'started': _utc_now(), 'done_at_start': len(self.done),
                         'ended': None, 'status': 'running'})
        _write_json_atomic(self.out_dir / RUN_INFO, self.info)
        for name in (TRAJECTORIES, TRACE):
            fd = os.open(self.out_dir / name, os.O_WRONLY | os.O_APPEND)
            self._fds[name] = fd
            self._sizes[name] = os.fstat(fd).st_size

    # ---- writing ------------------------------------------------------------------------------
    @property
    def started_unix(self) -> float:
        """When the run's first attempt started (trace times count from there)."""
        return float(self.info.get('started_unix') or 0.0)

    def is_done(self, uuid: str) -> bool:
        return str(uuid) in self.done

    def write(self, record: Record, events: Sequence[Record] = ()) -> None:
        """One finished request: its trajectory line (needs ``uuid``) and its trace events.

        Kept in memory until the group is flushed (see :meth:`flush`); a uuid already written
        raises :class:`RunDirError`."""
        rec = record if isinstance(record, dict) else record.to_dict()
        evs = [e if isinstance(e, dict) else e.to_dict() for e in events]
        uuid = str(rec['uuid'])
        line = _dumps(rec) + '\n'
        trace_lines = ''.join(_dumps(e) + '\n' for e in evs)
        with self._lock:
            self._check_open()
            if uuid in self.done:
                raise RunDirError(f'request {uuid} is already written to {self.out_dir / TRAJECTORIES}: '
                                  f'a request is written once')
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.append((trace_lines, line))
            self.done.add(uuid)
            self.written += 1
            self.tally.add(rec, evs)
            if len(self._pending) >= self.flush_every:
                self._flush_locked()
            elif time.monotonic() - self._pending_since >= self.flush_interval_s:
                self._flush_locked()

    def write_interrupted(self, record: Record, events: Sequence[Record] = ()) -> None:
        """A request cut short by a stop: kept in ``interrupted.jsonl`` (its events under
        ``trace``), not done, so a resume runs it again."""
        rec = dict(record if isinstance(record, dict) else record.to_dict())
        rec['trace'] = [e if isinstance(e, dict) else e.to_dict() for e in events]
        line = _dumps(rec) + '\n'
        with self._lock:
            self._check_open()
            self._pending_interrupted.append(line)
            self.interrupted += 1

    def tick(self) -> None:
        """Flush the pending group if it is older than ``flush_interval_s`` (call it between
        turns, so that a request finished early in a long batch reaches the disk soon)."""
        with self._lock:
            if self._pending and time.monotonic() - self._pending_since >= self.flush_interval_s:
                self._flush_locked()

    def flush(self) -> None:
        """Write every pending line now: the trace events first, fsync, then the trajectory
        lines, fsync (so a trajectory on disk always has its events on disk)."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if not self._pending and not self._pending_interrupted:
            return
        with deferred_interrupts():  # a first Ctrl-C waits for the group; a second one does not
            t = time.perf_counter()
            pending, self._pending = self._pending, []
            sizes = dict(self._sizes)
            try:
                if pending:
                    self._append(TRACE, ''.join(p[0] for p in pending).encode('utf-8'))
                    self._append(TRAJECTORIES, ''.join(p[1] for p in pending).encode('utf-8'))
                if self._pending_interrupted:
                    lines, self._pending_interrupted = self._pending_interrupted, []
                    fd = os.open(self.out_dir / INTERRUPTED, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    try:
                        _write_all(fd, ''.join(lines).encode('utf-8'))
                        if self.fsync:
                            os.fsync(fd)
                    finally:
                        os.close(fd)
            except OSError as exc:  # e.g. a full disk: never leave half a group behind
                for name, size in sizes.items():
                    try:
                        os.ftruncate(self._fds[name], size)
                    except OSError:  # pragma: no cover
                        pass
                self._sizes = sizes
                self._pending = pending + self._pending
                raise RunDirError(f'cannot write to {self.out_dir}: {exc.strerror or exc}; what was written before '
                                  f'is whole, and --resume continues the run') from exc
            self.flushes += 1
            self.fsync_s += time.perf_counter() - t

    def _append(self, name: str, data: bytes) -> None:
        fd = self._fds[name]
        _write_all(fd, data)
        if self.fsync:
            os.fsync(fd)
        self._sizes[name] += len(data)

    def _check_open(self) -> None:
        if self.closed:
            raise RunDirError(f'the run store of {self.out_dir} is closed')

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
                self._flush_locked()
                entry = self.info['attempts'][-1]
                entry.update(attempt or {})
                entry.update({'ended': _utc_now(), 'status': status, 'written': self.written,
                              'interrupted': self.interrupted})
                _write_json_atomic(self.out_dir / RUN_INFO, self.info)
                if summary is not None:
                    _write_json_atomic(self.out_dir / SUMMARY, {'status': status, **summary})
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
            if self.resumed or self.written or self.interrupted or self._pending or self._pending_interrupted:
                self.abandon()
                return
            self._release_fds()
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

    def _release_fds(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:  # pragma: no cover
                pass
        self._fds.clear()

    def _release(self) -> None:
        self._release_fds()
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

    def recovery_dict(self) -> Dict[str, Any]:
        return asdict(self.recovery)


def _not_empty_message(out: Path, entries: List[str]) -> str:
    if RUN_INFO in entries or TRAJECTORIES in entries:
        n = _count_lines(out / TRAJECTORIES)
        return (f'{out} already holds a run ({n} trajectories): pass --resume to continue it, or --overwrite to '
                f'start afresh (the old directory is moved to {out.name}.old-<time>; add --delete-old to delete '
                f'its files instead)')
    shown = ', '.join(entries[:5]) + (' ...' if len(entries) > 5 else '')
    return (f'output directory {out} is not empty ({shown}): choose another --out, or pass --overwrite to move it '
            f'aside and start afresh')


# ---- from the executor's records to plain data -----------------------------------------------------
def finished_to_record(finished: Any, *, index: Optional[int] = None, rank: int = 0,
                       t_offset: float = 0.0) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """A trajectory dict and its trace-event dicts from one finished request (an
    ``mtflow.FinishedRequest``, or anything with ``uuid``, ``index``, ``output``,
    ``finish_reason`` and ``events``). ``index`` (default: the record's) replaces the batch
    index (a run numbers requests across batches by dataset position); ``t_offset`` is added to
    event times (seconds from the run's start to the batch's start)."""
    from mtflow.run.trajectories import trajectory_from_output

    idx = finished.index if index is None else index
    traj = trajectory_from_output(finished.output, str(finished.uuid), index=idx, rank=rank,
                                  finish_reason=finished.finish_reason)
    events = []
    for e in getattr(finished, 'events', None) or ():
        d = e.to_dict() if not isinstance(e, dict) else dict(e)
        d['index'] = idx
        if d.get('t') is not None:
            d['t'] = round(d['t'] + t_offset, 6)
        events.append(d)
    return traj.to_dict(), events

