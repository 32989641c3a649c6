#!/usr/bin/env python
"""torch's threads and OpenMP wait policy for the HF backend on CPU, idle and beside a CPU hog.

The work is the main job's (``configs/default.yaml``: the embedded SmolLM2-135M-Instruct, 8
guess-the-number games, 24 tokens a turn at temperature 0.7, logprobs): ``--calls`` generate
calls of its 8 turn-1 prompts through ``HFBackend``, each variant in a fresh process (the wait
policy must be in the environment before torch's OpenMP runtime starts), in two conditions:

* ``idle``: the machine as it is (the load average is printed: a shared machine is rarely idle);
* ``hog``: beside ``--hog`` busy processes (default: one per core), started by this script.

Variants (``before`` is how the backend ran until issue 47, ``after`` how it runs now):

=============  ==========================================================================
before         torch's defaults: every core, libgomp's default wait (spin, then sleep)
passive        ``OMP_WAIT_POLICY=PASSIVE`` in the environment before torch loads
passive-late   ``OMP_WAIT_POLICY=PASSIVE`` set after ``import torch`` (it changes nothing)
one-thread     ``torch.set_num_threads(1)``
worker         torch's defaults, each generate run in a worker thread
after          what ``HFBackend`` does now (``threads='auto'``): the cores no other process runs on
=============  ==========================================================================

For each: wall and CPU seconds of the calls (CPU over all the process's threads), the threads
torch used, and the wall time against ``before`` in the same condition (medians over
``--repeats``, the variants interleaved A B A B within a condition: a shared machine's load
moves under any single measurement). ``--main-job`` runs the
whole main job instead (``mtflow run configs/default.yaml``, ``--max-turns`` turns), before
(``-o threads=null``) and after, in both conditions.

    .venv/bin/python benchmarks/cpu_threads.py                      # before, passive, one-thread, after
    .venv/bin/python benchmarks/cpu_threads.py --variants before passive passive-late one-thread worker after
    .venv/bin/python benchmarks/cpu_threads.py --variants before after --calls 2 --hog 2
    .venv/bin/python benchmarks/cpu_threads.py --main-job --max-turns 6 --variants before after
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ('before', 'passive', 'passive-late', 'one-thread', 'worker', 'after')
#: what a run measures unless --variants says otherwise
DEFAULT_VARIANTS = ('before', 'passive', 'one-thread', 'after')
#: what each variant sets in the child's environment before anything starts
ENV = {'passive': {'OMP_WAIT_POLICY': 'PASSIVE'}}
#: the environment variables that choose OpenMP's behaviour: cleared in every child, then set per variant
OMP_KEYS = ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT', 'OMP_NUM_THREADS')


# ---- the child: one variant's generate calls ------------------------------------------------------
def _requests(n: int) -> List[Any]:
    """The main job's first ``n`` turn-1 prompts (the bundled games, the scheduler's system prompt)."""
    from mtflow.core.safe_yaml import load_yaml_file
    from mtflow.data import read_prompts

    system = load_yaml_file(str(ROOT / 'schedulers' / 'guess_number.yaml'))[0]['system_prompt']
    requests = read_prompts(None, n)
    for r in requests:
        r.messages.insert(0, {'role': 'system', 'content': system})
    return requests


def child(variant: str, calls: int, rows: int) -> Dict[str, Any]:
    import torch

    if variant == 'passive-late':
        os.environ['OMP_WAIT_POLICY'] = 'PASSIVE'
    from mtflow.backends.hf import HFBackend
    from mtflow.core.protocol import RequestConfig

    threads = 'auto' if variant == 'after' else 1 if variant == 'one-thread' else None
    backend = HFBackend('embedded', max_batch_size=16, seed=0, threads=threads)

    requests = _requests(rows)
    config = RequestConfig(max_tokens=24, temperature=0.7, top_p=0.95, logprobs=True)
    backend([requests[0]], RequestConfig(max_tokens=2))  # the first call's one-time costs

    def calls_() -> None:
        for _ in range(calls):
            backend(requests, config)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    if variant == 'worker':
        worker = threading.Thread(target=calls_)
        worker.start()
        worker.join()
    else:
        calls_()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {'variant': variant, 'wall_s': round(wall, 2), 'cpu_s': round(cpu, 2),
            'threads': backend.cpu_threads.last or torch.get_num_threads(),
            'tokens': backend.stats.completion_tokens}


# ---- the parent -----------------------------------------------------------------------------------
def _env(extra: Dict[str, str]) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OMP_KEYS}
    env['PYTHONPATH'] = str(ROOT) + os.pathsep + env.get('PYTHONPATH', '')
    env.update(extra)
    return env


def _load() -> str:
    return ' '.join(Path('/proc/loadavg').read_text().split()[:3])


def measure(variant: str, args: argparse.Namespace) -> Dict[str, Any]:
    cmd = [sys.executable, __file__, '--child', variant, '--calls', str(args.calls), '--rows', str(args.rows)]
    try:
        proc = subprocess.run(cmd, env=_env(ENV.get(variant, {})), capture_output=True, text=True,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {'variant': variant, 'wall_s': None, 'note': f'over {args.timeout} s'}
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{')]
    if proc.returncode or not lines:
        raise SystemExit(f'{variant}: exit {proc.returncode}: {proc.stderr[-2000:]}')
    return json.loads(lines[-1])


def main_job(variant: str, args: argparse.Namespace) -> Dict[str, Any]:
    """The whole main job through the command line, before (``-o threads=null``: torch's own
    threads) or after (mtflow's choice)."""
    with tempfile.TemporaryDirectory(prefix='mtflow-cpu-threads-') as tmp:
        cmd = [sys.executable, '-m', 'mtflow', 'run', str(ROOT / 'configs' / 'default.yaml'), '--out', tmp,
               '--overwrite', '-q', '--no-progress', '--max-turns', str(args.max_turns)]
        if variant == 'before':
            cmd += ['-o', 'threads=null']
        cpu0 = os.times()
        wall0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=_env({}), capture_output=True, text=True, timeout=args.timeout,
                                  cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {'variant': variant, 'wall_s': None, 'note': f'over {args.timeout} s'}
        wall = time.perf_counter() - wall0
        cpu1 = os.times()
        if proc.returncode:
            raise SystemExit(f'main job {variant}: exit {proc.returncode}: {proc.stderr[-2000:]}')
        summary = json.loads((Path(tmp) / 'summary.json').read_text())
    return {'variant': variant, 'wall_s': round(wall, 1), 'rollout_s': summary['wall_s'],
            'cpu_s': round((cpu1.children_user - cpu0.children_user) + (cpu1.children_system - cpu0.children_system), 1),
            'tokens': summary['generated_tokens']}


class Hog:
    """``n`` busy processes (one core's worth each) for the ``hog`` condition."""

    def __init__(self, n: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(n)]
        time.sleep(1.0)  # let the load show

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


def medians(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per (condition, variant): the median of each figure over its repeats, the loads
    seen, and every wall time."""
    out: Dict[tuple, Dict[str, Any]] = {}
    for r in rows:
        out.setdefault((r['condition'], r['variant']), {'condition': r['condition'], 'variant': r['variant'],
                                                        'runs': []})['runs'].append(r)
    for m in out.values():
        runs = m.pop('runs')
        for key in ('wall_s', 'cpu_s', 'rollout_s', 'threads', 'tokens'):
            values = [r[key] for r in runs if r.get(key) is not None]
            if values:
                m[key] = statistics.median(values)
        m['load'] = ', '.join(r['load'].split()[0] for r in runs)
        m['walls'] = ', '.join(str(r.get('wall_s')) for r in runs)
        m['note'] = '; '.join(r['note'] for r in runs if r.get('note'))
    return list(out.values())


def table(rows: List[Dict[str, Any]], main: bool) -> None:
    rows = medians(rows)
    base = {r['condition']: r['wall_s'] for r in rows if r['variant'] == 'before' and r.get('wall_s')}
    head = ('condition', 'variant', 'load (1 min) at each start', 'wall s (median)', 'walls',
            'rollout s' if main else 'threads', 'CPU s', 'tokens', 'wall / before')
    print('| ' + ' | '.join(head) + ' |')
    print('|' + '---|' * len(head))
    for r in rows:
        wall = r.get('wall_s')
        ratio = f'{wall / base[r["condition"]]:.2f}' if wall and base.get(r['condition']) else ''
        cells = (r['condition'], r['variant'], r['load'], wall if wall is not None else r.get('note', ''), r['walls'],
                 r.get('rollout_s' if main else 'threads', ''), r.get('cpu_s', ''), r.get('tokens', ''), ratio)
        print('| ' + ' | '.join(str(c) for c in cells) + ' |')


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--variants', nargs='+', default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    p.add_argument('--conditions', nargs='+', default=['idle', 'hog'], choices=('idle', 'hog'))
    p.add_argument('--calls', type=int, default=1, help='generate calls per measurement (default 1)')
    p.add_argument('--rows', type=int, default=8, help='prompts per call (default 8: the main job)')
    p.add_argument('--hog', type=int, default=os.cpu_count() or 2, help='busy processes of the hog condition')
    p.add_argument('--timeout', type=float, default=300, help='seconds a measurement may take')
    p.add_argument('--repeats', type=int, default=1, help='measurements of each variant, interleaved (default 1)')
    p.add_argument('--main-job', action='store_true', help='run the whole main job instead of its generate calls')
    p.add_argument('--max-turns', type=int, default=2, help='--main-job: turns of each game (the job plays 6)')
    p.add_argument('--child', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.calls, args.rows)), flush=True)
        return
    variants = [v for v in args.variants if not args.main_job or v in ('before', 'after')]
    rows: List[Dict[str, Any]] = []
    print(f'# {time.strftime("%Y-%m-%d %H:%M")}, {os.cpu_count()} cores, hog {args.hog}, '
          + (f'main job, {args.max_turns} turns' if args.main_job else f'{args.calls} calls x {args.rows} rows'),
          flush=True)
    for condition in args.conditions:
        hog = Hog(args.hog) if condition == 'hog' else None
        try:
            for _ in range(args.repeats):
                for variant in variants:
                    load = _load()
                    row = main_job(variant, args) if args.main_job else measure(variant, args)
                    rows.append({**row, 'condition': condition, 'load': load})
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            if hog is not None:
                hog.stop()
    table(rows, args.main_job)


if __name__ == '__main__':
    main()
