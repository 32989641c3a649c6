"""Two-player episodes with long-tailed generation times: async against lockstep against the ideal,
in the same process (``docs/multi-agent.md``).

Each episode is a turn-based game of two roles (two requests) on the simulated continuous-batching
engine of ``benchmarks/longtail_sim.py`` (``--decode-ms`` per decode step, ``--slots`` sequences
at once): the players alternate for ``2 x turns`` moves (``turns``: 2-7 per episode), each move a
reply whose length is a lognormal body with one in ten 10-100x longer, each environment step a
small latency (the workload's tool latency). The same seed gives the same replies in both modes.

Printed, best of ``--repeats``:

* the wall time of lockstep (every episode's acting role generates together each turn: a turn
  waits for its longest reply), of async mode (each role on its own; a waiting role rests in
  ``tool_step`` without its slot), the ideal (the longest episode's own work: its moves' decode
  times and environment latencies, one after the other) and the engine's throughput bound;
* **one slow episode**: the same run again with one episode's replies made ``--slow-factor``
  times longer: the median completion time of the *other* episodes with it, over without it.
  1.0 means the slow episode delayed only itself;
* whether both modes gave identical trajectories (every role's output).

    nice -n 19 .venv/bin/python benchmarks/multi_agent_longtail.py
    nice -n 19 .venv/bin/python benchmarks/multi_agent_longtail.py --episodes 64 256 --repeats 3
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.longtail_sim import SimEngine, Workload  # noqa: E402
from mtflow import Executor, RolloutInferRequest  # noqa: E402
from mtflow.roles import EpisodeScheduler, EpisodeStep, Role, episode_requests  # noqa: E402

ROLES = [Role('player_0', seat=0), Role('player_1', seat=1)]


class SimGame:
    """Turn-based: the two seats alternate for ``2 x turns(episode)`` moves; an environment step
    takes the workload's tool latency; the last mover wins."""
    roles = (0, 1)

    def __init__(self, workload: Workload, latency: bool = True) -> None:
        self.workload, self.latency = workload, latency
        self.moves = self.made = 0
        self.current = 0
        self.episode = ''

    def reset(self, episode: Any) -> Dict[int, str]:
        self.episode = episode.id
        self.moves = 2 * self.workload.turns(episode.id)
        return {0: f'{episode.id}: you start'}

    def acting(self) -> List[int]:
        return [self.current] if self.made < self.moves else []

    async def step(self, actions: Dict[int, str]) -> EpisodeStep:
        [(seat, move)] = actions.items()
        if self.latency:
            await asyncio.sleep(self.workload.tool_s(self.episode, self.made + 1))
        self.made += 1
        self.current = 1 - seat
        if self.made >= self.moves:
            return EpisodeStep(done=True, rewards={seat: 1.0, 1 - seat: -1.0})
        return EpisodeStep({self.current: f'move {self.made}: {move}'})


class SlowEpisode:
    """The workload with every reply of one episode ``factor`` times longer (what the engine and
    the game read of a workload: turns, replies, latencies)."""

    def __init__(self, base: Workload, episode: str, factor: float) -> None:
        self.base, self.episode, self.factor = base, episode, factor

    def turns(self, uuid: str) -> int:
        return self.base.turns(uuid)

    def tool_s(self, uuid: str, turn: int) -> float:
        return self.base.tool_s(uuid, turn)

    def reply_tokens(self, uuid: str, turn: int) -> int:
        n = self.base.reply_tokens(uuid, turn)
        return int(n * self.factor) if uuid.split('/')[0] == self.episode else n


def episode_work_s(w: Workload, episode: str, decode_s: float) -> float:
    """An episode's own work: each move's decode time and each environment step's latency, in turn."""
    moves = 2 * w.turns(episode)
    made = {0: 0, 1: 0}
    total = 0.0
    for k in range(moves):
        seat = k % 2
        made[seat] += 1
        total += w.reply_tokens(f'{episode}/player_{seat}', made[seat]) * decode_s + w.tool_s(episode, k + 1)
    return total


