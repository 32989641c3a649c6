"""Environment step latency and throughput per bridge: mtflow's environment object against the
environment's own client doing the same work, in one run.

For each bridge, ``--n`` episodes (default 64) run concurrently, each a reset, ``--steps`` steps
and a close, with the same actions on both sides:

- ``skyrl-gym``: GSM8K multi-turn; own = ``skyrl_gym.make`` + ``init`` + ``step`` (in-process, sync).
- ``gem``: GEM's GuessTheNumber; own = ``gem.make`` + ``reset`` + ``step`` (in GEM's venv: this script
  runs itself there, ``.extras/gem-venv``).
- ``openenv``: the tests' OpenEnv server (``tests/envs/openenv_app.py``, uvicorn on 127.0.0.1); own =
  openenv's ``GenericEnvClient`` per episode (``reset``/``step`` over a WebSocket).
- ``nemo-gym``: NeMo Gym's stateful counter server (launched in ``.extras/nemo-gym-venv``); own = an
  aiohttp session per episode doing what NeMo Gym's simple agent does (``seed_session``, a tool
  ``POST`` per step, ``verify``).

Both sides of a bridge run on the same event loop at the same concurrency (``asyncio.gather``),
in alternating rounds (``--rounds``, best of each side taken). Printed: calls per second (a reset, a
step, a verify are calls), the ratio mtflow/own, and the step latency p50/p95 of each side.

    .venv/bin/python benchmarks/env_bridges.py
    .venv/bin/python benchmarks/env_bridges.py --only skyrl-gym,openenv --n 64 --steps 4
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mtflow.core.protocol import RolloutInferRequest  # noqa: E402

BRIDGES = ('skyrl-gym', 'gem', 'openenv', 'nemo-gym')


async def _maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class Timer:
    """Calls and per-step latencies of one side of one round."""

    def __init__(self) -> None:
        self.calls = 0
        self.steps: List[float] = []

    async def step(self, call: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = await _maybe(call())
        self.steps.append(time.perf_counter() - t0)
        self.calls += 1
        return out

    async def call(self, call: Callable[[], Any]) -> Any:
        out = await _maybe(call())
        self.calls += 1
        return out


async def _round(episode: Callable[[int, Timer], Awaitable[None]], n: int) -> Tuple[float, Timer]:
    timer = Timer()
    t0 = time.perf_counter()
    await asyncio.gather(*(episode(i, timer) for i in range(n)))
    return time.perf_counter() - t0, timer


def _request(i: int, data: Optional[Dict[str, Any]] = None, **kw: Any) -> RolloutInferRequest:
    return RolloutInferRequest(messages=[{'role': 'user', 'content': f'task {i}'}], data_dict=data or {},
                               uuid=f'r{i}', **kw)


# ---- the bridges: (mtflow episode, own episode, setup, teardown) ---------------------------------------
def skyrl_gym_sides(steps: int) -> Tuple[Any, Any, Callable[[], None]]:
    import skyrl_gym

    from mtflow.declarative.envs import SkyRLGymConfig
    from mtflow.declarative.envs.skyrl_gym_env import skyrl_gym_factory
    make = skyrl_gym_factory(SkyRLGymConfig(id='gsm8k_multi_turn'))
    extras = {'reward_spec': {'ground_truth': '42'}, 'extra_info': {}, 'max_turns': steps + 1}

    async def mtflow_episode(i: int, t: Timer) -> None:
        env, req = make(), _request(i, extras)
        await t.call(lambda: env.reset(req))
        for k in range(steps):
            await t.step(lambda: env.step(f'#### {k}'))
        env.close()

    async def own_episode(i: int, t: Timer) -> None:
        env = skyrl_gym.make('gsm8k_multi_turn', env_config={}, extras=extras)
        await t.call(lambda: env.init([{'role': 'user', 'content': f'task {i}'}]))
        for k in range(steps):
            await t.step(lambda: env.step(f'#### {k}'))
        env.close()
    return mtflow_episode, own_episode, lambda: None


def gem_sides(steps: int) -> Tuple[Any, Any, Callable[[], None]]:
    import gem

    from mtflow.declarative.envs import GemConfig
    from mtflow.declarative.envs.gem_env import gem_factory
    kwargs = {'max_turns': steps + 1}
    make = gem_factory(GemConfig(id='game:GuessTheNumber-v0-hard', kwargs=kwargs))

    async def mtflow_episode(i: int, t: Timer) -> None:
        env, req = make(), _request(i, {'seed': i})
        await t.call(lambda: env.reset(req))
        for k in range(steps):
            await t.step(lambda: env.step(f'\\boxed{{{k + 60}}}'))  # out of range: never ends the game
        env.close()

    async def own_episode(i: int, t: Timer) -> None:
        env = gem.make('game:GuessTheNumber-v0-hard', **kwargs)
        await t.call(lambda: env.reset(seed=i))
        for k in range(steps):
            await t.step(lambda: env.step(f'\\boxed{{{k + 60}}}'))
    return mtflow_episode, own_episode, lambda: None


def openenv_sides(steps: int) -> Tuple[Any, Any, Callable[[], None]]:
    from openenv.core import GenericEnvClient

    from mtflow.declarative.envs import OpenEnvConfig
    from mtflow.declarative.envs.openenv_env import OpenEnvPool
    os.environ['OPENENV_TEST_MAX_SESSIONS'] = '256'  # the server's capacity: every episode of both sides
    pool = OpenEnvPool(OpenEnvConfig(launch='tests.envs.openenv_app:app', action_field='message',
                                     message_timeout_s=30), str(ROOT))
    pool.start()
    url = pool.servers[0].url

    async def mtflow_episode(i: int, t: Timer) -> None:
        env, req = pool(), _request(i, {'seed': 0})
        await t.call(lambda: env.reset(req))  # the digit is 1: each guess of 9 is wrong
        for k in range(steps):
            await t.step(lambda: env.step('9'))
        await env.close()

    async def own_episode(i: int, t: Timer) -> None:
        client = GenericEnvClient(base_url=url, message_timeout_s=30)
        await client.connect()
        await t.call(lambda: client.reset(seed=0, episode_id=f'own{i}'))
        for k in range(steps):
            await t.step(lambda: client.step({'message': '9'}))
        await client.close()
    return mtflow_episode, own_episode, pool.close


def nemo_gym_sides(steps: int) -> Tuple[Any, Any, Callable[[], None]]:
    import aiohttp

    from mtflow.declarative.envs import NemoGymConfig
    from mtflow.declarative.envs.nemo_gym_env import NemoGymPool
    python = ROOT / '.extras' / 'nemo-gym-venv' / 'bin' / 'python'
    pool = NemoGymPool(NemoGymConfig(
        launch='resources_servers.example_session_state_mgmt.app:StatefulCounterResourcesServer', python=str(python)))
    pool.start()
    url = pool.server.url
    rcp = {'input': [{'role': 'user', 'content': 'count'}], 'tools': [
        {'type': 'function', 'name': 'increment_counter', 'strict': True,
         'parameters': {'type': 'object', 'properties': {'count': {'type': 'integer'}}, 'required': ['count']}}]}
    call = '<tool_call>{"name": "increment_counter", "arguments": {"count": 1}}</tool_call>'

    async def mtflow_episode(i: int, t: Timer) -> None:
        env = pool()
        req = _request(i, {'responses_create_params': rcp, 'initial_count': 0, 'expected_count': steps},
                       tools=[{'type': 'function', 'function': {'name': 'increment_counter'}}])
        await t.call(lambda: env.reset(req))
        for k in range(steps):
            await t.step(lambda: env.step(call))
        out = await t.call(lambda: env.step('Done.'))
        assert out.reward == 1.0, out
        await env.close()

    async def own_episode(i: int, t: Timer) -> None:
        row = {'responses_create_params': rcp, 'initial_count': 0, 'expected_count': steps}
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
            async def post(route: str, body: Any) -> Any:
                async with http.post(f'{url}/{route}', json=body) as resp:
                    return await resp.text()
            await t.call(lambda: post('seed_session', row))
            output = []
            for k in range(steps):
                text = await t.step(lambda: post('increment_counter', {'count': 1}))
                output += [{'type': 'function_call', 'name': 'increment_counter', 'arguments': '{"count": 1}',
                            'call_id': f'c{k}', 'id': f'fc{k}', 'status': 'completed'},
                           {'type': 'function_call_output', 'call_id': f'c{k}', 'output': text}]
            output.append({'type': 'message', 'role': 'assistant', 'id': 'm', 'status': 'completed',
                           'content': [{'type': 'output_text', 'text': 'Done.', 'annotations': []}]})
            response = {'id': 'r', 'created_at': 0, 'model': 'm', 'object': 'response', 'output': output,
                        'parallel_tool_calls': True, 'tool_choice': 'auto', 'tools': rcp['tools']}
            verified = json.loads(await t.call(lambda: post('verify', {**row, 'response': response})))
            assert verified['reward'] == 1.0, verified
    return mtflow_episode, own_episode, pool.close


SIDES = {'skyrl-gym': skyrl_gym_sides, 'gem': gem_sides, 'openenv': openenv_sides, 'nemo-gym': nemo_gym_sides}


def _pct(values: List[float], q: float) -> float:
    """The ``q``-th percentile, in milliseconds."""
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1e3 if len(values) > 1 else values[0] * 1e3


def measure(bridge: str, n: int, steps: int, rounds: int) -> Dict[str, Any]:
    mtflow_episode, own_episode, teardown = SIDES[bridge](steps)
    best: Dict[str, Tuple[float, Timer]] = {}
    try:
        for _ in range(rounds):
            for side, episode in (('own', own_episode), ('mtflow', mtflow_episode)):
                wall, timer = asyncio.run(_round(episode, n))
                rate = timer.calls / wall
                if side not in best or rate > best[side][1].calls / best[side][0]:
                    best[side] = (wall, timer)
    finally:
        teardown()
    row: Dict[str, Any] = {'bridge': bridge}
    for side, (wall, timer) in best.items():
        row[side] = {'calls_per_s': timer.calls / wall, 'p50_ms': _pct(timer.steps, 50),
                     'p95_ms': _pct(timer.steps, 95)}
    row['ratio'] = row['mtflow']['calls_per_s'] / row['own']['calls_per_s']
    return row


def _in_venv(bridge: str, venv: str, args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    python = ROOT / '.extras' / venv / 'bin' / 'python'
    if not python.is_file():
        return {'bridge': bridge, 'skipped': f'.extras/{venv} is not there (scripts/test.sh makes it)'}
    done = subprocess.run([str(python), __file__, '--only', bridge, '--n', str(args.n), '--steps', str(args.steps),
                           '--rounds', str(args.rounds), '--json'], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if done.returncode != 0:
        return {'bridge': bridge, 'skipped': f'failed in .extras/{venv}: {done.stderr.strip()[-300:]}'}
    return json.loads(done.stdout.strip().splitlines()[-1])[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--only', default=','.join(BRIDGES), help='comma-separated bridges')
    parser.add_argument('--n', type=int, default=64, help='concurrent episodes')
    parser.add_argument('--steps', type=int, default=4, help='steps per episode')
    parser.add_argument('--rounds', type=int, default=5, help='alternating rounds per side (best taken)')
    parser.add_argument('--json', action='store_true', help='print the rows as one JSON line')
    args = parser.parse_args()
    rows = []
    for bridge in args.only.split(','):
        if bridge == 'gem' and not args.json:
            rows.append(_in_venv(bridge, 'gem-venv', args))
            continue
        try:
            rows.append(measure(bridge, args.n, args.steps, args.rounds))
        except ImportError as exc:
            rows.append({'bridge': bridge, 'skipped': f'{exc}'})
    if args.json:
        print(json.dumps(rows))
        return
    print(f'{args.n} concurrent episodes x ({args.steps} steps + reset [+ verify]), best of {args.rounds} rounds; '
          f'load {os.getloadavg()[0]:.2f}')
    print(f'{"bridge":<10} {"own calls/s":>12} {"mtflow calls/s":>15} {"ratio":>6} {"own p50/p95 ms":>16} '
          f'{"mtflow p50/p95 ms":>18}')
    for row in rows:
        if 'skipped' in row:
            print(f'{row["bridge"]:<10} skipped: {row["skipped"]}')
            continue
        own, mt = row['own'], row['mtflow']
        print(f'{row["bridge"]:<10} {own["calls_per_s"]:>12.0f} {mt["calls_per_s"]:>15.0f} {row["ratio"]:>6.2f} '
              f'{own["p50_ms"]:>7.3f}/{own["p95_ms"]:<8.3f} {mt["p50_ms"]:>8.3f}/{mt["p95_ms"]:<8.3f}')


if __name__ == '__main__':
    main()
