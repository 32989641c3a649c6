"""What one sandboxed run produced, and how its end is accounted: a clean exit, or a ``timeout``,
``memory``, ``exit`` or ``killed`` error (the ``error_kind`` the tool reports)."""
from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Dict, Optional

__all__ = ['MEMORY_STATUS', 'SandboxResult', 'signal_name', 'signal_of']

#: the launcher's exit status after a ``MemoryError`` (a program's own ``exit(117)`` becomes 1)
MEMORY_STATUS = 117


@dataclass
class SandboxResult:
    """What one run produced: merged output (truncated), exit code, and why it stopped."""
    output: str
    returncode: Optional[int]
    timed_out: bool = False
    truncated: bool = False
    signal: Optional[int] = None  # the signal that ended the program
    flooded: bool = False  # killed for producing far more output than is kept
    memory_mb: Optional[int] = None
    timeout_s: Optional[float] = None
    isolation: str = ''
    uid: Optional[int] = None  # the leased host uid it ran as (as root; rootless, its subordinate uid where it had one)
    pid_namespace: Optional[int] = None  # the inode of its own PID namespace (isolated runs): all its processes' one
    oom_killed: bool = False  # the call's cgroup ran out of memory (memfd, tmpfs, kernel memory...)
    cpu_limit: bool = False  # killed at RLIMIT_CPU's hard limit (a program that caught SIGXCPU)
    usage: Dict[str, float] = field(default_factory=dict)  # memory_peak_mb, cpu_s (from the cgroup)

    @property
    def error_kind(self) -> str:
        """``''`` for a clean exit, else ``timeout``, ``memory``, ``exit`` or ``killed``."""
        if self.timed_out or self.signal == signal.SIGXCPU or self.cpu_limit:
            return 'timeout'
        if self.oom_killed and not self.flooded:
            return 'memory'
        if self.flooded or self.signal is not None:
            return 'killed'
        if self.returncode == MEMORY_STATUS:
            return 'memory'
        if self.returncode not in (0, None):
            return 'exit'
        return ''

    def headline(self) -> str:
        """One line saying why the run is an error (``''`` when it is not)."""
        kind = self.error_kind
        if kind == 'timeout':
            if self.timed_out:
                return f'TimeoutError: execution timed out after {self.timeout_s:g} s'
            return 'TimeoutError: CPU time limit exceeded'
        if kind == 'memory':
            if self.oom_killed and self.returncode != MEMORY_STATUS:
                return f'MemoryError: the call ran out of memory (limit {self.memory_mb} MB for all its processes and files)'
            return f'MemoryError: out of memory (limit {self.memory_mb} MB)'
        if kind == 'killed':
            if self.flooded:
                return 'killed: the program printed far more output than is kept'
            return f'killed by signal {signal_name(self.signal)}'
        if kind == 'exit':
            return f'exit status {self.returncode}'
        return ''

    def as_observation(self) -> str:
        """The text the model sees: the output, then why it stopped when that was an error."""
        text, head = self.output, self.headline()
        if head and self.error_kind == 'exit':
            head = f'({head})'
        if head:
            text += ('\n' if text and not text.endswith('\n') else '') + head
        return text


def signal_name(sig: Optional[int]) -> str:
    try:
        return f'{signal.Signals(sig).name} ({sig})'
    except (ValueError, TypeError):
        return str(sig)


def signal_of(returncode: Optional[int], kind: str) -> Optional[int]:
    """The signal that ended the program: a negative status, or ``128 + N`` (how bwrap's and the
    unshare script's PID 1 report a program killed by signal N)."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    if kind in ('bwrap', 'unshare') and 128 < returncode < 128 + 65:
        return returncode - 128
    return None
