"""Partial rollouts meet their budget exactly and leave no thread behind, in 30 fresh processes.

``Until(finished=48)`` used to return 48 to 89 finished requests (the budget was checked once per
wake-up of the driver, after every completion of that wake-up was handled), and one run in nine
printed ``FATAL: exception not rethrown`` at exit: a generation the budget had cancelled went on
in a daemon thread of the dynamic batcher, which the interpreter killed mid-call. Each process
(``partial_child.py``) runs the partial-rollout path with the scripted backend behind the batcher
and as a synchronous ``rollout_fn``, at several concurrencies, then exits with a batch still in
the engine; stderr must be empty."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name('partial_child.py')
PROCESSES = 30


def _one(seed: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f'{ROOT}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
    env.pop('MTFLOW_DEBUG', None)
    return subprocess.run([sys.executable, str(CHILD), str(seed)], capture_output=True, text=True, timeout=120,
                          cwd=str(ROOT), env=env)


@pytest.mark.slow
def test_partial_rollouts_meet_the_budget_exactly_and_exit_clean_in_30_fresh_processes():
    with ThreadPoolExecutor(6) as pool:  # the children mostly sleep inside the engine
        procs = list(pool.map(_one, range(PROCESSES)))
    for seed, proc in enumerate(procs):
        where = f'process {seed}'
        assert proc.returncode == 0, f'{where}: exit {proc.returncode}\n{proc.stderr[-2000:]}'
        assert proc.stderr == '', f'{where}: stderr:\n{proc.stderr[-2000:]}'
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
        report, at_exit = lines
        for run in report['runs']:
            label = f"{where}, {run['kind']}, max_concurrency {run['concurrency']}"
            assert run['finished'] == run['budget'], f"{label}: {run['finished']} finished for Until(finished={run['budget']})"
            assert run['rest_ok'] and run['rest_finished'] == run['unfinished'] == run['requests'] - run['budget'], label
            assert run['rollout_threads_left'] == [], f'{label}: threads of the run still running'
        assert report['last_unfinished'] > 0
        assert at_exit == {'active_at_exit': 0}, f'{where}: a generation was still in the engine at exit'
