"""Tool steps: the contract's sequential order against mtflow's concurrent steps.

N requests (default 64) each call a tool in each of T turns (default 3) and answer in turn T+1.
The tool waits ``--ms`` milliseconds (default 50) like an I/O-bound call (an HTTP API, a sandbox):
``asyncio.sleep`` for the async tool, ``time.sleep`` for the sync one (run in mtflow's thread
pool). The model is a scripted ``rollout_fn`` that costs nothing, so what is measured is how the
tool waits are scheduled.

- sequential: the loop written from the contract (``benchmarks/reference_loop.py``) calls each
  request's ``step`` in request order, one at a time (the same YAML scheduler, its step run to
  completion per request): N x T tool latencies.
- mtflow: ``mtflow.Executor`` gathers the async steps of all requests of a turn; each step runs
  its tool calls concurrently: about T tool latencies.

Outputs of the two are compared (messages, ids, masks, infos) and must be equal.

    .venv/bin/python benchmarks/tool_concurrency.py
    .venv/bin/python benchmarks/tool_concurrency.py --n 64 --turns 3 --ms 50
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.reference_loop import reference_run_multi_turn  # noqa: E402
from mtflow import Executor  # noqa: E402
from mtflow.declarative import load_scheduler  # noqa: E402
from mtflow.core.protocol import RolloutInferRequest, RolloutOutput, make_choice, make_response  # noqa: E402

DELAY_S = 0.05


async def wait_io(key: str) -> str:
    """Wait like an I/O-bound tool (async)."""
    await asyncio.sleep(DELAY_S)
    return f'result for {key}'


def wait_io_sync(key: str) -> str:
    """Wait like an I/O-bound tool (blocking)."""
    time.sleep(DELAY_S)
    return f'result for {key}'


def config(impl: str, threads: int) -> Dict[str, Any]:
    return {'name': 'tool_concurrency', 'parser': 'hermes', 'max_threads': threads,
            'tools': [{'name': 'wait', 'impl': f'{__name__}:{impl}', 'timeout_s': 10}]}


class Rollout:
    """Turns 1..T: one tool call; turn T+1: an answer without a call."""

    def __init__(self, turns: int) -> None:
        self.turns = turns
        self.count: Dict[str, int] = {}

    def __call__(self, requests: List[Any], request_config: Any) -> List[RolloutOutput]:
        outs = []
        for r in requests:
            k = self.count.get(r.uuid, 0) + 1
            self.count[r.uuid] = k
            text = (f'<tool_call>{{"name": "wait", "arguments": {{"key": "{r.uuid}-{k}"}}}}</tool_call>'
                    if k <= self.turns else 'done')
            outs.append(RolloutOutput(response=make_response(make_choice(text, [k, k + 1], [-0.5, -0.25]))))
        return outs


class Sequential:
    """The YAML scheduler with its async step run to completion per request, in request order
    (what a synchronous driver does with a sync step)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.loop = asyncio.new_event_loop()

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        result = self.loop.run_until_complete(self.inner.step(infer_request, response_choice, current_turn))
        result.pop('trace_info', None)
        return result

    async def on_turn_end(self, *args: Any) -> Dict[str, Any]:
        return await self.inner.on_turn_end(*args)

    def check_finished(self, *args: Any) -> bool:
        return False


def requests(n: int) -> List[RolloutInferRequest]:
    return [RolloutInferRequest(messages=[{'role': 'user', 'content': f'task {i}'}], uuid=f'r{i}') for i in range(n)]


def run_sequential(n: int, turns: int, impl: str) -> tuple:
    reqs, rollout = requests(n), Rollout(turns)
    first = rollout(reqs, None)
    sched = Sequential(load_scheduler(config(impl, 64)))
    t = time.perf_counter()
    outs = reference_run_multi_turn(reqs, first, sched, rollout, None)
    return time.perf_counter() - t, outs


def run_mtflow(n: int, turns: int, impl: str, threads: int) -> tuple:
    reqs, rollout = requests(n), Rollout(turns)
    first = rollout(reqs, None)
    sched = load_scheduler(config(impl, threads))
    t = time.perf_counter()
    res = Executor(sched, rollout, trace=False).run(reqs, first)
    elapsed = time.perf_counter() - t
    sched.close()
    return elapsed, res.outputs


def comparable(outs: List[Any]) -> List[tuple]:
    return [(o.messages, o.response_token_ids, o.response_loss_mask, o.rollout_logprobs, o.rollout_infos)
            for o in outs]


def main() -> None:
    global DELAY_S
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--n', type=int, default=64, help='requests')
    ap.add_argument('--turns', type=int, default=3, help='tool turns per request')
    ap.add_argument('--ms', type=float, default=50, help='tool latency in milliseconds')
    ap.add_argument('--threads', type=int, default=64, help="mtflow's thread pool for the sync tool")
    args = ap.parse_args()
    DELAY_S = args.ms / 1000
    calls = args.n * args.turns

    seq_t, seq_out = run_sequential(args.n, args.turns, 'wait_io')
    rows = [('sequential (contract order), async tool', seq_t, None)]
    for label, impl in (('mtflow, async tool (asyncio)', 'wait_io'),
                        (f'mtflow, sync tool ({args.threads} threads)', 'wait_io_sync')):
        elapsed, outs = run_mtflow(args.n, args.turns, impl, args.threads)
        same = comparable(outs) == comparable(seq_out)
        rows.append((label, elapsed, same))

    print(f'{args.n} requests x {args.turns} tool turns = {calls} tool calls of {args.ms:g} ms '
          f'(ideal: sequential {calls * DELAY_S:.2f} s, concurrent {args.turns * DELAY_S:.2f} s)\n')
    print(f'| {"driver":<45} | {"wall s":>7} | {"per tool turn ms":>16} | {"speedup":>7} | {"same outputs":>12} |')
    print(f'|{"-" * 47}|{"-" * 9}|{"-" * 18}|{"-" * 9}|{"-" * 14}|')
    for label, elapsed, same in rows:
        flag = '-' if same is None else ('yes' if same else 'NO')
        print(f'| {label:<45} | {elapsed:7.3f} | {1000 * elapsed / args.turns:16.1f} | '
              f'{seq_t / elapsed:6.1f}x | {flag:>12} |')
    if any(same is False for _, _, same in rows):
        sys.exit('outputs differ between the sequential loop and mtflow')


if __name__ == '__main__':
    main()
