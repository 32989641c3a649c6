"""The files of a run directory and the writes that keep them whole: whole lines, atomic JSON
files, fsync of the directory, the ``run.lock`` that keeps a second run out, and the move (or
delete) that makes room for ``--overwrite``. What each file holds: :mod:`mtflow.run.store`.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from mtflow.core.errors import UserError

__all__ = [
    'RunDirError', 'WriteRefused', 'FingerprintMismatch', 'TRAJECTORIES', 'TRACE', 'INTERRUPTED_FILE', 'TREES', 'RUN_INFO', 'SUMMARY',
    'LOCK', 'IMAGES_DIR', 'SESSIONS', 'RUN_FILES', 'FORMAT', 'Record', 'utc_now', 'json_line', 'fsync_dir', 'write_all',
    'append_file', 'write_json_atomic',
    'count_lines', 'scan_jsonl', 'DirLock', 'check_out_apart', 'set_aside', 'not_empty_message', 'config_file_meta', 'recorded_config_file'
]

TRAJECTORIES = 'trajectories.jsonl'
TRACE = 'trace.jsonl'
#: requests cut short by a signal (finish reason ``interrupted``, :data:`mtflow.core.machine.INTERRUPTED`)
INTERRUPTED_FILE = 'interrupted.jsonl'
RUN_INFO = 'run.json'
SUMMARY = 'summary.json'
LOCK = 'run.lock'
#: a branched run's trees (``docs/branching.md``): one line per prompt, written after its leaves
TREES = 'trees.jsonl'
#: the folder of the run's images, each stored once under its content's hash (:mod:`mtflow.run.images`)
IMAGES_DIR = 'images'
#: the sessions a gateway opened, one line each (``mtflow/gateway/gateway.py``)
SESSIONS = 'sessions.jsonl'
#: every file a run directory may hold (``--overwrite --delete-old`` deletes only these)
RUN_FILES = (TRAJECTORIES, TRACE, INTERRUPTED_FILE, TREES, RUN_INFO, SUMMARY, LOCK, IMAGES_DIR, SESSIONS)
#: the ``format`` of ``run.json``
FORMAT = 'mtflow-run/1'

Record = Union[Dict[str, Any], Any]  # a dict, or an object with to_dict() (Trajectory, TraceEvent)


class RunDirError(UserError):
    """A run directory that cannot be opened or written as asked; the message says what to do."""


class WriteRefused(RunDirError):
    """A record the run store did not take (its uuid is written already, the store is closed): its
    line is not kept anywhere, unlike a write that failed for want of room (a plain
    :class:`RunDirError`, whose lines stay in memory for the next try)."""


class FingerprintMismatch(RunDirError):
    """``--resume`` with another config or dataset than the run started with."""

    def __init__(self, message: str, changes: List[str]) -> None:
        super().__init__(message)
        self.changes = changes


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec='seconds')


#: ``json.dumps(obj, ensure_ascii=False, default=str)`` without building an encoder per line
_LINE_ENCODER = json.JSONEncoder(ensure_ascii=False, default=str)


def config_file_meta(config: Optional[Union[str, Path]], out_dir: Union[str, Path]) -> Dict[str, Optional[str]]:
    """How ``run.json`` names the config a run was made from: ``config_file``, its absolute path,
    and ``config_file_from_run``, the same file relative to the run directory, so that a run
    committed to a repository (or moved) together with its config still finds it."""
    if not config:
        return {'config_file': None, 'config_file_from_run': None}
    path = Path(config).resolve()
    return {'config_file': str(path), 'config_file_from_run': os.path.relpath(path, Path(out_dir).resolve())}


def recorded_config_file(run_dir: Union[str, Path], info: Dict[str, Any]) -> Optional[str]:
    """The config a run was made from (``run.json``'s ``info``; :func:`config_file_meta`): the
    relative ``config_file_from_run`` taken from ``run_dir`` when that file is there, else the
    absolute ``config_file`` (a run written before the relative path, or moved without its
    config), else ``None``."""
    relative = info.get('config_file_from_run')
    if isinstance(relative, str) and relative:
        path = Path(run_dir) / relative
        if path.is_file():
            return os.path.normpath(path)
    absolute = info.get('config_file')
    return absolute if isinstance(absolute, str) and absolute else None


def json_line(obj: Record) -> str:
    """One record as JSON without its newline: ``json.dumps`` escapes newlines inside strings, so
    a record is always one line."""
    if not isinstance(obj, dict):
        obj = obj.to_dict()
    return _LINE_ENCODER.encode(obj)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (best effort where directories cannot be
    opened)."""
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


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is out (a short write is not an error)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def append_file(path: Path, data: bytes, fsync: bool = True) -> None:
    """Append ``data`` (whole lines) to ``path``, created when missing, fsynced when asked."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        write_all(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``path`` through a fsynced temporary file and a rename: a reader sees the old file
    or the new one, never half of one."""
    tmp = path.with_name(path.name + '.tmp')
    data = (json.dumps(obj, indent=2, ensure_ascii=False, default=str) + '\n').encode('utf-8')
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def count_lines(path: Path) -> int:
    n = 0
    try:
        with open(path, 'rb') as f:
            for chunk in iter(lambda: f.read(1 << 20), b''):
                n += chunk.count(b'\n')
    except OSError:
        return 0
    return n


def scan_jsonl(path: Path, on_record: Callable[[Dict[str, Any], int], None]) -> bool:
    """Call ``on_record(obj, lineno)`` for each whole line of a JSONL file. A torn last line (no
    newline at the end, or not valid JSON) is cut off the file; returns whether one was. A bad
    line that is not the last one raises :class:`RunDirError` (file and line)."""
    if not path.exists():
        return False
    good_end = 0
    offset = 0
    torn = False
    with open(path, 'rb') as f:
        lookahead: Optional[Tuple[int, bytes]] = None  # one line held back: is it the last?
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
            if lookahead is not None:
                handle(lookahead[0], lookahead[1], False)
            lookahead = (lineno, raw)
        if lookahead is not None:
            torn = not handle(lookahead[0], lookahead[1], True)
    size = path.stat().st_size
    if good_end < size:
        torn = True
        with open(path, 'r+b') as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return torn


class DirLock:
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


def _delete_run_files(out: Path, entries: List[str]) -> None:
    foreign = [e for e in entries if e not in RUN_FILES and not e.endswith('.tmp')]
    if foreign:
        raise RunDirError(f'--delete-old deletes only the files of an mtflow run, and {out} also holds '
                          f'{", ".join(foreign[:5])}{" ..." if len(foreign) > 5 else ""}: move them, or '
                          f'drop --delete-old (the directory is then moved aside)')
    for e in entries:
        if e == IMAGES_DIR and (out / e).is_dir():
            shutil.rmtree(out / e)
        else:
            os.unlink(out / e)
    fsync_dir(out)


def check_out_apart(out: Union[str, Path], source: Union[str, Path], command: str, overwrite: bool = False) -> None:
    """Refuse (:class:`RunDirError`) an ``--out`` that is the run a command reads (``mtflow replay``,
    ``rescore``), holds it or lies inside it: ``--overwrite`` (``overwrite``: the command has it)
    would move the record aside before reading it (every request "diverges"), and a new run
    inside a recorded one mixes the two.
    Checked before anything is opened or moved; symlinks resolved."""
    out_r, source_r = Path(out).resolve(), Path(source).resolve()
    if out_r == source_r:
        how = 'is the run it reads'
    elif out_r in source_r.parents:
        how = f'holds the run it reads ({source})'
    elif source_r in out_r.parents:
        how = f'is inside the run it reads ({source})'
    else:
        return
    moves = ', and --overwrite would move the record away before reading it' if overwrite else ''
    raise RunDirError(f'--out {out} {how}: {command} writes a new run directory apart from the recorded one{moves}; '
                      f'choose an --out outside {source}')


def set_aside(out: Path, delete_old: bool) -> Optional[Path]:
    """Make room for a fresh run in ``out``: move the directory to ``<out>.old-<UTC time>`` (the
    default; returns where), or delete mtflow's own files in it (``delete_old``; refused if it
    holds others; returns ``None``)."""
    lock = DirLock(out / LOCK)  # never move a directory another process is writing to
    try:
        entries = sorted(e for e in os.listdir(out) if e != LOCK)
        if delete_old:
            _delete_run_files(out, entries)
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
        fsync_dir(dest.parent)
        return dest
    finally:
        lock.release()


def not_empty_message(out: Path, entries: List[str]) -> str:
    """Why ``mode='new'`` refuses a directory that holds files, and what to pass instead."""
    if RUN_INFO in entries or TRAJECTORIES in entries:
        n = count_lines(out / TRAJECTORIES)
        return (f'{out} already holds a run ({n} trajectories): pass --resume to continue it, or --overwrite to '
                f'start afresh (the old directory is moved to {out.name}.old-<time>; add --delete-old to delete '
                f'its files instead)')
    shown = ', '.join(entries[:5]) + (' ...' if len(entries) > 5 else '')
    return (f'output directory {out} is not empty ({shown}): choose another --out, or pass --overwrite to move it '
            f'aside and start afresh')
