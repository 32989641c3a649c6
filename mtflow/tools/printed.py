"""What a tool prints is its call's, not the run's: ``print()`` inside a tool is captured.

A tool written for a notebook prints as it works (a progress line, a dump of what it fetched); in
``mtflow run`` that went to mtflow's own stdout, between the progress and the summary (1 MB of it
for one call), and ``mtflow gateway`` prints its URL there. While a call runs,
:func:`capturing` routes the writes of its own code to ``sys.stdout`` and ``sys.stderr`` into a
:class:`Printed` buffer that keeps the first :data:`MAX_PRINTED_CHARS` characters and counts the
rest; the step's trace records it with the call (``printed``, ``printed_chars``).

How: ``sys.stdout`` and ``sys.stderr`` are wrapped once by a :class:`_Router` that writes to the
stream it wrapped unless the writing code runs inside a capture (a context variable: an async
tool's task, or the thread a sync tool runs in). Everything else in the process writes as before.
Writes to the file descriptors themselves (a subprocess, C code) are not seen; the ``python``
tool's sandbox captures its program's output itself.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Dict, Iterator, List, Optional

__all__ = ['MAX_PRINTED_CHARS', 'Printed', 'capturing', 'install']

#: the characters of a call's printed output kept (its trace's ``printed``); the rest is counted
MAX_PRINTED_CHARS = 2000


class Printed:
    """A call's printed output: the first ``limit`` characters, and how many were written."""

    def __init__(self, limit: int = MAX_PRINTED_CHARS) -> None:
        self.limit = limit
        self.parts: List[str] = []
        self.kept = 0
        self.chars = 0

    def write(self, text: Any) -> int:
        text = str(text)
        self.chars += len(text)
        room = self.limit - self.kept
        if room > 0 and text:
            part = text[:room]
            self.parts.append(part)
            self.kept += len(part)
        return len(text)

    def flush(self) -> None:
        pass

    @property
    def text(self) -> str:
        return ''.join(self.parts)

    def to_info(self) -> Dict[str, Any]:
        """The trace's record of it (empty when nothing was printed)."""
        return {'printed': self.text, 'printed_chars': self.chars} if self.chars else {}


_CAPTURE: ContextVar[Optional[Printed]] = ContextVar('mtflow_tool_printed', default=None)


class _Router:
    """Stands in for ``sys.stdout``/``sys.stderr``: a write from inside a capture goes to it, any
    other to the stream it wrapped (every other attribute is that stream's)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: Any) -> int:
        sink = _CAPTURE.get()
        return sink.write(text) if sink is not None else self._stream.write(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if _CAPTURE.get() is None:
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def install() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` (once; again after someone replaced them)."""
    for name in ('stdout', 'stderr'):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Router):
            setattr(sys, name, _Router(stream))


@contextmanager
def capturing(printed: Printed) -> Iterator[Printed]:
    """Inside the block (this task or thread, and the tasks it starts), prints go to ``printed``."""
    install()
    token = _CAPTURE.set(printed)
    try:
        yield printed
    finally:
        _CAPTURE.reset(token)
