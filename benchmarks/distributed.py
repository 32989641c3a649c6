"""What distribution costs: one ``gather_fn`` per turn over gloo, and the Ray fan-out against one
process.

1. **gloo gather** (2 spawned processes on 127.0.0.1): the time of one ``torch_gather([flag])``
   call (what the executor does once per turn) against a one-element ``all_reduce`` (the cheapest
   collective) and ``identity_gather``; then a whole executor run of N requests x T turns on each
   of 2 ranks against the same run on one process, the difference divided by the turns.
2. **Ray fan-out** (a local cluster, the scripted backend): requests/s of one process running
   the executor over the dataset (records built as the run store gets them) against
   ``ray_run`` with 1 and 2 actors, end to end (cluster and actor start included) and in steady
   state (from the first actor ready to the last record at the driver); the streaming overhead per trajectory is the
   1-actor steady-state time minus the single process's, per request.

    .venv/bin/python benchmarks/distributed.py                      # both parts, defaults
    .venv/bin/python benchmarks/distributed.py --part gloo --calls 2000
    .venv/bin/python benchmarks/distributed.py --part ray --n 2000
"""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mtflow  # noqa: E402
from mtflow.core.protocol import RolloutInferRequest, RolloutOutput, make_choice, make_response  # noqa: E402


# ---- shared pieces ------------------------------------------------------------------------------
def turns_of(k: int) -> int:
    return k % 4 + 1


class CountTurns(mtflow.Scheduler):

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': f'observation {current_turn}'})
        return {'infer_request': infer_request}

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= infer_request.data_dict['turns']


def make_scheduler(tokenizer: Any = None) -> CountTurns:
    return CountTurns()


def dataset(n: int, offset: int = 0) -> List[RolloutInferRequest]:
    return [RolloutInferRequest(messages=[{'role': 'user', 'content': f'q{k}'}], uuid=f'q{k}',
                                data_dict={'turns': turns_of(k)}) for k in range(offset, offset + n)]


def make_backend(n: int) -> Any:
    from mtflow.backends.scripted import ScriptedBackend

    return ScriptedBackend(outputs=[{'uuid': f'q{k}', 'turn': t, 'content': f'q{k} says {t}', 'token_ids': [k % 100, t],
                                     'logprobs': [-.1, -.2]} for k in range(n) for t in range(1, turns_of(k) + 1)])


def fixed_output() -> RolloutOutput:
    return RolloutOutput(response=make_response(make_choice('x' * 8, list(range(8)), [-0.5] * 8)))


