"""How many of the CPU's cores torch uses when the HF backend generates on CPU, and how its
OpenMP workers wait (``benchmarks/cpu_threads.py`` measured both; ``docs/benchmarks.md``).

torch's intra-op threads are an OpenMP team (GNU libgomp in the CPU wheels) whose workers spin
while they wait for the next parallel region. On a machine other processes keep busy, a spinning
worker holds a core the main thread needs, and a barrier waits for a worker the kernel has
descheduled: the same generate costs several times its CPU and its wall time (the main job, 8 rows
of SmolLM2-135M: 64 s of CPU for 2 generate calls under a load of 5, against 9 s on one thread).

* :func:`prefer_passive_wait`: ``OMP_WAIT_POLICY=PASSIVE`` (workers sleep at once), set in the
  environment unless the user set a policy, and only while torch is not loaded yet: libgomp reads
  it once, when it starts with torch; set later it changes nothing. ``mtflow``'s command line
  calls it first thing.
* :class:`CpuThreads`: before each generate, torch's thread count is the number of cores no other
  process is running on (``procs_running`` of ``/proc/stat``, less this thread, the median of a
  few samples), at least one: an idle machine gets every core, as before; a loaded one gets its
  share, and with one thread there is no team to spin at all. A fixed count (``threads=N``, or
  ``OMP_NUM_THREADS`` in the environment) is used as it is.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import List, Optional, Union

__all__ = ['WAIT_POLICY', 'prefer_passive_wait', 'usable_cores', 'others_running', 'CpuThreads']

#: the environment variable of the OpenMP wait policy (libgomp reads it when it starts)
WAIT_POLICY = 'OMP_WAIT_POLICY'
#: what the user may set to choose the wait themselves (any of them: mtflow leaves the policy alone)
_USER_WAIT_SETTINGS = (WAIT_POLICY, 'GOMP_SPINCOUNT')
#: samples of ``procs_running`` per decision, and the time between two
SAMPLES, SAMPLE_INTERVAL_S = 3, 0.001


def prefer_passive_wait() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a wait (``OMP_WAIT_POLICY``,
    ``GOMP_SPINCOUNT``) or torch is already loaded (then it would change nothing). Returns whether
    it set it."""
    if 'torch' in sys.modules or any(name in os.environ for name in _USER_WAIT_SETTINGS):
        return False
    os.environ[WAIT_POLICY] = 'PASSIVE'
    return True


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
