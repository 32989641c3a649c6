"""Replay and diff at scale: ``mtflow replay --tools recorded`` against the original run, and
``mtflow diff`` of large runs in bounded memory.

``tools``: a run of ``--requests`` requests (scripted model, default 1000) whose first turn calls
the sandboxed ``python`` tool (a real subprocess per call, as in training) and whose second turn
answers; then ``mtflow replay --tools recorded`` of it (the recorded outputs, tool results from
the record, the scheduler and reward re-run). Both are child processes on the same machine, run
side by side (original, replay, original, replay, ... ``--repeats``), best wall time of each, and
the least CPU time of each (user + sys from ``wait4``: the child and the sandboxes it waited for;
on a loaded machine the wall ratio falls, the CPU ratio does not); the replay must be identical
(``mtflow diff`` exit 0). The children compile mtflow once into a bytecode cache first (as an
installed package is), unless ``--cold-imports``.

``diff``: two runs of N requests each (default 10k and 100k; lines copied from a real scripted
run, new uuids, 1% of B's requests with another observation and reward), compared by
``mtflow diff`` in a child process whose peak RSS comes from ``wait4``. The baseline in the same
session is the previous design, an in-memory dict uuid -> offset (``--baseline``, run inline in a
child too). The target: the 100k diff within a minute, its peak within 1.5x of the 10k diff's.

    .venv/bin/python benchmarks/replay.py tools --requests 1000 --repeats 2
    .venv/bin/python benchmarks/replay.py diff --sizes 10000 100000 --baseline
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
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

SCHEDULER = """name: bench_python
max_turns: 3
parser: hermes
tools:
  - name: python
    builtin: python
    options: {timeout_s: 10, memory_mb: 256, max_output_chars: 2000}
    timeout_s: 20
    max_concurrency: 4
observation: {mode: message, role: tool, template: "{result}", error_template: "Error: {error}"}
answer: {pattern: 'answer is (\\d+)', field: target}
system_prompt: "Use python. {tools}"
"""


#: what the children's environment changes (``bytecode_cache``)
CHILD_ENV: Dict[str, Optional[str]] = {}
#: CPU seconds (user + sys, the child and the processes it waited for: the sandboxes) of the last child
LAST_CPU = [0.0]


def bytecode_cache(d: Path) -> None:
    """Let the children compile mtflow once into a bytecode cache under ``d`` (as an installed
    package has), whatever ``PYTHONDONTWRITEBYTECODE`` says here: otherwise every command
    compiles mtflow's ~130 modules from source (~0.45 s here), a cost no installed copy pays."""
    CHILD_ENV.update({'PYTHONDONTWRITEBYTECODE': None, 'PYTHONPYCACHEPREFIX': str(d / 'pycache')})
    _child(['-c', 'import mtflow.cli, mtflow.commands.run, mtflow.commands.replay, mtflow.commands.diff'], d)


def _child(argv: List[str], cwd: Path) -> Tuple[int, float, float]:
    """Run a child Python; (exit status, wall s, peak RSS MiB from wait4)."""
    code, wall, rss, _ = _child_out(argv, cwd)
    return code, wall, rss