def run_mode(mode: str, w: Workload, episodes: List[str], decode_s: float, slots: int,
             max_concurrency: Optional[int]) -> Dict[str, Any]:
    prompts = [RolloutInferRequest(messages=[{'role': 'user', 'content': 'play'}], uuid=e) for e in episodes]
    requests = episode_requests(prompts, ROLES)
    finished: Dict[str, float] = {}
    t0 = time.perf_counter()

    def on_finished(done: Any) -> None:
        episode = done.uuid.split('/')[0]
        finished[episode] = max(finished.get(episode, 0.0), time.perf_counter() - t0)

    kwargs = {'mode': 'async', 'max_concurrency': max_concurrency} if mode == 'async' else {}
    ex = Executor(EpisodeScheduler(lambda info: SimGame(w), ROLES), SimEngine(w, decode_s, slots), max_turns=20,
                  on_error='return', on_finished=on_finished, **kwargs)
    t0 = time.perf_counter()
    result = ex.run(requests)
    wall = time.perf_counter() - t0
    assert not result.failures, result.failures[:2]
    outputs = {r.uuid: o.model_dump(mode='python', exclude={'response': {'id', 'created'}})
               for r, o in zip(requests, result.outputs)}
    return {'wall': wall, 'finished': finished, 'outputs': outputs}


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--episodes', type=int, nargs='+', default=[64])
    parser.add_argument('--decode-ms', type=float, default=0.5)
    parser.add_argument('--slots', type=int, default=256)
    parser.add_argument('--max-concurrency', type=int, default=None, help='async: requests in flight (default: all)')
    parser.add_argument('--slow-factor', type=float, default=20.0)
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args(argv)
    w = Workload(seed=args.seed)
    decode_s = args.decode_ms / 1000
    print(f'two-player turn-based episodes on a simulated engine: {args.decode_ms} ms per decode step, {args.slots} '
          f'slots; 4-14 moves an episode, replies ~{w.reply_median:g} tokens (lognormal), one in ten '
          f'{w.tail_min:g}-{w.tail_max:g}x longer, environment steps ~{w.tool_median_s * 1000:g} ms; seed {args.seed}; '
          f'best of {args.repeats}')
    head = (f'{"episodes":>8} {"lockstep s":>10} {"async s":>8} {"ideal s":>8} {"thruput s":>9} {"lock/async":>10} '
            f'{"async/ideal":>11} {"others slowed: lock":>19} {"async":>6} {"same":>5}')
    print(head)
    print('-' * len(head))
    for n in args.episodes:
        episodes = [f'e{i:04d}' for i in range(n)]
        ideal = max(episode_work_s(w, e, decode_s) for e in episodes)
        tokens = sum(w.reply_tokens(f'{e}/player_{s}', k) for e in episodes for s in (0, 1)
                     for k in range(1, w.turns(e) + 1))
        slow = SlowEpisode(w, episodes[0], args.slow_factor)
        best: Dict[str, Dict[str, Any]] = {}
        for _ in range(args.repeats):
            for mode in ('lockstep', 'async'):
                for name, workload in ((mode, w), (f'{mode}+slow', slow)):
                    r = run_mode(mode, workload, episodes, decode_s, args.slots, args.max_concurrency)
                    if name not in best or r['wall'] < best[name]['wall']:
                        best[name] = r
        slowed = {}
        for mode in ('lockstep', 'async'):
            others = episodes[1:]
            with_slow = statistics.median(best[f'{mode}+slow']['finished'][e] for e in others)
            without = statistics.median(best[mode]['finished'][e] for e in others)
            slowed[mode] = with_slow / without
        same = best['lockstep']['outputs'] == best['async']['outputs']
        lock, asyn = best['lockstep']['wall'], best['async']['wall']
        print(f'{n:>8} {lock:>10.3f} {asyn:>8.3f} {ideal:>8.3f} {tokens * decode_s / args.slots:>9.3f} '
              f'{lock / asyn:>10.2f} {asyn / ideal:>11.2f} {slowed["lockstep"]:>19.2f} {slowed["async"]:>6.2f} '
              f'{"yes" if same else "NO":>5}', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
