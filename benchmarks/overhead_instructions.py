"""Instructions per request-turn of the executor, counted by callgrind: a figure that the load of a
shared machine does not move (wall and CPU clocks varied by +-30% between runs here).

Each tree is run twice under ``valgrind --tool=callgrind`` with the realistic shape of
``benchmarks/overhead.py``, at two batch sizes; the difference of the two totals, divided by the
extra request-turns, is the executor's cost without interpreter start-up and imports.

    .venv/bin/python benchmarks/overhead_instructions.py                       # this tree
    .venv/bin/python benchmarks/overhead_instructions.py /path/to/other/checkout   # and another, side by side
    .venv/bin/python benchmarks/overhead_instructions.py --mode async OTHER    # the async driver (one request a call)

One child per (tree, n): ``python benchmarks/overhead_instructions.py --child ROOT N MODE``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from typing import List

TURNS = 8
SMALL, LARGE = 200, 1000


def child(root: str, n: int, mode: str) -> None:
    sys.path.insert(0, root)
    sys.path.insert(0, os.path.join(root, 'benchmarks'))
    import overhead  # the tree's own benchmark module, so each tree runs its own shape
    if mode == 'lockstep':
        overhead.time_one('mtflow', n, TURNS, True, 'realistic')
        return
    import mtflow  # the tree's own (first on sys.path)
    requests, firsts, output = overhead.make_inputs(n)
    mtflow.Executor(overhead.SHAPES['realistic'](), lambda reqs, config: [output] * len(reqs), max_turns=TURNS,
                    mode=mode).run(requests, firsts)


def instructions(root: str, n: int, mode: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(['valgrind', '--tool=callgrind', f'--callgrind-out-file={tmp}/out', sys.executable,
                               os.path.abspath(__file__), '--child', root, str(n), mode],
                              capture_output=True, text=True, check=True,
                              env=dict(os.environ, PYTHONHASHSEED='0'))  # hashes vary the count by ~1% otherwise
    return int(re.search(r'Collected : (\d+)', done.stderr).group(1))


def main(argv: List[str]) -> None:
    mode = 'lockstep'
    if argv[:1] == ['--mode']:
        mode, argv = argv[1], argv[2:]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = [here] + [os.path.abspath(a) for a in argv]
    print(f'# {mode}, realistic shape, T={TURNS}, tracing on; instructions per request-turn = '
          f'(I(n={LARGE}) - I(n={SMALL})) / ({LARGE - SMALL} x {TURNS})')
    print('| tree | I(n=200) | I(n=1000) | per request-turn |')
    print('|---|---:|---:|---:|')
    for root in roots:
        small, large = instructions(root, SMALL, mode), instructions(root, LARGE, mode)
        print(f'| {root} | {small:,} | {large:,} | {(large - small) / ((LARGE - SMALL) * TURNS):,.0f} |')


if __name__ == '__main__':
    if sys.argv[1:2] == ['--child']:
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main(sys.argv[1:])
