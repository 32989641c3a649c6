"""The ``python`` tool's sandbox cost: per-call overhead against a plain subprocess, and the
throughput of concurrent calls.

- plain: ``python -I -S -c 'print(1)'`` as an asyncio subprocess (what the tool cost before it
  isolated anything: the baseline);
- bwrap / unshare: the same program through :func:`mtflow.tools.sandbox.run_python` with that
  isolation (namespaces, read-only root, leased uid, seccomp filter, fresh keyring, a cgroup per
  call where one can be made, limits, launcher, teardown of the tree);
- bwrap, no filter/cgroup: cold bwrap without the seccomp filter, the fresh session keyring and the
  cgroup per call (what those cost; ``--no-comparison`` leaves it out);
- bwrap warm / unshare warm: the same with a warm pool (``warm_pool: --pool``): the sandbox was
  started ahead, the call feeds it the program (each sandbox still runs one program only).

Per-call latency is measured one call at a time (``--calls`` calls after a warm-up), p50 and p95;
the overhead is the isolated figure minus the plain one; with the CPU time each call costs (this
process and the processes it started). Throughput: ``--concurrency`` calls (default 64) started at
once, wall time and calls/s, in ``--rounds`` rounds over the variants (the median is shown), so that
each burst is measured beside the plain one at about the same load. Figures on a loaded machine vary a lot; run it
twice and read them side by side with the baseline of the same run.

    .venv/bin/python benchmarks/sandbox.py
    .venv/bin/python benchmarks/sandbox.py --calls 100 --concurrency 64 --kinds bwrap unshare
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import statistics
import sys
import time
from typing import Awaitable, Callable, Dict, Iterator, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtflow.tools import isolation, seccomp  # noqa: E402
from mtflow.tools.sandbox import process  # noqa: E402
from mtflow.tools.sandbox import SandboxPool, SandboxSpec, run_python  # noqa: E402

PROGRAM = 'print(1)'
UNHARDENED = 'bwrap, no filter/cgroup'


async def plain_call() -> str:
    proc = await asyncio.create_subprocess_exec(
        isolation.current_interpreter().executable, '-I', '-S', '-c', PROGRAM, env={},
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    return out.decode()


def sandbox_call(kind: str, pool: Optional[SandboxPool] = None) -> Callable[[], Awaitable[str]]:
    async def call() -> str:
        r = await run_python(PROGRAM, isolation=kind, pool=pool)
        if r.error_kind:
            raise RuntimeError(f'{kind}: {r.as_observation()}')
        return r.output
    return call


@contextlib.contextmanager
def without_filter_and_cgroup() -> Iterator[None]:
    """The sandbox as it was before the seccomp filter, the fresh keyring and the cgroup per call
    (the comparison row ``bwrap, no filter/cgroup``): what those three cost on a cold call."""
    saved = process.make_call_cgroup, seccomp.install_code, seccomp.in_fresh_keyring
    process.make_call_cgroup = lambda *a, **k: None
    seccomp.install_code = lambda fd: ''  # the launcher installs no filter
    seccomp.in_fresh_keyring = lambda fn: fn()
    try:
        yield
    finally:
        process.make_call_cgroup, seccomp.install_code, seccomp.in_fresh_keyring = saved


def cpu_s() -> float:
    """CPU time of this process and of every child it reaped (the sandboxes' whole trees)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def pct(values: List[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def latencies(call: Callable[[], Awaitable[str]], n: int, pause_s: float = 0.0) -> List[float]:
    for _ in range(3):
        assert (await call()).strip() == '1'
    out = []
    for _ in range(n):
        await asyncio.sleep(pause_s)  # (warm) calls come from a model, not back to back: the pool refills
        t = time.perf_counter()
        assert (await call()).strip() == '1'
        out.append(time.perf_counter() - t)
    return out


async def burst(call: Callable[[], Awaitable[str]], n: int) -> float:
    t = time.perf_counter()
    results = await asyncio.gather(*[call() for _ in range(n)])
    wall = time.perf_counter() - t
    assert all(r.strip() == '1' for r in results)
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--calls', type=int, default=60, help='sequential calls per variant (after 3 warm-up calls)')
    ap.add_argument('--concurrency', type=int, default=64, help='calls started at once for the throughput figure')
    ap.add_argument('--kinds', nargs='+', default=['bwrap', 'unshare'], choices=['bwrap', 'unshare'])
    ap.add_argument('--pool', type=int, default=4, help='warm pool size for the "warm" variants (0: none)')
    ap.add_argument('--rounds', type=int, default=3, help='bursts per variant, in rounds over the variants')
    ap.add_argument('--no-comparison', action='store_true',
                    help='leave out the "bwrap, no filter/cgroup" row (cold bwrap without the v2 hardening)')
    args = ap.parse_args()
    pools = []

    variants: Dict[str, Callable[[], Awaitable[str]]] = {'plain subprocess': plain_call}
    for kind in args.kinds:
        why = isolation.probe(kind)
        if why is None:
            variants[kind] = sandbox_call(kind)
            if kind == 'bwrap' and not args.no_comparison:
                variants[UNHARDENED] = sandbox_call(kind)
            if args.pool:
                pool = SandboxPool(SandboxSpec(kind, cpu_s=6), args.pool)
                pool.start()
                pools.append(pool)
                variants[f'{kind} warm'] = sandbox_call(kind, pool)
        else:
            print(f'{kind}: unavailable here ({why})')
    rows = []
    base_p50 = base_p95 = None
    cpu: Dict[str, float] = {}
    for name, call in variants.items():
        if name.endswith('warm'):
            time.sleep(1.0)  # the pool fills
        with without_filter_and_cgroup() if name == UNHARDENED else contextlib.nullcontext():
            before = cpu_s()
            lat = asyncio.run(latencies(call, args.calls, 0.03 if name.endswith('warm') else 0.0))
            cpu[name] = (cpu_s() - before) / (args.calls + 3) * 1000
        p50, p95 = pct(lat, 0.5) * 1000, pct(lat, 0.95) * 1000
        if base_p50 is None:
            base_p50, base_p95 = p50, p95
        rows.append([name, p50, p95, p50 - base_p50, p95 - base_p95, statistics.mean(lat) * 1000, cpu[name]])
    # the bursts in rounds, every variant once per round, so that each is measured beside the
    # baseline at the same load; the median of the rounds is shown
    walls: Dict[str, List[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, call in variants.items():
            if name.endswith('warm'):
                time.sleep(1.0)  # the pool refills
            with without_filter_and_cgroup() if name == UNHARDENED else contextlib.nullcontext():
                walls[name].append(asyncio.run(burst(call, args.concurrency)))
    print(f'sandbox overhead: {args.calls} sequential calls of {PROGRAM!r}, then {args.concurrency} at once '
          f'({args.rounds} rounds; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f})')
    head = f'{"variant":<24} {"p50 ms":>8} {"p95 ms":>8} {"+p50 ms":>8} {"+p95 ms":>8} {"mean ms":>8} ' \
           f'{"cpu ms":>7} {"burst s":>8} {"calls/s":>8} {"bursts s":>16}'
    print(head)
    print('-' * len(head))
    for name, p50, p95, d50, d95, mean, cpu_ms in rows:
        wall = statistics.median(walls[name])
        each = ' '.join(f'{w:.2f}' for w in walls[name])
        print(f'{name:<24} {p50:8.1f} {p95:8.1f} {d50:8.1f} {d95:8.1f} {mean:8.1f} {cpu_ms:7.1f} {wall:8.2f} '
              f'{args.concurrency / wall:8.1f} {each:>16}')
    print('(cpu ms: CPU time per sequential call, this process and every process it started together; burst s: '
          'median of the rounds, each round listed under bursts s. warm: latency excludes the 30 ms pause before '
          f'each call that lets the pool refill; the burst gets {args.pool} warm sandboxes and starts the rest '
          'itself)')
    for pool in pools:
        pool.close()


if __name__ == '__main__':
    main()