# ---- part 1: gloo --------------------------------------------------------------------------------
def _gloo_rank(rank: int, port: int, calls: int, n: int, turns: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from mtflow.distributed import torch_gather

    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    try:
        gather = torch_gather()
        figures: Dict[str, float] = {}
        for name, fn in (('torch_gather', lambda: gather([True])),
                         ('all_reduce (1 int)', lambda: dist.all_reduce(torch.ones(1, dtype=torch.int32))),
                         ('identity_gather', lambda: mtflow.identity_gather([True]))):
            for _ in range(min(100, calls)):  # warm up
                fn()
            dist.barrier()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            figures[name] = (time.perf_counter() - t) / calls
        output = fixed_output()

        class Trivial(mtflow.Scheduler):

            def step(self, infer_request, response_choice, current_turn):
                infer_request.messages.append({'role': 'user', 'content': 'ok'})
                return {'infer_request': infer_request}

        def rollout(requests, config):
            return [output] * len(requests)

        def run(gather_fn):
            reqs = [RolloutInferRequest(messages=[{'role': 'user', 'content': 'q'}], uuid=f'r{i}') for i in range(n)]
            t = time.perf_counter()
            mtflow.Executor(Trivial(), rollout, max_turns=turns, gather_fn=gather_fn, trace=False).run(reqs)
            return time.perf_counter() - t

        best_single = best_dist = float('inf')
        for _ in range(3):
            dist.barrier()
            best_dist = min(best_dist, run(gather))
            best_single = min(best_single, run(mtflow.identity_gather))
        figures['run_single_s'], figures['run_2ranks_s'] = best_single, best_dist
        with open(os.path.join(out, f'rank{rank}.json'), 'w') as f:
            json.dump(figures, f)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def bench_gloo(calls: int, n: int, turns: int) -> None:
    out = tempfile.mkdtemp(prefix='mtflow-bench-gloo-')
    ctx = multiprocessing.get_context('spawn')
    port = free_port()
    os.environ.setdefault('OMP_NUM_THREADS', '1')
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, calls, n, turns, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
        if p.is_alive():
            p.kill()
            raise SystemExit('gloo benchmark: a rank hung')
    if any(p.exitcode for p in procs):
        raise SystemExit(f'gloo benchmark failed: exit codes {[p.exitcode for p in procs]}')
    figs = [json.load(open(os.path.join(out, f'rank{r}.json'))) for r in range(2)]
    print(f'\n### gloo, 2 processes ({calls} calls each; the slower rank)')
    print('| call | per call |')
    print('|---|---|')
    for name in ('torch_gather', 'all_reduce (1 int)', 'identity_gather'):
        print(f'| `{name}` | {max(f[name] for f in figs) * 1e6:.1f} µs |')
    single = max(f['run_single_s'] for f in figs)
    both = max(f['run_2ranks_s'] for f in figs)
    loops = turns + 1  # the executor gathers once per turn, plus the final all-done check
    print(f'\nexecutor, {n} requests x {turns} turns per rank: one process {single * 1e3:.1f} ms, '
          f'2 gloo ranks {both * 1e3:.1f} ms: {(both - single) / loops * 1e6:.0f} µs per turn '
          f'({(both - single) / (n * turns) * 1e6:.2f} µs per request-turn)')


# ---- part 2: Ray -----------------------------------------------------------------------------------
def bench_ray(n: int, batch_size: int) -> None:
    import ray

    from mtflow.distributed import WorkerSpec, ray_run
    from mtflow.run.trajectories import finished_to_record

    rows = []

    def local() -> Dict[str, float]:
        records = []
        ex = mtflow.Executor(CountTurns(), make_backend(n), max_turns=10, on_error='return',
                             on_finished=lambda f: records.append(finished_to_record(f)))
        reqs = dataset(n)
        t = time.perf_counter()
        for start in range(0, n, batch_size):
            ex.run(reqs[start:start + batch_size])
        wall = time.perf_counter() - t
        assert len(records) == n
        return {'wall': wall, 'steady': wall}

    first_local = local()  # measured again after the Ray runs; the better one is reported
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address='127.0.0.1', object_store_memory=200 * 1024**2,
             runtime_env={'env_vars': {'PYTHONPATH': os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}},
             logging_level='warning')
    try:
        for actors in (1, 2):
            stamps: List[float] = []
            ready: List[float] = []
            spec = WorkerSpec(make_backend=functools.partial(make_backend, n), make_scheduler=make_scheduler,
                              max_turns=10)

            def on_progress(delivered: int, description: str) -> None:
                if description.endswith(' ready'):
                    ready.append(time.perf_counter())

            t = time.perf_counter()
            result = ray_run(dataset(n), spec, num_actors=actors, batch_size=batch_size,
                             sink=lambda rec: stamps.append(time.perf_counter()), on_progress=on_progress)
            wall = time.perf_counter() - t
            assert result.delivered == n
            # steady state: from the moment the first actor is ready (work starts) to the last record
            rows.append((f'ray_run, {actors} actor(s)', {'wall': wall, 'steady': stamps[-1] - ready[0]}))
    finally:
        ray.shutdown()
    again = local()
    rows.insert(0, ('one process (executor + records)', min(first_local, again, key=lambda r: r['wall'])))
    print(f'\n### Ray fan-out, scripted backend, {n} requests (1-4 turns), shards of {batch_size}')
    print('| run | wall (incl. start) | requests/s | steady state | requests/s steady |')
    print('|---|---|---|---|---|')
    for name, r in rows:
        print(f"| {name} | {r['wall']:.2f} s | {n / r['wall']:.0f} | {r['steady']:.2f} s | {n / r['steady']:.0f} |")
    one = dict(rows)['ray_run, 1 actor(s)']
    base = rows[0][1]['steady']
    print(f"\nstreaming overhead per trajectory (1 actor steady state - one process) / requests: "
          f"{(one['steady'] - base) / n * 1e3:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--part', choices=('gloo', 'ray', 'both'), default='both')
    ap.add_argument('--calls', type=int, default=2000, help='gather calls timed per rank')
    ap.add_argument('--requests', type=int, default=256, help='gloo part: requests per rank in the executor run')
    ap.add_argument('--turns', type=int, default=8, help='gloo part: turns of the executor run')
    ap.add_argument('--n', type=int, default=2000, help='Ray part: requests')
    ap.add_argument('--batch-size', type=int, default=64, help='Ray part: requests per shard')
    args = ap.parse_args()
    if args.part in ('gloo', 'both'):
        bench_gloo(args.calls, args.requests, args.turns)
    if args.part in ('ray', 'both'):
        bench_ray(args.n, args.batch_size)


if __name__ == '__main__':
    main()
