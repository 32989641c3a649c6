"""The group writer of a run directory: finished requests are held in memory and written in small
groups, each group one ``write`` per file followed by ``fsync``, the trace events before the
trajectory lines (so a trajectory on disk always has its events on disk).

A group goes out every ``flush_every`` requests or once the oldest one has waited
``flush_interval_s`` seconds, whichever comes first. A write that fails (a full disk) is undone
to the last whole group, so the files never end in half a group. Not thread-safe on its own:
:class:`mtflow.run.store.RunStore` calls it under its lock.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Dict, List, Tuple

from mtflow.run.files import INTERRUPTED_FILE, TRACE, TRAJECTORIES, RunDirError, append_file, write_all
from mtflow.run.signals import deferred_interrupts

__all__ = ['GroupWriter']


class GroupWriter:
    """Appends whole groups of lines to ``trace.jsonl``, ``trajectories.jsonl`` and
    ``interrupted.jsonl`` in ``out_dir``.

    Attributes:
        flushes: groups written.
        fsync_s: time spent writing and fsyncing groups (the durability cost).
    """

    def __init__(self, out_dir: Path, *, fsync: bool = True, flush_every: int = 256,
                 flush_interval_s: float = 2.0) -> None:
        if flush_every < 1:
            raise ValueError(f'flush_every must be >= 1, not {flush_every!r}')
        self.out_dir = out_dir
        self.fsync = fsync
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        self.flushes = 0
        self.fsync_s = 0.0
        self.requests: List[Tuple[str, str]] = []  # (trace lines, trajectory line) per request
        self.interrupted: List[str] = []  # interrupted.jsonl lines
        self.oldest_since = 0.0  # time.monotonic() when the oldest held request arrived
        self.fds: Dict[str, int] = {}
        self.sizes: Dict[str, int] = {}

    def open(self) -> None:
        """Open the trace and trajectory files for appending (they exist)."""
        for name in (TRAJECTORIES, TRACE):
            fd = os.open(self.out_dir / name, os.O_WRONLY | os.O_APPEND)
            self.fds[name] = fd
            self.sizes[name] = os.fstat(fd).st_size

    def close_files(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:  # pragma: no cover
                pass
        self.fds.clear()

    @property
    def holds_lines(self) -> bool:
        return bool(self.requests or self.interrupted)

    def add(self, trace_lines: str, trajectory_line: str, flush: bool = True) -> None:
        """One finished request; writes the group when it is full or its oldest request is due
        (``flush=False``: not now, more of the same group follow)."""
        if not self.requests:
            self.oldest_since = time.monotonic()
        self.requests.append((trace_lines, trajectory_line))
        if flush and (len(self.requests) >= self.flush_every or self._due()):
            self.flush()

    def add_interrupted(self, line: str) -> None:
        self.interrupted.append(line)

    def tick(self) -> None:
        """Write the group if its oldest request has waited ``flush_interval_s``."""
        if self.requests and self._due():
            self.flush()

    def _due(self) -> bool:
        return time.monotonic() - self.oldest_since >= self.flush_interval_s

    def flush(self) -> None:
        """Write every held line now: trace events first, fsync, then trajectory lines, fsync."""
        if not self.holds_lines:
            return
        with deferred_interrupts():  # a first Ctrl-C waits for the group; a second one does not
            started = time.perf_counter()
            group, self.requests = self.requests, []
            lines, self.interrupted = self.interrupted, []
            sizes = dict(self.sizes)
            try:
                if group:
                    self._append(TRACE, ''.join(trace for trace, _ in group).encode('utf-8'))
                    self._append(TRAJECTORIES, ''.join(line for _, line in group).encode('utf-8'))
                if lines:
                    self._append_interrupted(''.join(lines).encode('utf-8'))
            except OSError as exc:  # e.g. a full disk: never leave half a group behind, keep every line
                self._undo(sizes)
                self.requests = group + self.requests
                self.interrupted = lines + self.interrupted
                raise RunDirError(f'cannot write to {self.out_dir}: {exc.strerror or exc}; what was written before '
                                  f'is whole, and --resume continues the run') from exc
            self.flushes += 1
            self.fsync_s += time.perf_counter() - started

    def _append(self, name: str, data: bytes) -> None:
        fd = self.fds[name]
        write_all(fd, data)
        if self.fsync:
            os.fsync(fd)
        self.sizes[name] += len(data)

    def _append_interrupted(self, data: bytes) -> None:
        append_file(self.out_dir / INTERRUPTED_FILE, data, self.fsync)

    def _undo(self, sizes: Dict[str, int]) -> None:
        """Cut the files back to ``sizes``: the end of the last whole group."""
        for name, size in sizes.items():
            try:
                os.ftruncate(self.fds[name], size)
            except OSError:  # pragma: no cover
                pass
        self.sizes = sizes