def _child_out(argv: List[str], cwd: Path) -> Tuple[int, float, float, str]:
    """:func:`_child` and the child's stdout."""
    env = {**os.environ, 'PYTHONPATH': str(ROOT)}
    for key, value in CHILD_ENV.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([PY, *argv], cwd=cwd, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        code = os.waitstatus_to_exitcode(status)
        LAST_CPU[0] = usage.ru_utime + usage.ru_stime
        out.seek(0)
        err.seek(0)
        shown, problems = out.read().decode(), err.read().decode()
    if code not in (0, 1):
        raise SystemExit(f'{argv}: exit {code}\n{problems[-2000:]}')
    return code, wall, usage.ru_maxrss / 1024, shown


#: the command timed inside the child, after the imports (what both commands share: the interpreter
#: start and mtflow's imports, ~1-2 s here, are left out)
TIMED = 'import sys, time; from mtflow.cli import main; t = time.perf_counter(); main(); ' \
        'print(f"TIMED {time.perf_counter() - t:.4f}")'


def _timed(args: List[str], cwd: Path) -> Tuple[float, float, float, float]:
    """(whole child wall s, the command's own s, peak RSS MiB, CPU s)."""
    _, wall, rss, out = _child_out(['-c', TIMED, *args], cwd)
    own = float(next(line.split()[1] for line in out.splitlines() if line.startswith('TIMED ')))
    return wall, own, rss, LAST_CPU[0]


def _mtflow(*args: str) -> List[str]:
    return ['-m', 'mtflow', *args]


# ---- tools ---------------------------------------------------------------------------------------
def tools_inputs(d: Path, n: int) -> Path:
    (d / 'sched.yaml').write_text(SCHEDULER)
    with open(d / 'script.jsonl', 'w') as s, open(d / 'data.jsonl', 'w') as p:
        for i in range(n):
            uuid = f't{i:05d}'
            code = f'print({i} * 2 + 1)'
            call = '<tool_call>' + json.dumps({'name': 'python', 'arguments': {'code': code}}) + '</tool_call>'
            s.write(json.dumps({'uuid': uuid, 'turn': 1, 'content': call, 'token_ids': [11, 12, i % 50],
                                'logprobs': [-0.1, -0.2, -0.3]}) + '\n')
            s.write(json.dumps({'uuid': uuid, 'turn': 2, 'content': f'The answer is {i * 2 + 1}.',
                                'token_ids': [13, i % 50], 'logprobs': [-0.4, -0.5]}) + '\n')
            p.write(json.dumps({'uuid': uuid, 'messages': [{'role': 'user', 'content': f'compute {code}'}],
                                'data_dict': {'target': i * 2 + 1}}) + '\n')
    cfg = d / 'cfg.yaml'
    cfg.write_text(f'scheduler: {d / "sched.yaml"}\nbackend: scripted\nmodel: {d / "script.jsonl"}\n'
                   f'dataset: {d / "data.jsonl"}\nbatch_size: 64\nrequest_config: {{logprobs: true}}\n')
    return cfg


def bench_tools(n: int, repeats: int, cold: bool) -> None:
    with tempfile.TemporaryDirectory(prefix='mtflow-bench-replay-') as tmp:
        d = Path(tmp)
        cfg = tools_inputs(d, n)
        if not cold:
            bytecode_cache(d)
        load = os.getloadavg()[0]
        runs, replays = [], []
        for k in range(repeats):
            runs.append(_timed(['run', str(cfg), '-q', '--out', str(d / f'orig{k}')], d))
            replays.append(_timed(['replay', str(d / 'orig0'), '--out', str(d / f'rec{k}'), '-q', '--tools',
                                   'recorded'], d))
        code, _, _ = _child(_mtflow('diff', str(d / 'orig0'), str(d / 'rec0')), d)
        calls = sum(1 for line in (d / 'orig0' / 'trace.jsonl').read_text().splitlines()
                    if '"from": "tool_step"' in line and '"name": "python"' in line)
        best_run, best_rep = min(runs), min(replays)
        cpu_run, cpu_rep = min(r[3] for r in runs), min(r[3] for r in replays)
        print(f'\n`mtflow run` vs `mtflow replay --tools recorded`, {n} requests, {calls} sandboxed python calls, '
              f'best of {repeats}, child processes, '
              f'{"no bytecode cache" if cold else "bytecode cache warmed first"}, load average {load:.1f} at the '
              f'start, {os.getloadavg()[0]:.1f} at the end\n')
        print('| | whole command s | after imports s | CPU s | peak RSS MiB |\n|---|---:|---:|---:|---:|')
        print(f'| original run (python tool executed) | {best_run[0]:.2f} | {best_run[1]:.2f} | {cpu_run:.2f} '
              f'| {best_run[2]:.0f} |')
        print(f'| replay --tools recorded | {best_rep[0]:.2f} | {best_rep[1]:.2f} | {cpu_rep:.2f} | {best_rep[2]:.0f} |')
        print(f'\nspeed-up: whole command {best_run[0] / best_rep[0]:.1f}x, after imports '
              f'{best_run[1] / best_rep[1]:.1f}x, CPU {cpu_run / cpu_rep:.1f}x; replay identical to the run: '
              f'{code == 0} (mtflow diff exit {code})')


# ---- diff ----------------------------------------------------------------------------------------
def _sample_lines(d: Path) -> List[dict]:
    """Real trajectory lines: a scripted guess-the-number run (16 requests, up to 6 turns)."""
    cfg = d / 'sample.yaml'
    cfg.write_text(f'scheduler: {ROOT / "schedulers" / "guess_number.yaml"}\nbackend: scripted\n'
                   f'model: {ROOT / "configs" / "scripted_guesses.jsonl"}\nbackend_options: {{cycle: true}}\n'
                   f'max_turns: 6\nbatch_size: 8\nrequest_config: {{logprobs: true}}\n'
                   f'dataset: {ROOT / "mtflow" / "data" / "prompts.jsonl"}\n')
    _child(_mtflow('run', str(cfg), '-q', '--out', str(d / 'sample')), d)
    return [json.loads(line) for line in (d / 'sample' / 'trajectories.jsonl').read_text().splitlines()]


def diff_inputs(d: Path, n: int, sample: List[dict]) -> Tuple[Path, Path]:
    a, b = d / f'a{n}.jsonl', d / f'b{n}.jsonl'
    with open(a, 'w') as fa, open(b, 'w') as fb:
        for i in range(n):
            line = dict(sample[i % len(sample)], uuid=f'g{i // 4:07d}#{i % 4}')  # groups of 4
            text = json.dumps(line) + '\n'
            fa.write(text)
            if i % 100 == 7:  # 1%: another observation and reward
                changed = json.loads(text)
                changed['messages'][3]['content'] = 'Something else.'
                changed['rollout_infos']['reward'] = 0.5
                text = json.dumps(changed) + '\n'
            fb.write(text)
    return a, b


BASELINE = r'''
import json, sys
from mtflow.run.diff import compare, index_lines
a, b = sys.argv[1], sys.argv[2]
index = index_lines(b)  # the previous design: uuid -> offset in a dict, seen uuids in a set
seen, groups, different = set(), {}, 0
with open(b, 'rb') as fb:
    for raw in open(a, 'rb'):
        line = json.loads(raw); uuid = line['uuid']; seen.add(uuid)
        fb.seek(index[uuid]); other = json.loads(fb.readline())
        g = groups.setdefault(uuid.split('#')[0], [0.0, 0, 0.0, 0])
        g[0] += line['rollout_infos'].get('reward') or 0; g[1] += 1
        g[2] += other['rollout_infos'].get('reward') or 0; g[3] += 1
        different += compare(line, other) is not None
sys.exit(1 if different else 0)
'''


def bench_diff(sizes: List[int], baseline: bool) -> None:
    with tempfile.TemporaryDirectory(prefix='mtflow-bench-diff-') as tmp:
        d = Path(tmp)
        sample = _sample_lines(d)
        rows = []
        for n in sizes:
            a, b = diff_inputs(d, n, sample)
            code, wall, rss = _child(_mtflow('diff', str(a), str(b), '--json'), d)
            row = [n, f'{a.stat().st_size / 2**20:.0f}', f'{wall:.2f}', f'{rss:.0f}', code]
            if baseline:
                _, bwall, brss = _child(['-c', BASELINE, str(a), str(b)], d)
                row += [f'{bwall:.2f}', f'{brss:.0f}']
            rows.append(row)
            a.unlink()
            b.unlink()
        head = '| requests | MiB per run | diff wall s | diff peak RSS MiB | exit |'
        sep = '|---:|---:|---:|---:|---:|'
        if baseline:
            head += ' in-memory index wall s | its peak RSS MiB |'
            sep += '---:|---:|'
        print(f'\n`mtflow diff A B --json` (1% of requests differ), child process, peak RSS from wait4\n')
        print(head)
        print(sep)
        for row in rows:
            print('| ' + ' | '.join(map(str, row)) + ' |')
        if len(rows) >= 2:
            print(f'\npeak RSS ratio {rows[-1][0]} / {rows[0][0]}: {float(rows[-1][3]) / float(rows[0][3]):.2f}x'
                  + (f' (in-memory index: {float(rows[-1][6]) / float(rows[0][6]):.2f}x)' if baseline else ''))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    sub = parser.add_subparsers(dest='what', required=True)
    t = sub.add_parser('tools')
    t.add_argument('--requests', type=int, default=1000)
    t.add_argument('--repeats', type=int, default=2)
    t.add_argument('--cold-imports', action='store_true',
                   help='no bytecode cache: every command compiles mtflow from source (PYTHONDONTWRITEBYTECODE)')
    df = sub.add_parser('diff')
    df.add_argument('--sizes', type=int, nargs='+', default=[10000, 100000])
    df.add_argument('--baseline', action='store_true', help='also run the in-memory index design')
    args = parser.parse_args()
    if args.what == 'tools':
        bench_tools(args.requests, args.repeats, args.cold_imports)
    else:
        bench_diff(args.sizes, args.baseline)


if __name__ == '__main__':
    main()
