"""Lockstep turns whose ``max_tokens`` were cut to different values (``docs/context.md``).

With a total response budget, each request's ``max_tokens`` shrinks to what it has left, so in
one lockstep turn the requests may need several distinct ``max_tokens``: one ``rollout_fn`` call
per distinct value. Those calls used to run one after the other; with an async ``rollout_fn``
they now run at once (``ContextRun.call``). The model is a scripted backend behind a fixed
latency (``--ms``, like a server round trip): ``time.sleep`` in a sync ``rollout_fn`` (the calls
stay serial: a sync backend such as HF is not safe to call from several threads) against
``asyncio.sleep`` in an async one (concurrent). Outputs of the two are compared and must be
equal; the number of calls is the same.

    .venv/bin/python benchmarks/context_cuts.py
    .venv/bin/python benchmarks/context_cuts.py --n 8 --ms 50
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtflow import ContextBudget, Executor, RequestConfig, RolloutInferRequest, Scheduler  # noqa: E402
from mtflow.backends.scripted import ScriptedBackend  # noqa: E402


class Observe(Scheduler):
    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> dict:
        infer_request.messages.append({'role': 'tool', 'content': 'ok'})
        return {'infer_request': infer_request}


def script(n: int) -> List[dict]:
    """Request ``r<k>`` replies with ``20 + 3k`` tokens each turn: after two turns each has a
    different share of the 100-token total budget left, so turn 3 needs ``n`` distinct cuts."""
    return [{'uuid': f'r{k}', 'content': ' '.join(['w'] * (20 + 3 * k)), 'token_ids': list(range(20 + 3 * k))}
            for k in range(n) for _ in range(8)]


def requests(n: int) -> List[RolloutInferRequest]:
    return [RolloutInferRequest(uuid=f'r{k}', messages=[{'role': 'user', 'content': f'task {k}'}]) for k in range(n)]


def run(kind: str, n: int, delay_s: float) -> tuple:
    backend = ScriptedBackend(outputs=script(n), honor_max_tokens=True)

    def sync_fn(reqs, config):
        time.sleep(delay_s)
        return backend(reqs, config)

    async def async_fn(reqs, config):
        await asyncio.sleep(delay_s)
        return backend(reqs, config)

    ex = Executor(Observe(max_turns=6), sync_fn if kind == 'sync' else async_fn, RequestConfig(max_tokens=40),
                  context=ContextBudget(total_response_tokens=100))
    t0 = time.perf_counter()
    result = ex.run(requests(n))
    wall = time.perf_counter() - t0
    outputs = [(o.messages, o.response_token_ids, o.rollout_infos.get('num_turns')) for o in result.outputs]
    return wall, result.rollout_fn_calls, outputs, result.finish_reasons


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--n', type=int, default=8)
    ap.add_argument('--ms', type=float, default=50.0)
    args = ap.parse_args()
    rows = {kind: run(kind, args.n, args.ms / 1000) for kind in ('sync', 'async')}
    assert rows['sync'][2] == rows['async'][2] and rows['sync'][3] == rows['async'][3], 'outputs differ'
    print(f'{args.n} requests, {args.ms:g} ms a call, total response budget 100, max_tokens 40')
    print('| rollout_fn | calls | wall | outputs |')
    print('|---|---:|---:|---|')
    for kind, (wall, calls, _, _) in rows.items():
        label = 'sync (calls one after the other)' if kind == 'sync' else 'async (the calls of a turn at once)'
        print(f'| {label} | {calls} | {wall:.3f} s | {"equal" if kind == "async" else "baseline"} |')


if __name__ == '__main__':
    main()
