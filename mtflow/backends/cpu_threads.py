"""How many of the CPU's cores torch uses when the HF backend generates on CPU
(``benchmarks/cpu_threads.py`` measured the choices; ``docs/benchmarks.md``).

torch's intra-op threads are an OpenMP team (GNU libgomp in the CPU wheels) whose workers spin
a while when they wait for the next parallel region. On a machine that other processes keep
busy, a spinning worker holds a core the main thread needs, and a barrier waits for a worker the
kernel has descheduled: the same generate costs several times its CPU and its wall time (the
main job's 8 rows of SmolLM2-135M, one call: 45 s of CPU and 68 s under a load of 4.5, against
5 s and 8 s on one thread).

:class:`CpuThreads` sets torch's thread count before each generate to the number of cores no
other process is running on (``procs_running`` of ``/proc/stat``, less the asking thread, the
median of a few readings), at least one. An idle machine gets every core, as torch's default
gives (so it is no slower); a loaded one gets one thread per free core, and with one thread
there is no team to spin at all. A fixed count (``threads=N``, or ``OMP_NUM_THREADS`` in the
environment) is used as it is.

The wait policy is left as it is: ``OMP_WAIT_POLICY=PASSIVE`` (workers sleep at once) helps as
much under load when it is in the environment before torch loads (libgomp reads it once, as it
starts: set after ``import torch`` it changes nothing, measured), but what it costs an idle
machine (a wake-up per parallel region) could not be measured on the shared machine of the
benchmark, and one thread under load needs no wait policy. Set it yourself to choose.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import List, Optional, Union

__all__ = ['usable_cores', 'others_running', 'CpuThreads']

#: samples of ``procs_running`` per decision, and the time between two
SAMPLES, SAMPLE_INTERVAL_S = 3, 0.001


def usable_cores() -> int:
    """The cores this process may run on (its affinity: ``taskset``, a cpuset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _procs_running() -> Optional[int]:
    try:
        with open('/proc/stat', 'rb') as f:
            for line in f:
                if line.startswith(b'procs_running '):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def others_running(samples: int = SAMPLES, interval_s: float = SAMPLE_INTERVAL_S) -> Optional[int]:
    """Threads of other processes runnable right now (system-wide ``procs_running`` less the one
    asking), the median of ``samples`` readings; ``None`` where ``/proc/stat`` does not tell."""
    seen: List[int] = []
    for k in range(samples):
        value = _procs_running()
        if value is None:
            return None
        seen.append(max(0, value - 1))
        if k + 1 < samples:
            time.sleep(interval_s)
    return int(statistics.median_low(seen))


class CpuThreads:
    """torch's intra-op thread count for one backend on CPU (see the module docstring).

    ``threads``: ``'auto'`` (the default: every call, the cores no other process is running on,
    at least one; ``OMP_NUM_THREADS`` in the environment wins), a positive int (that many, every
    call), or ``None`` (leave torch's setting alone)."""

    def __init__(self, threads: Union[int, str, None] = 'auto') -> None:
        if threads is not None and threads != 'auto' and (
                not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ValueError(f"threads must be 'auto', a positive int or null, not {threads!r}")
        self.threads = threads
        #: the count the last call used (``None``: not set by this object)
        self.last: Optional[int] = None

    def wanted(self) -> Optional[int]:
        """The count the next call should use, ``None`` to leave torch's alone."""
        if self.threads is None:
            return None
        if self.threads != 'auto':
            return int(self.threads)
        if os.environ.get('OMP_NUM_THREADS'):
            return None  # the user's own choice
        cores = usable_cores()
        others = others_running()
        if others is None:
            return None
        return max(1, min(cores, cores - others))

    def apply(self) -> Optional[int]:
        """Set torch's thread count for the call about to run, in the thread that runs it (an
        OpenMP count belongs to the thread that sets it); returns the count, or ``None``."""
        count = self.wanted()
        if count is None:
            return None
        import torch

        if torch.get_num_threads() != count:
            torch.set_num_threads(count)
        self.last = count
        return count
