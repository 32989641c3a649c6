"""Real process groups for tests: ``launch`` starts ``world`` spawned processes as torchrun would
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` and an agent-hosted
TCPStore), waits for every one with a deadline, and kills (by handle) any still running after it.

The store is hosted here, on a port the OS picked (``port=0``), and the workers join it as clients
(``TORCHELASTIC_USE_AGENT_STORE``), exactly like torchrun's agent: no free-port race with the
other programs on the machine."""
from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence


def launch(target: Callable[..., Any], world: int, args: Sequence[Any] = (), timeout: float = 300.0,
           env: Optional[Dict[str, str]] = None) -> List[Optional[int]]:
    """Run ``target(rank, *args)`` in ``world`` spawned processes; return their exit codes.

    Raises ``TimeoutError`` (after killing the stragglers) if any is still running after
    ``timeout`` seconds: a hang fails the test instead of blocking it."""
    import torch.distributed as dist

    store = dist.TCPStore('127.0.0.1', 0, None, True, wait_for_workers=False)
    ctx = multiprocessing.get_context('spawn')
    base = {'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': str(store.port), 'WORLD_SIZE': str(world),
            'TORCHELASTIC_USE_AGENT_STORE': 'True', 'TORCHELASTIC_RESTART_COUNT': '0', 'OMP_NUM_THREADS': '1',
            'GLOO_SOCKET_IFNAME': 'lo', **(env or {})}
    procs = []
    saved = {k: os.environ.get(k) for k in base}
    try:
        for rank in range(world):
            # spawn copies the parent's environment at start(): set this rank's, start, restore
            os.environ.update(base, RANK=str(rank), LOCAL_RANK=str(rank))
            p = ctx.Process(target=target, args=(rank, *args), name=f'rank{rank}')
            p.start()
            procs.append(p)
    finally:
        for k in ('RANK', 'LOCAL_RANK'):
            os.environ.pop(k, None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = time.monotonic() + timeout
    stuck = []
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            stuck.append(p)
    for p in stuck:
        p.kill()
        p.join(10)
    codes = [p.exitcode for p in procs]
    del store
    if stuck:
        raise TimeoutError(f'ranks {[p.name for p in stuck]} still running after {timeout:.0f}s (killed): '
                           f'exit codes {codes}')
    return codes
