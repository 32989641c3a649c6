"""Peak memory of ``mtflow run`` with one 256x256 image per turn, against the same run with text
observations (issue 24's claim: within 1.5x), and how many image files the run directory gets.

It writes N prompts and runs ``mtflow run`` (scripted backend, replayed outputs) in a child
process per mode, reading its peak RSS from ``wait4``; a Python scheduler plays ``--turns``
turns and each step appends one observation:

* ``text``: a line of text;
* ``frame``: ``<image>`` and a freshly drawn 256x256 board (PIL, a grid and two squares placed
  by the request and turn: 48 distinct pictures, so most frames repeat across requests; each
  step still draws, encodes and hashes its own copy, as an environment does);
* ``noise``: ``<image>`` and 256x256 random pixels (incompressible: ~190 KiB of PNG each; the
  worst case, every image distinct).

The run store writes each distinct image once (``files``) however many trajectory lines name it
(``refs``), the moment the step that added it returns; the request holds a reference (the
file's path) from then on, so the peak does not grow with ``batch_size``, the images per request
or their encoded size, nor with N::

    .venv/bin/python benchmarks/image_memory.py                    # 2000 prompts x 4 turns, batch 256
    .venv/bin/python benchmarks/image_memory.py --n 2000 --batch-size 64 --modes text noise
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
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
SIDE = 256


def draw(mode: str, index: int, turn: int) -> Any:
    import numpy as np
    from PIL import Image, ImageDraw

    if mode == 'noise':
        rng = np.random.default_rng(index * 1000 + turn)
        return Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8))
    k = (index + turn) % 48
    img = Image.new('RGB', (SIDE, SIDE), 'white')
    d = ImageDraw.Draw(img)
    for x in range(0, SIDE + 1, 32):
        d.line([(x, 0), (x, SIDE)], fill=(180, 180, 180))
        d.line([(0, x), (SIDE, x)], fill=(180, 180, 180))
    for cell, color in ((k % 8, (40, 170, 60)), (k // 8, (40, 80, 220))):
        x, y = cell * 32, (cell * 3 % 8) * 32
        d.rectangle([x + 5, y + 5, x + 27, y + 27], fill=color)
    return img


class Observe:
    """Plays ``data_dict['turns']`` turns; each step appends one observation of ``data_dict['mode']``."""

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        mode = infer_request.data_dict['mode']
        if mode == 'text':
            infer_request.messages.append({'role': 'user', 'content': f'observation {current_turn}: try again'})
        else:
            from mtflow.core.images import to_image_url
            image = to_image_url(draw(mode, int(infer_request.data_dict['i']), current_turn))
            infer_request.messages.append({'role': 'user', 'content': f'<image>observation {current_turn}'})
            infer_request.images = list(infer_request.images) + [image]
        ids = response_choice.token_ids or []
        return {'infer_request': infer_request, 'response_token_ids': ids, 'response_loss_mask': [1] * len(ids)}

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        return current_turn >= int(infer_request.data_dict['turns'])


def write_inputs(d: Path, mode: str, n: int, turns: int, batch_size: int) -> Path:
    with open(d / 'prompts.jsonl', 'w') as f:
        for i in range(n):
            f.write(json.dumps({'uuid': f'q{i:06d}', 'prompt': f'Play ({i}).', 'turns': turns, 'mode': mode,
                                'i': i}) + '\n')
    (d / 'script.jsonl').write_text(json.dumps({'content': 'left', 'token_ids': [900, 901]}) + '\n')
    cfg = d / 'run.yaml'
    cfg.write_text(f'scheduler: {Path(__file__).resolve()}:Observe\nbackend: scripted\nmodel: script.jsonl\n'
                   f'backend_options: {{cycle: true}}\ndataset: prompts.jsonl\nmax_turns: {turns}\n'
                   f'batch_size: {batch_size}\n')
    return cfg


def run_child(cfg: Path, out: Path) -> Dict[str, Any]:
    cmd = [sys.executable, '-m', 'mtflow', 'run', str(cfg), '-q', '--out', str(out)]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cfg.parent, env=dict(os.environ, PYTHONPATH=str(ROOT)), stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    err = proc.stderr.read().decode() if proc.stderr else ''
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f'mtflow run failed: {err[-2000:]}')
    refs = 0
    with open(out / 'trajectories.jsonl') as f:
        lines = 0
        for line in f:
            lines += 1
            refs += len(json.loads(line).get('images') or ())
    images = out / 'images'
    files = list(images.iterdir()) if images.is_dir() else []
    return {'rss_mib': usage.ru_maxrss / 1024, 'wall_s': wall, 'lines': lines, 'refs': refs, 'files': len(files),
            'mib_on_disk': sum(f.stat().st_size for f in files) / 2**20,
            'traj_mib': (out / 'trajectories.jsonl').stat().st_size / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--n', type=int, default=2000)
    ap.add_argument('--turns', type=int, default=4)
    ap.add_argument('--batch-size', type=int, default=256)
    ap.add_argument('--modes', nargs='+', default=['text', 'frame', 'noise'], choices=['text', 'frame', 'noise'])
    args = ap.parse_args()
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix='mtflow-image-memory-') as tmp:
        for mode in args.modes:
            d = Path(tmp) / mode
            d.mkdir()
            row = {'mode': mode, **run_child(write_inputs(d, mode, args.n, args.turns, args.batch_size), d / 'out')}
            assert row['lines'] == args.n, row
            rows.append(row)
            print(f'done: {row}', file=sys.stderr)
    base = next((r['rss_mib'] for r in rows if r['mode'] == 'text'), rows[0]['rss_mib'])
    print(f'\nmtflow run, scripted backend, {args.n} prompts x {args.turns} turns (one observation per step), '
          f'batch_size {args.batch_size}\n')
    print('| observations | peak RSS MiB | vs text | wall s | image refs | image files | images MiB | '
          'trajectories MiB |')
    print('|---|---:|---:|---:|---:|---:|---:|---:|')
    for r in rows:
        print(f"| {r['mode']} | {r['rss_mib']:.1f} | {r['rss_mib'] / base:.2f}x | {r['wall_s']:.1f} | {r['refs']} | "
              f"{r['files']} | {r['mib_on_disk']:.1f} | {r['traj_mib']:.2f} |")


if __name__ == '__main__':
    main()
