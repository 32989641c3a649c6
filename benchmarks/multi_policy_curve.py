"""Two policies trained from one run: a learning curve per policy, with an lr-0 control in the same run.

The game (cooperative, turn-based, ``docs/multi-agent.md``): two tiny random Qwen2 models of
``tests/tiny_model.py``, each its own policy behind the policy router, play a relay: the
*speaker* (policy ``a``) answers the task, the *listener* (policy ``b``) answers the speaker. The
team's reward, given to both roles, is the mean of the speaker's share of even ids and the
listener's share of odd ids (each from the ids the model sampled, ``Action.token_ids``): the two
policies must learn opposite things, so a mix-up of their samples (a policy trained on the other's
trajectories) shows as no learning. Each policy is trained by the plain loop
(``mtflow.train.loop.reference_loop`` with a model and an optimizer per policy id) on its own
samples only, GRPO over the copies of each (prompt, role).

The margin is stated before the run (``MARGIN``): for each policy, the mean of its own part of the
reward (the speaker's even share, the listener's odd share) over the last 10 steps must exceed its
mean over the first 10 by at least it. The control is the same seed with learning rate 0 for both,
run in the same process: its gains show what the noise alone gives. The exit status is 1 when a
policy misses the margin.

    nice -n 19 .venv/bin/python benchmarks/multi_policy_curve.py
    nice -n 19 .venv/bin/python benchmarks/multi_policy_curve.py --steps 60 --svg docs/multi_policy_curve.svg
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.learning_curve import curves_svg  # noqa: E402  (the same chart)

#: stated in advance: each policy's last-10 mean of its own part exceeds its first-10 mean by this
MARGIN = 0.15


def share(ids: Any, parity: int) -> float:
    ids = list(ids or [])
    return sum(1 for t in ids if t % 2 == parity) / max(1, len(ids))


class Relay:
    """The speaker answers the task, the listener answers the speaker; then the team is scored.
    ``parts`` collects each episode's (speaker even share, listener odd share)."""
    roles = ('speaker', 'listener')

    def __init__(self, parts: List[Tuple[float, float]]) -> None:
        self.parts = parts
        self.turn = 'speaker'
        self.speaker_ids: Any = None

    def reset(self, episode: Any) -> Dict[str, str]:
        return {'speaker': episode.task_text}

    def acting(self) -> List[str]:
        return [self.turn] if self.turn else []

    def step(self, actions: Dict[str, Any]) -> Dict[str, Any]:
        if self.turn == 'speaker':
            self.speaker_ids = actions['speaker'].token_ids
            self.turn = 'listener'
            return {'observations': {'listener': str(actions['speaker'])}}
        even, odd = share(self.speaker_ids, 0), share(actions['listener'].token_ids, 1)
        self.parts.append((even, odd))
        self.turn = None
        team = (even + odd) / 2
        return {'done': True, 'rewards': {'speaker': team, 'listener': team}, 'info': {'even': even, 'odd': odd}}


