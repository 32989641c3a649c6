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

With ``--neighbour``, instead: what a call that spins on every CPU it can get does to a neighbour
(issue 39, item 10). A spinner call (``--spinners`` processes, each in a session of its own, so each
would have an autogroup of its own) runs while ``--calls`` cold ``print(1)`` calls are timed one at
a time, in ``--rounds`` rounds over the variants: no spinner; a spinner with no CPU group per call
(the sandbox before item 10, the neighbour's calls too); a spinner in its own CPU group with no
quota (``cpu_cores: null``: one weight per call); and with ``cpu_cores`` 1 (the default) and 0.5.

Per-call latency is measured one call at a time (``--calls`` calls after a warm-up), p50 and p95;
the overhead is the isolated figure minus the plain one; with the CPU time each call costs (this
process and the processes it started). Throughput: ``--concurrency`` calls (default 64) started at
once, wall time and calls/s, in ``--rounds`` rounds over the variants (the median is shown), so that
each burst is measured beside the plain one at about the same load. Figures on a loaded machine vary a lot; run it
twice and read them side by side with the baseline of the same run.

    .venv/bin/python benchmarks/sandbox.py
    .venv/bin/python benchmarks/sandbox.py --calls 100 --concurrency 64 --kinds bwrap unshare
    .venv/bin/python benchmarks/sandbox.py --neighbour --calls 20 --rounds 3

With ``--against TREE`` (another checkout, e.g. the commit before a change, from ``git archive``),
the overhead figures of both trees in one run: this script runs itself once per tree and round,
alternately (``--tree``: import mtflow from that checkout), and prints each variant's ``+p50`` and
``+p95`` for the two side by side (medians over the rounds; every round's figure beside them):

    .venv/bin/python benchmarks/sandbox.py --against /tmp/base --rounds 3 --calls 40 --concurrency 16
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import resource
import statistics
import sys
import time
from typing import Awaitable, Callable, Dict, Iterator, List, Optional

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the checkout mtflow is imported from: this one, or ``--tree PATH`` (what ``--against`` passes)
TREE = sys.argv[sys.argv.index('--tree') + 1] if '--tree' in sys.argv[:-1] else HERE
sys.path.insert(0, TREE)

from mtflow.tools import cgroup, isolation, seccomp  # noqa: E402
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


#: the spinner of ``--neighbour``: ``{n}`` processes, each in a new session, busy until killed
SPINNER = """
import os
for _ in range({n}):
    if os.fork() == 0:
        os.setsid()
        while True:
            pass
os.wait()
"""

#: variant -> the spinner's ``cpu_cores`` (``'off'``: no spinner; ``'no group'``: no CPU group per call)
NEIGHBOUR_VARIANTS = {'no spinner': 'off', 'spinner, no CPU group': 'no group', 'spinner, cpu_cores: null': None,
                      'spinner, cpu_cores: 1': 1.0, 'spinner, cpu_cores: 0.5': 0.5}


@contextlib.contextmanager
def without_cpu_group() -> Iterator[None]:
    """The sandbox before issue 39's item 10: no group of the CPU controller per call."""
    real = cgroup.support()
    parents = {c: d for c, d in real.parents.items() if c != 'cpu'}
    saved = cgroup.support
    cgroup.support = lambda: dataclasses.replace(real, parents=parents, cpu=False)  # type: ignore[assignment]
    try:
        yield
    finally:
        cgroup.support = saved  # type: ignore[assignment]


async def beside_a_spinner(kind: str, cores, spinners: int, n: int) -> List[float]:
    """``n`` cold ``print(1)`` calls, timed one at a time while a spinner call runs (``cores``: its
    ``cpu_cores``; ``'off'``: no spinner)."""
    spin = None
    if cores != 'off':
        spin = asyncio.ensure_future(run_python(SPINNER.format(n=spinners), isolation=kind, timeout_s=600, cpu_s=600,
                                                max_processes=spinners + 2,
                                                cpu_cores=None if cores == 'no group' else cores))
        await asyncio.sleep(1.0)  # the spinners are up
    try:
        return await latencies(sandbox_call(kind), n)
    finally:
        if spin is not None:
            spin.cancel()  # the cancelled call kills its sandbox
            await asyncio.gather(spin, return_exceptions=True)


def neighbour(args: argparse.Namespace) -> None:
    kind = args.kinds[0]
    why = isolation.probe(kind)
    if why is not None:
        raise SystemExit(f'{kind}: unavailable here ({why})')
    sup = cgroup.support()
    if not sup.cpu:
        print(f'no CPU group per call here ({sup.describe()}): the cpu_cores rows are the same as "no CPU group"')
    lat: Dict[str, List[float]] = {name: [] for name in NEIGHBOUR_VARIANTS}
    loads = []
    for _ in range(args.rounds):
        for name, cores in NEIGHBOUR_VARIANTS.items():
            loads.append(os.getloadavg()[0])
            with without_cpu_group() if cores == 'no group' else contextlib.nullcontext():
                lat[name] += asyncio.run(beside_a_spinner(kind, cores, args.spinners, args.calls))
    print(f'a neighbour beside a spinner ({args.spinners} processes, each in its own session): {args.calls} cold '
          f'{PROGRAM!r} calls ({kind}) per variant and round, {args.rounds} rounds; {os.cpu_count()} CPUs, '
          f'load average {min(loads):.1f}-{max(loads):.1f}')
    base = pct(lat['no spinner'], 0.5) * 1000
    head = f'{"variant":<26} {"p50 ms":>8} {"p95 ms":>8} {"p50 / alone":>12}'
    print(head)
    print('-' * len(head))
    for name, values in lat.items():
        p50 = pct(values, 0.5) * 1000
        print(f'{name:<26} {p50:8.1f} {pct(values, 0.95) * 1000:8.1f} {p50 / base:12.2f}')


def against(args: argparse.Namespace) -> None:
    """This script once per tree and round, alternately, each printing its figures as json."""
    import json
    import subprocess
    trees = {'before': os.path.abspath(args.against), 'after': TREE}
    if not os.path.isfile(os.path.join(trees['before'], 'mtflow', 'tools', 'sandbox', '__init__.py')):
        raise SystemExit(f'--against {args.against}: no mtflow checkout with the python tool\'s sandbox there '
                         '(e.g. git archive <commit> | tar -x -C /tmp/base)')
    passed = [f'--calls={args.calls}', f'--concurrency={args.concurrency}', f'--pool={args.pool}', '--rounds=1',
              '--no-comparison', '--json', '--kinds', *args.kinds]
    runs: Dict[str, List[dict]] = {name: [] for name in trees}
    loads = []
    for _ in range(args.rounds):
        for name, tree in trees.items():
            loads.append(os.getloadavg()[0])
            out = subprocess.run([sys.executable, os.path.abspath(__file__), '--tree', tree, *passed],
                                 capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.splitlines()[-1]))
    print(f'before: {trees["before"]}; after: {trees["after"]}; {args.rounds} rounds, alternately, of {args.calls} '
          f'sequential calls and {args.concurrency} at once; {os.cpu_count()} CPUs, load average '
          f'{min(loads):.1f}-{max(loads):.1f}; overhead over a plain interpreter start, ms: medians, then each '
          'round\'s before and after +p50')
    head = (f'{"variant":<18} {"+p50 before":>12} {"+p50 after":>11} {"+p95 before":>12} {"+p95 after":>11} '
            f'{"cpu ms before":>14} {"cpu ms after":>13}  rounds +p50')
    print(head)
    print('-' * len(head))
    for variant in runs['after'][0]:
        cell = {(name, key): [r[variant][key] for r in runs[name] if variant in r]
                for name in trees for key in ('d50', 'd95', 'cpu')}
        med = {k: statistics.median(v) if v else float('nan') for k, v in cell.items()}
        each = ' / '.join(f'{b:.1f} {a:.1f}' for b, a in zip(cell['before', 'd50'], cell['after', 'd50']))
        print(f'{variant:<18} {med["before", "d50"]:12.1f} {med["after", "d50"]:11.1f} {med["before", "d95"]:12.1f} '
              f'{med["after", "d95"]:11.1f} {med["before", "cpu"]:14.1f} {med["after", "cpu"]:13.1f}  {each}')
    print('(cpu ms: CPU time per sequential call, the driver and every process it started together; plain '
          'subprocess: the baseline itself, its +p50 is 0)')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--calls', type=int, default=60, help='sequential calls per variant (after 3 warm-up calls)')
    ap.add_argument('--concurrency', type=int, default=64, help='calls started at once for the throughput figure')
    ap.add_argument('--kinds', nargs='+', default=['bwrap', 'unshare'], choices=['bwrap', 'unshare'])
    ap.add_argument('--pool', type=int, default=4, help='warm pool size for the "warm" variants (0: none)')
    ap.add_argument('--rounds', type=int, default=3, help='bursts per variant, in rounds over the variants')
    ap.add_argument('--no-comparison', action='store_true',
                    help='leave out the "bwrap, no filter/cgroup" row (cold bwrap without the v2 hardening)')
    ap.add_argument('--neighbour', action='store_true',
                    help='only the neighbour figure: cold calls beside a spinning call, with and without a CPU bound')
    ap.add_argument('--spinners', type=int, default=4, help='busy processes of the spinning call (--neighbour)')
    ap.add_argument('--against', metavar='TREE', help='another checkout: both trees\' overheads side by side, '
                                                      'measured alternately in --rounds rounds')
    ap.add_argument('--tree', metavar='TREE', help='import mtflow from this checkout (what --against passes)')
    ap.add_argument('--json', action='store_true', help='print the figures as one json line')
    args = ap.parse_args()
    if args.neighbour:
        neighbour(args)
        return
    if args.against:
        against(args)
        return
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
    if args.json:
        import json
        print(json.dumps({name: {'p50': p50, 'p95': p95, 'd50': d50, 'd95': d95, 'cpu': cpu_ms,
                                 'burst': statistics.median(walls[name])}
                          for name, p50, p95, d50, d95, _, cpu_ms in rows}))
        for pool in pools:
            pool.close()
        return
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
