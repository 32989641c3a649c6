"""Estimators of the progress ETA compared on the same runs: record what ``benchmarks/eta.py``'s
runs tell the ETA (every call of :class:`mtflow.run.eta.Eta` with its time, and what the
progress showed), then replay those events on a fake clock through any version of
``mtflow/run/eta.py`` and score each against the time that was really left, as ``eta.py`` does
(worst ETA/left once 10% of the turns were played, median, share under 0.8).

A replay sees exactly the events of the recorded run, so estimators differ only in what they
make of them (a live benchmark run differs from the next one by the machine's own load too).

    .venv/bin/python benchmarks/eta_replay.py record /tmp/eta-traces --turns full --profile ramp
    .venv/bin/python benchmarks/eta_replay.py replay /tmp/eta-traces mtflow/run/eta.py /tmp/old_eta.py
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CALLS = ('__init__', 'start', 'batch_started', 'call_started', 'call_done', 'turn_done', 'request_done')


def record(out: Path, args: argparse.Namespace) -> None:
    """Runs the benchmark's profiles and modes, writing ``<turns>-<profile>-<mode>.json``."""
    import mtflow.run.eta as eta_module
    from benchmarks import eta as bench

    log: List[Tuple[float, str, List[Any]]] = []
    lock = threading.Lock()

    def wrap(name: str) -> None:
        original = getattr(eta_module.Eta, name)

        def call(self: Any, *a: Any, **kw: Any) -> Any:
            now = time.perf_counter()
            result = original(self, *a, **kw)
            with lock:
                log.append((now, name, [self.total, self.max_turns, self.lockstep, self.batch_size]
                            if name == '__init__' else list(a) + list(kw.values())))
            return result
        setattr(eta_module.Eta, name, call)

    for name in CALLS:
        wrap(name)
    out.mkdir(parents=True, exist_ok=True)
    for profile in args.profile or bench.PROFILES:
        for mode in args.mode or ('lockstep', 'async'):
            log.clear()
            result = bench.run_once(mode, profile, args)
            t0 = bench._LOAD['t0']
            trail = result.pop('trail')
            (out / f'{args.turns}-{profile}-{mode}.json').write_text(json.dumps({
                'result': result, 'trail': trail, 'events': [(t - t0, n, a) for t, n, a in log]}))
            print(f"{args.turns} {profile} {mode}: worst {result['worst']:.2f}, median {result['median']:.2f}, "
                  f"under 0.8 {result['under_0.8']:.0%}", flush=True)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replay(module: Any, trace: Dict[str, Any]) -> List[float]:
    """The ratios ETA / time left that ``module.Eta`` gives at the recorded samples."""
    clock, events, eta, i, ratios = _Clock(), trace['events'], None, 0, []
    final_turns = trace['result']['final_turns']
    for t, turns, bound, finished, _shown, left in trace['trail']:
        while i < len(events) and events[i][0] <= t:
            clock.now, name, a = events[i]
            i += 1
            if name == '__init__':
                eta = module.Eta(a[0], a[1], lockstep=a[2], batch_size=a[3], clock=clock)
            elif eta is not None:
                try:
                    getattr(eta, name)(*a)
                except TypeError:  # an older Eta: call_done() took no live count
                    getattr(eta, name)()
        clock.now = t
        if eta is None or (finished >= eta.total and eta.total):
            continue
        estimate = eta.seconds_left(max(bound - turns, 0) if bound is not None else None, finished)
        if turns >= 0.1 * final_turns and estimate is not None and left >= 1.0:
            ratios.append(estimate / left)
    return ratios


def _load(path: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    sub = ap.add_subparsers(dest='command', required=True)
    rec = sub.add_parser('record', help='run the benchmark and write its traces')
    rec.add_argument('out', type=Path)
    for flag, kind, default in (('--requests', int, 96), ('--batch-size', int, 16), ('--max-concurrency', int, 16),
                                ('--max-turns', int, 6), ('--call-ms', float, 60.0), ('--per-request-ms', float, 15.0),
                                ('--step-ms', float, 40.0), ('--expected-s', float, 30.0), ('--sample-s', float, 0.25)):
        rec.add_argument(flag, type=kind, default=default)
    rec.add_argument('--turns', choices=('varied', 'full'), default='varied')
    rec.add_argument('--profile', choices=('ramp', 'steps', 'wave', 'flat'), action='append')
    rec.add_argument('--mode', choices=('lockstep', 'async'), action='append')
    rep = sub.add_parser('replay', help='score estimators (paths of eta.py versions) on recorded traces')
    rep.add_argument('traces', type=Path)
    rep.add_argument('estimators', nargs='+')
    args = ap.parse_args(argv)
    if args.command == 'record':
        record(args.out, args)
        return
    modules = [_load(path, f'_eta_{k}') for k, path in enumerate(args.estimators)]
    print('| trace | ' + ' | '.join(f'{p}: worst, median, under 0.8' for p in args.estimators) + ' |')
    print('|---|' + '---:|' * len(modules))
    for path in sorted(args.traces.glob('*.json')):
        trace = json.loads(path.read_text())
        cells = []
        for module in modules:
            r = replay(module, trace)
            cells.append(f'{min(r):.2f}, {statistics.median(r):.2f}, {sum(x < 0.8 for x in r) / len(r):.0%}'
                         if r else '-')
        print(f'| {path.stem} | ' + ' | '.join(cells) + ' |')


if __name__ == '__main__':
    main()
