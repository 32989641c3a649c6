"""Peak memory and durability cost of ``mtflow run`` on the scripted backend.

For each dataset size N (default 10k and 100k prompts) it writes N prompts, a config that plays
every request ``--turns`` turns with replayed outputs (no model), runs ``mtflow run`` as a child
process and reads its peak RSS from ``wait4``. The run must hold only the batch in flight, so
the 100k run's peak should stay within 1.5x of the 10k run's (the uuid sets of the dataset
check and the run store grow with N, a few MB per 100k).

The durability cost is measured twice: the store's own clock (time spent in the grouped
``write`` + ``fsync`` calls, from ``summary.json``) against the run's wall time, and the same run
with ``fsync`` switched off (``--fsync-compare``), interleaved, best of ``--repeats``.

``--before DIR`` also runs a checkout of an earlier mtflow (e.g. one that kept whole batches'
traces and every prompt in memory) on the same files, as the baseline in the same session::

    .venv/bin/python benchmarks/run_memory.py                       # 10k and 100k, 6 turns
    .venv/bin/python benchmarks/run_memory.py --sizes 10000 --fsync-compare --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]


class SixTurns:
    """A scheduler that plays ``data_dict['turns']`` turns: each step appends one observation."""

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        infer_request.messages.append({'role': 'user', 'content': f'observation {current_turn}: try again'})
        ids = response_choice.token_ids or []
        return {'infer_request': infer_request, 'response_token_ids': ids, 'response_loss_mask': [1] * len(ids),
                'trace_info': {'tool_calls': 1}}

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        return current_turn >= int(infer_request.data_dict['turns'])


def write_inputs(d: Path, n: int, turns: int, batch_size: int) -> Path:
    with open(d / 'prompts.jsonl', 'w') as f:
        for i in range(n):
            f.write(json.dumps({'uuid': f'q{i:07d}', 'prompt': f'Guess my number ({i}).', 'turns': turns}) + '\n')
    script = [{'content': f'My guess is {g}.', 'token_ids': [900 + g % 50, 901, 902, g], 'logprobs': [-0.5, -0.1,
                                                                                                     -0.2, -1.5]}
              for g in (50, 25, 75, 12, 37, 62)]
    (d / 'script.jsonl').write_text(''.join(json.dumps(s) + '\n' for s in script))
    cfg = d / 'run.yaml'
    cfg.write_text(f'scheduler: {Path(__file__).resolve()}:SixTurns\nbackend: scripted\nmodel: script.jsonl\n'
                   f'backend_options: {{cycle: true}}\ndataset: prompts.jsonl\nmax_turns: {turns}\n'
                   f'batch_size: {batch_size}\nrequest_config: {{logprobs: true}}\n')
    return cfg


def run_child(cfg: Path, out: Path, fsync: bool = True, before: Optional[Path] = None) -> Dict[str, Any]:
    """One ``mtflow run`` in a child process: peak RSS (MiB), wall time, the store's write time."""
    if before is not None:
        cmd = [sys.executable, '-m', 'mtflow', 'run', str(cfg), '-q', '--out', str(out)]
        path = str(before)
    else:
        cmd = [sys.executable, __file__, '--child'] + ([] if fsync else ['--no-fsync']) + [
            'run', str(cfg), '-q', '--out', str(out)]
        path = str(ROOT)
    env = dict(os.environ, PYTHONPATH=path)
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cfg.parent, env=env, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    err = proc.stderr.read().decode() if proc.stderr else ''
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f'mtflow run failed ({proc.returncode}): {err[-2000:]}')
    summary = json.loads((out / 'summary.json').read_text())
    lines = sum(1 for _ in open(out / 'trajectories.jsonl'))
    return {'rss_mib': usage.ru_maxrss / 1024, 'process_s': wall, 'wall_s': summary.get('wall_s'),
            'write_s': summary.get('write_s'), 'lines': lines}


def child_main(argv: List[str]) -> int:
    """``--child [--no-fsync] run ...``: the command line, with fsync off when asked."""
    if argv and argv[0] == '--no-fsync':
        argv = argv[1:]
        from mtflow.run.store import RunStore

        real_open = RunStore.open.__func__

        def open_without_fsync(cls: Any, *a: Any, **kw: Any) -> Any:
            kw['fsync'] = False
            return real_open(cls, *a, **kw)

        RunStore.open = classmethod(open_without_fsync)
    from mtflow.cli import main

    return main(argv)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == '--child':
        sys.exit(child_main(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--sizes', type=int, nargs='+', default=[10_000, 100_000])
    ap.add_argument('--turns', type=int, default=6)
    ap.add_argument('--batch-size', type=int, default=256)
    ap.add_argument('--fsync-compare', action='store_true', help='also run with fsync off (interleaved)')
    ap.add_argument('--repeats', type=int, default=1, help='best of N for the fsync comparison')
    ap.add_argument('--before', type=Path, help='a checkout of an earlier mtflow to run on the same inputs')
    args = ap.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix='mtflow-run-memory-') as tmp:
        for n in args.sizes:
            d = Path(tmp) / f'n{n}'
            d.mkdir()
            cfg = write_inputs(d, n, args.turns, args.batch_size)
            row: Dict[str, Any] = {'n': n}
            best_on: Optional[Dict[str, Any]] = None
            best_off: Optional[Dict[str, Any]] = None
            for k in range(args.repeats if args.fsync_compare else 1):
                on = run_child(cfg, d / f'on{k}')
                assert on['lines'] == n, on
                if best_on is None or on['wall_s'] < best_on['wall_s']:
                    best_on = on
                if args.fsync_compare:
                    off = run_child(cfg, d / f'off{k}', fsync=False)
                    if best_off is None or off['wall_s'] < best_off['wall_s']:
                        best_off = off
            row.update(best_on)
            if best_off is not None:
                row['nofsync_wall_s'] = best_off['wall_s']
                row['nofsync_write_s'] = best_off['write_s']
            if args.before is not None:
                row['before_rss_mib'] = run_child(cfg, d / 'before', before=args.before)['rss_mib']
            rows.append(row)
            print(f'done: {row}', file=sys.stderr)

    base = rows[0]['rss_mib']
    print(f'\nmtflow run, scripted backend, {args.turns} turns per request, batch_size {args.batch_size}\n')
    head = '| prompts | peak RSS MiB | vs first | run wall s | write+fsync s | share of wall |'
    sep = '|---:|---:|---:|---:|---:|---:|'
    if args.fsync_compare:
        head += ' wall s, fsync off | fsync cost |'
        sep += '---:|---:|'
    if args.before is not None:
        head += ' before: peak RSS MiB |'
        sep += '---:|'
    print(head)
    print(sep)
    for r in rows:
        line = (f"| {r['n']} | {r['rss_mib']:.1f} | {r['rss_mib'] / base:.2f}x | {r['wall_s']:.2f} | "
                f"{r['write_s']:.3f} | {100 * r['write_s'] / r['wall_s']:.2f}% |")
        if args.fsync_compare:
            line += f" {r['nofsync_wall_s']:.2f} | {100 * (r['wall_s'] - r['nofsync_wall_s']) / r['nofsync_wall_s']:+.1f}% |"
        if args.before is not None:
            line += f" {r['before_rss_mib']:.1f} |"
        print(line)


if __name__ == '__main__':
    main()
