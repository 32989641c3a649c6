"""A learning curve of the plain PyTorch reference loop (``mtflow.train.loop``), three seeds.

The task: multi-turn tool use by the tiny random Qwen2 model of ``tests/tiny_model.py`` (vocabulary
600, two layers of width 32) through the HF backend; each request has ``--turns`` turns of
``--max-tokens`` sampled ids, after each turn the calculator tool scores the reply and its answer
goes back as a tool message (``tests/train/helpers.py``); the reward is the share of even ids
among everything the model sampled. A random policy scores about 0.5; GRPO over groups of
``--size`` copies of each prompt can push it towards 1.0, something a model this small learns in
a couple of minutes on CPU (the embedded SmolLM2-135M is too slow for three seeds in a benchmark's
time on two cores).

The margin is stated before the run (``MARGIN``, ``--margin``): for every seed the mean reward of
the last 10 steps must exceed the mean of the first 10 by at least it. The table prints both
means, the gain, whether the margin was met, and the baseline run in the same process: the same
seed with learning rate 0 (the untrained policy's last 10 steps); ``--svg`` writes the curves
(mean reward per step). The exit status is 1 when a seed misses the margin.

    nice -n 19 .venv/bin/python benchmarks/learning_curve.py
    nice -n 19 .venv/bin/python benchmarks/learning_curve.py --svg docs/learning_curve.svg
    nice -n 19 .venv/bin/python benchmarks/learning_curve.py --advantage rloo
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: stated in advance: the last-10 mean reward exceeds the first-10 mean by at least this, every seed
MARGIN = 0.15


def run_seed(seed: int, steps: int, groups: int, size: int, turns: int, max_tokens: int, lr: float,
             advantage: str = 'grpo') -> List[float]:
    """Mean reward per step for one seed."""
    import torch

    from mtflow import Executor, RequestConfig
    from mtflow.backends.hf import HFBackend
    from mtflow.train.loop import reference_loop
    from tests.tiny_model import make_model, make_tokenizer
    from tests.train.helpers import ToolEveryTurn, prompts

    torch.set_num_threads(1)
    tok = make_tokenizer()
    model = make_model(tok, seed=seed)
    backend = HFBackend(model, tok, default_max_tokens=max_tokens, seed=seed)
    executor = Executor(ToolEveryTurn(max_turns=turns), backend,
                        RequestConfig(max_tokens=max_tokens, temperature=1.0, logprobs=True))
    batches = (prompts(groups, size, start=groups * step) for step in range(steps))
    history = reference_loop(executor, model, torch.optim.Adam(model.parameters(), lr=lr), batches, row_len=512,
                             advantage=advantage, tis_cap=2.0)
    return [h.mean_reward for h in history]


def curves_svg(curves: Dict[Any, Sequence[float]], margin: float, title: str = '', label: str = 'seed {}') -> str:
    """A plain SVG line chart of mean reward per step, one line per key of ``curves`` (a seed; a
    policy of ``benchmarks/multi_policy_curve.py``), labelled by ``label``."""
    width, height, pad = 640, 320, 40
    steps = max(len(c) for c in curves.values())
    colors = ['#2563eb', '#dc2626', '#16a34a', '#9333ea', '#ea580c']
    title = title or 'mean reward per step (tiny Qwen2, GRPO, reference loop)'

    def xy(i: int, r: float) -> str:
        x = pad + (width - 2 * pad) * i / max(1, steps - 1)
        y = height - pad - (height - 2 * pad) * r
        return f'{x:.1f},{y:.1f}'

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             'font-size="11">', f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{pad}" y="18">{title}; margin {margin}</text>']
    for r in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = height - pad - (height - 2 * pad) * r
        parts.append(f'<line x1="{pad}" x2="{width - pad}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e7eb"/>')
        parts.append(f'<text x="8" y="{y + 4:.1f}">{r:.2f}</text>')
    parts.append(f'<text x="{width // 2}" y="{height - 8}">step</text>')
    for k, (key, curve) in enumerate(sorted(curves.items(), key=lambda item: str(item[0]))):
        color = colors[k % len(colors)]
        points = ' '.join(xy(i, r) for i, r in enumerate(curve))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>')
        parts.append(f'<text x="{width - pad - 110}" y="{pad + 14 * k}" fill="{color}">{label.format(key)}</text>')
    parts.append('</svg>')
    return '\n'.join(parts) + '\n'


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    parser.add_argument('--steps', type=int, default=60)
    parser.add_argument('--groups', type=int, default=4, help='prompts per step')
    parser.add_argument('--size', type=int, default=4, help='copies of each prompt (GRPO group size)')
    parser.add_argument('--turns', type=int, default=2)
    parser.add_argument('--max-tokens', type=int, default=8)
    parser.add_argument('--lr', type=float, default=1e-2)
    parser.add_argument('--advantage', choices=['grpo', 'rloo', 'reinforce'], default='grpo')
    parser.add_argument('--margin', type=float, default=MARGIN)
    parser.add_argument('--svg', type=Path, default=None, help='write the curves here')
    args = parser.parse_args(argv)
    if args.steps < 20:
        parser.error('--steps must be >= 20 (the first 10 and the last 10 steps are compared)')
    curves: Dict[int, List[float]] = {}
    print(f'task: even-id share, {args.groups}x{args.size} requests a step, {args.turns} turns of {args.max_tokens} '
          f'ids, {args.advantage}, Adam lr {args.lr}, {args.steps} steps; margin stated in advance: +{args.margin}')
    print(f"{'seed':>4}  {'first 10':>8}  {'last 10':>8}  {'gain':>6}  {'margin met':>10}  {'untrained last 10':>17}  "
          f"{'wall s':>6}")
    ok = True
    for seed in args.seeds:
        t0 = time.perf_counter()
        curve = run_seed(seed, args.steps, args.groups, args.size, args.turns, args.max_tokens, args.lr, args.advantage)
        curves[seed] = curve
        wall = time.perf_counter() - t0
        # the same rollouts with lr 0: what the last 10 steps score without learning
        still = run_seed(seed, args.steps, args.groups, args.size, args.turns, args.max_tokens, 0.0, args.advantage)
        first, last = sum(curve[:10]) / 10, sum(curve[-10:]) / 10
        met = last - first >= args.margin
        ok = ok and met
        print(f'{seed:>4}  {first:>8.3f}  {last:>8.3f}  {last - first:>+6.3f}  {"yes" if met else "NO":>10}  '
              f'{sum(still[-10:]) / 10:>17.3f}  {wall:>6.1f}', flush=True)
    if args.svg is not None:
        args.svg.parent.mkdir(parents=True, exist_ok=True)
        args.svg.write_text(curves_svg(curves, args.margin))
        print(f'curves: {args.svg}')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