def run(seed: int, steps: int, groups: int, size: int, max_tokens: int, lr: float) -> List[Tuple[float, float]]:
    """Per step: the mean speaker even share and listener odd share."""
    import torch

    from mtflow import Executor, RequestConfig, RolloutInferRequest
    from mtflow.backends.hf import HFBackend
    from mtflow.roles import EpisodeScheduler, PolicyRouter, Role, episode_requests
    from mtflow.train.loop import reference_loop
    from tests.tiny_model import make_model, make_tokenizer

    torch.set_num_threads(1)
    tok = make_tokenizer()
    models = {'a': make_model(tok, seed=seed), 'b': make_model(tok, seed=seed + 100)}
    backends = {pid: HFBackend(m, tok, default_max_tokens=max_tokens, seed=seed) for pid, m in models.items()}
    roles = [Role('speaker', policy='a'), Role('listener', policy='b')]
    parts: List[Tuple[float, float]] = []
    scheduler = EpisodeScheduler(lambda info: Relay(parts), roles, policies=list(backends))
    executor = Executor(scheduler, PolicyRouter(backends, roles),
                        RequestConfig(max_tokens=max_tokens, temperature=1.0, logprobs=True), max_turns=4)
    optimizers = {pid: torch.optim.Adam(m.parameters(), lr=lr) for pid, m in models.items()}

    def batch(step: int) -> List[Any]:
        tasks = [RolloutInferRequest(messages=[{'role': 'user', 'content': f'count to {g}'}], uuid=f's{step}p{g}')
                 for g in range(groups)]
        return episode_requests(tasks, roles, copies=size)

    per_step: List[Tuple[float, float]] = []

    def on_step(stats: Any) -> None:
        if stats.policy == 'b':  # both policies stepped: this step's episodes are all in
            done = parts[:]
            parts.clear()
            per_step.append((sum(e for e, _ in done) / len(done), sum(o for _, o in done) / len(done)))

    reference_loop(executor, models, optimizers, (batch(s) for s in range(steps)), row_len=512, tis_cap=2.0,
                   on_step=on_step)
    return per_step


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    parser.add_argument('--steps', type=int, default=60)
    parser.add_argument('--groups', type=int, default=4, help='tasks per step')
    parser.add_argument('--size', type=int, default=4, help='episodes of each task (the GRPO group of each role)')
    parser.add_argument('--max-tokens', type=int, default=8)
    parser.add_argument('--lr', type=float, default=1e-2)
    parser.add_argument('--margin', type=float, default=MARGIN)
    parser.add_argument('--svg', type=Path, default=None)
    args = parser.parse_args(argv)
    if args.steps < 20:
        parser.error('--steps must be >= 20 (the first 10 and the last 10 steps are compared)')
    print(f'task: relay, {args.groups}x{args.size} episodes a step, {args.max_tokens} ids a turn, two policies '
          f'(a: speaker, even ids; b: listener, odd ids), GRPO per (prompt, role), Adam lr {args.lr}, '
          f'{args.steps} steps; margin stated in advance: +{args.margin} for each policy and seed')
    print(f"{'seed':>4}  {'policy':<18}  {'first 10':>8}  {'last 10':>8}  {'gain':>6}  {'margin met':>10}  "
          f"{'lr-0 gain':>9}  {'wall s':>6}")
    ok = True
    curves: Dict[str, List[float]] = {}
    for seed in args.seeds:
        t0 = time.perf_counter()
        trained = run(seed, args.steps, args.groups, args.size, args.max_tokens, args.lr)
        wall = time.perf_counter() - t0
        control = run(seed, args.steps, args.groups, args.size, args.max_tokens, 0.0)  # the same seed, lr 0
        for k, name in enumerate(('a (speaker, even)', 'b (listener, odd)')):
            curve, still = [p[k] for p in trained], [p[k] for p in control]
            first, last = sum(curve[:10]) / 10, sum(curve[-10:]) / 10
            gain, still_gain = last - first, sum(still[-10:]) / 10 - sum(still[:10]) / 10
            met = gain >= args.margin
            ok = ok and met
            if seed == args.seeds[0]:
                curves[name], curves[f'{name[0]}, lr 0'] = curve, still
            print(f'{seed:>4}  {name:<18}  {first:>8.3f}  {last:>8.3f}  {gain:>+6.3f}  {"yes" if met else "NO":>10}  '
                  f'{still_gain:>+9.3f}  {wall:>6.1f}', flush=True)
    if args.svg is not None:
        args.svg.parent.mkdir(parents=True, exist_ok=True)
        args.svg.write_text(curves_svg(curves, args.margin, label='{}', title='each policy\'s part of the team '
                                       'reward per step (two tiny Qwen2, GRPO per (prompt, role))'))
        print(f'curves (seed {args.seeds[0]}): {args.svg}')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
