"""The progress ETA against the time a run really had left, under a load that changes.

Runs ``mtflow run`` in this process over a model whose calls take longer as a load profile says
(a batch call: ``--call-ms`` + ``--per-request-ms`` per request, times the load at that moment),
with a step of ``--step-ms`` (times the load) after each turn, and requests that stop at 2 to
``max_turns`` turns (seeded; ``--turns full``: every request plays ``max_turns``, so the turn
bound has no slack and the ETA stands on its speed alone). Every ``--sample-s`` it reads the progress figures (what the bar
and the log lines show); at the end it compares each ETA with the time that was really left.

Load profiles (``--profile``), the multiplier over the run's expected length ``--expected-s``:

* ``ramp``: 1x rising to 2x at ``--expected-s``, then 2x (other jobs starting one after another);
* ``steps``: 1x, 2x from 25%, 3x from 50%, 1.5x from 75%;
* ``wave``: 1x to 2.5x and back, twice;
* ``flat``: 1x (the baseline).

Reported per mode (lockstep, async): the worst ratio ETA / time left once 10% of the run's turns
were played (the rule: never below 0.8), the median, the share of samples under 0.8, the first
sample with an ETA, and how often the turn count passed its bound or the requests count passed
what was written (both must be 0).

    .venv/bin/python benchmarks/eta.py                              # every profile, both modes
    .venv/bin/python benchmarks/eta.py --profile steps --mode async
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtflow.backends import Backend, build_output  # noqa: E402

PROFILES = ('ramp', 'steps', 'wave', 'flat')
_LOAD: Dict[str, Any] = {'profile': 'flat', 't0': 0.0, 'expected': 60.0}


def load_now() -> float:
    """The load multiplier at this moment of the run."""
    x = (time.perf_counter() - _LOAD['t0']) / _LOAD['expected']
    p = _LOAD['profile']
    if p == 'ramp':
        return 1.0 + min(x, 1.0)
    if p == 'steps':
        return 1.0 if x < 0.25 else 2.0 if x < 0.5 else 3.0 if x < 0.75 else 1.5
    if p == 'wave':
        return 1.75 - 0.75 * __import__('math').cos(4 * 3.14159265 * min(x, 1.0))
    return 1.0


class LoadedModel(Backend):
    """A model whose batch call takes ``call_ms + per_request_ms x requests``, times the load."""
    name = 'loaded'

    def __init__(self, model: Any = None, call_ms: float = 60.0, per_request_ms: float = 15.0,
                 max_batch_size: int = 16) -> None:
        super().__init__()
        self.call_s, self.per_request_s, self.max_batch_size = call_ms / 1e3, per_request_ms / 1e3, max_batch_size

    def generate(self, requests: List[Any], options: Any) -> List[Any]:
        time.sleep((self.call_s + self.per_request_s * len(requests)) * load_now())
        return [build_output('My guess is 50.', [1, 2, 3, 4], 'stop') for _ in requests]


SCHEDULER = '''
import random
import time

import mtflow
from benchmarks.eta import load_now


class Varied(mtflow.Scheduler):
    """Plays 2 to max_turns turns (seeded by the uuid; all of them with varied=False), a step of
    step_ms times the load each."""

    def __init__(self, step_ms: float = 40.0, varied: bool = True, **kw):
        super().__init__(**kw)
        self.step_s, self.varied = step_ms / 1e3, varied

    def check_finished(self, infer_request, response_choice, current_turn):
        turns = random.Random(infer_request.uuid).randint(2, self.max_turns) if self.varied else self.max_turns
        return current_turn >= turns or super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request, response_choice, current_turn):
        time.sleep(self.step_s * load_now())
        infer_request.messages.append({'role': 'user', 'content': 'higher'})
        return {'infer_request': infer_request}
'''


def run_once(mode: str, profile: str, args: argparse.Namespace) -> Dict[str, Any]:
    import mtflow.run.driver as driver
    from benchmarks import eta as this  # the module the run's backend and scheduler import (not __main__)
    from mtflow.cli import main

    load = this._LOAD

    made: List[Any] = []
    last: List[float] = []  # when the last request finished: the end the ETA aims at

    class Recorded(driver.RunProgress):  # the run's own progress object, kept to read its figures
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            made.append(self)

        def on_finished(self, *a: Any, **kw: Any) -> None:
            super().on_finished(*a, **kw)
            if self.finished + self.interrupted >= self.total:
                last.append(time.perf_counter())

    d = Path(tempfile.mkdtemp(prefix='mtflow-eta-'))
    (d / 'sched.py').write_text(SCHEDULER)
    (d / 'data.jsonl').write_text(''.join(json.dumps({'uuid': f'q{i:04d}', 'prompt': 'guess'}) + '\n'
                                          for i in range(args.requests)))
    (d / 'run.yaml').write_text(
        f'scheduler: sched.py:Varied\nscheduler_args: {{step_ms: {args.step_ms}, max_turns: {args.max_turns}, '
        f'varied: {str(args.turns == "varied").lower()}}}\n'
        f'backend: benchmarks.eta:LoadedModel\nbackend_options: {{call_ms: {args.call_ms}, '
        f'per_request_ms: {args.per_request_ms}}}\ndataset: data.jsonl\nout: out\nmax_turns: {args.max_turns}\n'
        f'batch_size: {args.batch_size}\nmode: {mode}\nmax_concurrency: {args.max_concurrency}\n')
    samples: List[Dict[str, Any]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(args.sample_s):
            if made and made[0].started is not None:
                f = made[0].figures()
                samples.append({'t': time.perf_counter(), **f})

    old, cwd = driver.RunProgress, os.getcwd()
    driver.RunProgress = Recorded
    os.chdir(d)
    load.update(profile=profile, expected=args.expected_s)
    thread = threading.Thread(target=sample, daemon=True)
    try:
        load['t0'] = time.perf_counter()
        thread.start()
        with open(os.devnull, 'w') as quiet, contextlib.redirect_stdout(quiet):  # log lines, summary table
            code = main(['run', 'run.yaml', '--progress-every', '100000'])
    finally:
        done.set()
        thread.join()
        driver.RunProgress = old
        os.chdir(cwd)
    assert code == 0 and last, f'mtflow run exited {code}'
    end = last[0]
    final_turns = made[0].figures()['turns']
    ratios = []
    for s in samples:
        left = end - s['t']
        if s['turns'] >= 0.1 * final_turns and s['eta_s'] is not None and left >= 1.0:  # the ETA shows whole seconds
            ratios.append(s['eta_s'] / left)
    first = next((s['t'] - load['t0'] for s in samples if s['eta_s'] is not None), None)
    over_bound = sum(1 for s in samples if s['turn_bound'] is not None and s['turns'] > s['turn_bound'])
    return {'mode': mode, 'profile': profile, 'wall_s': end - load['t0'], 'samples': len(ratios),
            'worst': min(ratios) if ratios else None, 'median': statistics.median(ratios) if ratios else None,
            'under_0.8': sum(1 for r in ratios if r < 0.8) / max(len(ratios), 1), 'first_eta_s': first,
            'turns_over_bound': over_bound, 'final_turns': final_turns, 'trail': [
                (round(s['t'] - load['t0'], 2), s['turns'], s['turn_bound'], s['finished'], s['eta_s'],
                 round(end - s['t'], 2)) for s in samples]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--profile', choices=PROFILES, action='append')
    ap.add_argument('--mode', choices=('lockstep', 'async'), action='append')
    ap.add_argument('--requests', type=int, default=96)
    ap.add_argument('--batch-size', type=int, default=16)
    ap.add_argument('--max-concurrency', type=int, default=16)
    ap.add_argument('--max-turns', type=int, default=6)
    ap.add_argument('--turns', choices=('varied', 'full'), default='varied')
    ap.add_argument('--call-ms', type=float, default=60.0)
    ap.add_argument('--per-request-ms', type=float, default=15.0)
    ap.add_argument('--step-ms', type=float, default=40.0)
    ap.add_argument('--expected-s', type=float, default=30.0, help='the length the load profile is spread over')
    ap.add_argument('--sample-s', type=float, default=0.25)
    ap.add_argument('--seed', type=int, default=0)
    args = ap.parse_args()
    random.seed(args.seed)
    print(f'turns: {args.turns}')
    print('| mode | profile | wall s | samples | worst ETA/left | median | under 0.8 | first ETA at s | '
          'turns over bound |')
    print('|---|---|---:|---:|---:|---:|---:|---:|---:|')
    for profile in args.profile or PROFILES:
        for mode in args.mode or ('lockstep', 'async'):
            r = run_once(mode, profile, args)
            print(f"| {r['mode']} | {r['profile']} | {r['wall_s']:.1f} | {r['samples']} | {r['worst']:.2f} | "
                  f"{r['median']:.2f} | {r['under_0.8']:.0%} | {r['first_eta_s']:.2f} | {r['turns_over_bound']} |",
                  flush=True)


if __name__ == '__main__':
    main()
