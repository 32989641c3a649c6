"""The executor's own cost per request-turn, against a plain loop written from the contract.

N requests x T turns with a trivial scheduler (a step that appends one observation) and a
``rollout_fn`` that returns prebuilt outputs, so what is measured is the driver itself: state
moves, hooks dispatch, segment accounting, traces, output building. The reference loop and mtflow
run in the same process, interleaved (A B A B ...), and the best of the repeats is reported.

    .venv/bin/python benchmarks/overhead.py                 # N = 1000, 4000, 16000; T = 8
    .venv/bin/python benchmarks/overhead.py --n 4000 --turns 8 --repeats 5
    .venv/bin/python benchmarks/overhead.py --no-trace      # mtflow with tracing off
    .venv/bin/python benchmarks/overhead.py --shape realistic --n 4000   # the issue-9 target shape
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time
from typing import Any, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mtflow  # noqa: E402
from benchmarks.reference_loop import reference_run_multi_turn  # noqa: E402
from mtflow.core.protocol import RolloutInferRequest, RolloutOutput, make_choice, make_response  # noqa: E402


class Trivial(mtflow.Scheduler):
    """Appends one observation per step; stops by max_turns."""

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'ok'})
        return {'infer_request': infer_request}


class Realistic(mtflow.Scheduler):
    """The shape real schedulers have: an ``async on_turn_end`` that inspects the output and
    returns infos (it completes without awaiting anything, like most), and a ``step`` that
    appends an observation and returns ids (the model's plus the observation's), a mask,
    logprobs and infos."""
    OBS_IDS = [1, 2, 3]

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        return {'rollout_infos': {'last_len': len(response_choice.message.content)}}

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'observation'})
        ids = response_choice.token_ids
        return {
            'infer_request': infer_request,
            'response_token_ids': ids + self.OBS_IDS,
            'response_loss_mask': [1] * len(ids) + [0] * len(self.OBS_IDS),
            'rollout_logprobs': [item['logprob'] for item in response_choice.logprobs['content']],
            'rollout_infos': {'tool_calls': current_turn},
        }


SHAPES = {'trivial': Trivial, 'realistic': Realistic}


def prebuilt(n_tokens: int = 8) -> RolloutOutput:
    ids = list(range(n_tokens))
    return RolloutOutput(response=make_response(make_choice('x' * n_tokens, ids, [-0.5] * n_tokens)))


def make_inputs(n: int) -> tuple:
    requests = [RolloutInferRequest(messages=[{'role': 'user', 'content': 'q'}], uuid=f'r{i}') for i in range(n)]
    output = prebuilt()
    return requests, [output] * n, output


CLOCKS = {'wall': time.perf_counter, 'cpu': time.process_time}
_clock = time.perf_counter


def time_one(driver: str, n: int, turns: int, trace: bool, shape: str = 'trivial') -> float:
    requests, firsts, output = make_inputs(n)

    def rollout_fn(reqs: List[Any], config: Any) -> List[Any]:
        return [output] * len(reqs)

    sched = SHAPES[shape]()
    gc.collect()
    gc.disable()
    try:
        t = _clock()
        if driver == 'reference':
            reference_run_multi_turn(requests, firsts, sched, rollout_fn, None, max_turns=turns)
        elif driver == 'floor':
            reference_run_multi_turn(requests, firsts, sched, rollout_fn, None, max_turns=turns, drive='direct')
        elif driver == 'hooks':
            hooks_only(sched, requests, output, turns)
        else:
            mtflow.Executor(sched, rollout_fn, max_turns=turns, trace=trace).run(requests, firsts)
        return _clock() - t
    finally:
        gc.enable()


def hooks_only(sched: Any, requests: List[Any], output: Any, turns: int) -> None:
    """Only the scheduler's own hooks, called as a driver must call them (``on_turn_end`` driven
    directly, then ``step``), every request for every turn: no driver can cost less than this."""
    choice = output.response.choices[0]
    is_async = asyncio.iscoroutinefunction(sched.on_turn_end)
    for turn in range(1, turns + 1):
        for r in requests:
            value = sched.on_turn_end(r, choice, turn)
            if is_async:
                try:
                    value.send(None)
                except StopIteration:
                    pass
            if turn < turns:
                sched.step(r, choice, turn)


def peak_memory(driver: str, n: int, turns: int, trace: bool) -> float:
    """Peak traced memory (bytes) of one run, inputs excluded."""
    import tracemalloc

    requests, firsts, output = make_inputs(n)

    def rollout_fn(reqs: List[Any], config: Any) -> List[Any]:
        return [output] * len(reqs)

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        if driver == 'reference':
            reference_run_multi_turn(requests, firsts, Trivial(), rollout_fn, None, max_turns=turns)
        else:
            mtflow.Executor(Trivial(), rollout_fn, max_turns=turns, trace=trace).run(requests, firsts)
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


DRIVERS = ('hooks', 'floor', 'reference', 'mtflow')


def measure(n: int, turns: int, repeats: int, trace: bool, shape: str = 'trivial') -> Dict[str, float]:
    best = {driver: float('inf') for driver in DRIVERS}
    for _ in range(repeats):
        for driver in DRIVERS:
            best[driver] = min(best[driver], time_one(driver, n, turns, trace, shape))
    return best


def main(argv: List[str] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--n', type=int, nargs='*', default=[1000, 4000, 16000])
    p.add_argument('--turns', type=int, default=8)
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--no-trace', action='store_true')
    p.add_argument('--clock', choices=sorted(CLOCKS), default='wall',
                   help='cpu: process CPU time (steadier than wall time on a machine shared with other work)')
    p.add_argument('--shape', choices=sorted(SHAPES), default='trivial',
                   help='trivial: a bare step; realistic: async on_turn_end, step with ids/mask/logprobs/infos')
    p.add_argument('--memory', action='store_true', help='also report peak memory per request (tracemalloc)')
    args = p.parse_args(argv)
    global _clock
    _clock = CLOCKS[args.clock]
    trace = not args.no_trace
    print(f'# driver overhead, {args.shape} scheduler, T={args.turns} turns, best of {args.repeats}, '
          f'mtflow tracing {"on" if trace else "off"}, {args.clock} clock')
    print('# us per request-turn. hooks: the scheduler\'s own hooks alone; floor: the reference loop with')
    print('# on_turn_end driven directly (no event loop), outputs not validated, no checks, no trace; ratio: mtflow / reference')
    print(f'| {"N":>6} | {"hooks":>6} | {"floor":>6} | {"reference":>9} | {"mtflow":>7} | {"ratio":>6} | {"floor ratio":>11} |')
    print(f'|{"-" * 8}|{"-" * 8}|{"-" * 8}|{"-" * 11}|{"-" * 9}|{"-" * 8}|{"-" * 13}|')
    for n in args.n:
        best = measure(n, args.turns, args.repeats, trace, args.shape)
        per = {k: v / (n * args.turns) * 1e6 for k, v in best.items()}
        print(f'| {n:>6} | {per["hooks"]:>6.2f} | {per["floor"]:>6.2f} | {per["reference"]:>9.2f} | {per["mtflow"]:>7.2f} '
              f'| {per["mtflow"] / per["reference"]:>6.3f} | {per["floor"] / per["reference"]:>11.3f} |', flush=True)
    if args.memory:
        print(f'\n# peak memory per request (KiB), T={args.turns}, tracemalloc')
        print(f'| {"N":>6} | {"reference":>10} | {"mtflow":>10} |')
        print(f'|{"-" * 8}|{"-" * 12}|{"-" * 12}|')
        for n in args.n:
            ref, mt = (peak_memory(d, n, args.turns, trace) / n / 1024 for d in ('reference', 'mtflow'))
            print(f'| {n:>6} | {ref:>10.2f} | {mt:>10.2f} |', flush=True)


if __name__ == '__main__':
    main()
