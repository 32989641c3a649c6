"""The streaming producer against lockstep batches of groups, and its memory as the source grows.

**Throughput** (``--part throughput``): the long-tailed workload of ``benchmarks/longtail_sim.py``
(2-7 turns, replies and tool latencies lognormal with one in ten 10-100x longer) on the
simulated continuous-batching engine (``--slots`` sequences at once, ``--decode-ms`` per decode
step), ``--n`` requests in GRPO groups of ``--group``, three ways in the same process:

* ``stream``: ``Executor.stream`` over the groups, ``--concurrency`` requests in flight;
* ``batch-async``: what a synchronous trainer does: batches of ``--concurrency`` requests (whole
  groups), each ``Executor(mode='async').run`` to the end before the next starts;
* ``batch-lockstep``: the same batches on the lockstep driver (a turn at a time; slow, so only
  when named in ``--producers``).

The ideal is the larger of the engine's bound (total tokens x decode time / slots) and the
longest request's own work; ``of ideal`` is ideal / wall (1.0: the engine never idled while a
request was waiting). Outputs of the stream are checked equal, per request, to the batches'.

**Memory** (``--part memory``): ``--sizes`` requests (default 10k, 100k; add 1000000) in groups
of 8, 2 turns each, streamed with a trivial scheduler over a stateless async ``rollout_fn``
(``--model scripted``: the scripted backend, which keeps a call counter per request until the
stream tells it the request is final, ``ScriptedBackend.forget``),
each size in its own child process (peak RSS from ``wait4``) against
``Executor(mode='async').run`` over the whole list (the baseline: it holds every request and
output).

    .venv/bin/python benchmarks/streaming.py                                   # both parts
    .venv/bin/python benchmarks/streaming.py --part throughput --n 4096 --group 8
    .venv/bin/python benchmarks/streaming.py --part throughput --n 512 --producers stream batch-async batch-lockstep
    .venv/bin/python benchmarks/streaming.py --part memory --sizes 10000 100000 1000000
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.longtail_sim import LongTailScheduler, SimEngine, Workload  # noqa: E402
from mtflow import Executor  # noqa: E402


def _dump(output: Any) -> Any:
    return (output.response_token_ids, output.response_loss_mask, output.rollout_infos.get('num_turns'))


class Sampler:
    """Samples the simulated engine's running sequences every ``every_s`` from a thread, while
    ``waiting()`` says requests are still waiting to be admitted (the source is not exhausted):
    the share of the engine's slots busy then (1.0: it never idled while work was waiting)."""

    def __init__(self, engine: SimEngine, slots: int, every_s: float = 0.005) -> None:
        self.engine, self.slots, self.every_s = engine, slots, every_s
        self.samples: List[float] = []
        self.waiting = lambda: True
        self.t0 = time.perf_counter()
        self.waited_s = float('nan')  # when nothing was waiting any more
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            if not self.waiting():
                if self.waited_s != self.waited_s:
                    self.waited_s = time.perf_counter() - self.t0
                continue
            if True:
                running = sum(core.running for core in list(self.engine._cores.values()))
                self.samples.append(min(running, self.slots) / self.slots)

    def busy(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else float('nan')


def bench_throughput(args: argparse.Namespace) -> None:
    w = Workload(seed=args.seed)
    decode_s = args.decode_ms / 1000
    uuids = [f'r{i:04d}' for i in range(args.n)]
    bound = w.total_tokens(uuids) * decode_s / args.slots
    longest = max(w.own_work_s(u, decode_s) for u in uuids)
    ideal = max(bound, longest)
    print(f'{args.n} requests in groups of {args.group}; simulated engine: {args.slots} slots, {args.decode_ms} ms '
          f'per decode step; {args.concurrency} requests in flight (stream) / per batch; seed {args.seed}')
    print(f'ideal {ideal:.2f} s: the larger of the engine bound {bound:.2f} s (total tokens x decode time / slots) and '
          f'the longest request\'s own work {longest:.2f} s')
    head = (f'{"producer":>15} {"wall s":>8} {"ideal s":>8} {"of ideal":>8} {"busy overall":>12} '
            f'{"busy while waiting":>18} {"drain s":>7} {"same":>5}')
    print(head)
    print('-' * len(head))
    rows: Dict[str, Dict[str, Any]] = {}
    reference: Dict[str, Any] = {}
    for name in args.producers:
        engine = SimEngine(w, decode_s, args.slots)
        reqs = w.requests(args.n)
        groups = [reqs[i:i + args.group] for i in range(0, args.n, args.group)]
        sampler = Sampler(engine, args.slots)
        t = time.perf_counter()
        sampler.t0 = t
        sampler.thread.start()
        outs: Dict[str, Any] = {}
        if name == 'stream':
            ex = Executor(LongTailScheduler(w), engine)
            stream = ex.stream(iter(groups), max_concurrency=args.concurrency)
            sampler.waiting = lambda: not stream.driver.source_done
            for g in stream:
                outs.update(zip(g.uuids, map(_dump, g.outputs)))
        else:
            mode = 'async' if name == 'batch-async' else 'lockstep'
            per_batch = max(1, args.concurrency // args.group)
            last = [False]
            sampler.waiting = lambda: not last[0]
            for b in range(0, len(groups), per_batch):
                last[0] = b + per_batch >= len(groups)
                batch = [r for g in groups[b:b + per_batch] for r in g]
                kwargs = {'max_concurrency': args.concurrency} if mode == 'async' else {}
                result = Executor(LongTailScheduler(w), engine, mode=mode, trace=False, **kwargs).run(batch)
                outs.update((r.uuid, _dump(o)) for r, o in zip(batch, result.outputs))
        wall = time.perf_counter() - t
        sampler.stop.set()
        sampler.thread.join()
        if not reference:
            reference = outs
        same = outs == reference
        busy = w.total_tokens(uuids) * decode_s / args.slots / wall
        rows[name] = {'wall': wall}
        drain = wall - sampler.waited_s
        print(f'{name:>15} {wall:>8.2f} {ideal:>8.2f} {ideal / wall:>8.2f} {busy:>12.2f} {sampler.busy():>18.2f} '
              f'{drain:>7.1f} {"yes" if same else "NO":>5}', flush=True)
        if not same:
            raise SystemExit(f'{name}: outputs differ from the stream\'s')
    for name in rows:
        if name != 'stream' and 'stream' in rows:
            print(f'stream vs {name}: {rows[name]["wall"] / rows["stream"]["wall"]:.2f}x faster')
    print('of ideal: ideal / wall; busy overall: total tokens x decode time / slots / wall; busy while waiting: the '
          'share of slots decoding, sampled every 5 ms while requests were still waiting to be admitted; drain: from '
          'then (the last batch started, or the source ran dry) to the end')


# ---- memory -------------------------------------------------------------------------------------------
CHILD = r'''
import sys, time
from mtflow import Executor, RolloutInferRequest, Scheduler
from mtflow.backends.scripted import ScriptedBackend
from mtflow.core.protocol import RolloutOutput, make_choice, make_response

class TwoTurns(Scheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'again'})
        return {'infer_request': infer_request}

n, group, how, model = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if model == 'scripted':  # a call counter per uuid (replays by request and turn need it), forgotten at delivery
    backend = ScriptedBackend(outputs=[{'content': 'a reply of a few words', 'token_ids': [1, 2, 3, 4, 5]}], cycle=True)
else:  # stateless and async: only the producer's own memory is measured
    async def backend(requests, request_config):
        return [RolloutOutput(response=make_response(make_choice('a reply of a few words', token_ids=[1, 2, 3, 4, 5])))
                for _ in requests]
ex = Executor(TwoTurns(max_turns=2), backend, trace=how == 'stream', mode='async', max_concurrency=64)

def prompts():
    for i in range(0, n, group):
        yield [RolloutInferRequest(messages=[{'role': 'user', 'content': f'prompt {i}'}], uuid=f'p{i}#{k}')
               for k in range(group)]

t = time.perf_counter()
done = 0
if how == 'stream':
    for g in ex.stream(prompts(), max_concurrency=64):
        done += len(g.outputs)
else:
    result = ex.run([r for g in prompts() for r in g])
    done = len(result.outputs)
print(done, round(time.perf_counter() - t, 2))
'''


def _child(n: int, group: int, how: str, model: str) -> Dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, '-c', CHILD, str(n), str(group), how, model], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    out, err = proc.stdout.read(), proc.stderr.read()
    if status != 0:
        raise SystemExit(f'{how} {n}: child failed\n{err[-2000:]}')
    done, wall = out.split()
    assert int(done) == n, (done, n)
    return {'rss_mb': usage.ru_maxrss / 1024, 'wall': float(wall)}


def bench_memory(args: argparse.Namespace) -> None:
    print(f'peak RSS of one child process per size: groups of 8, 2 turns per request, {args.model} model, '
          f'64 in flight; baseline: Executor.run over the whole list')
    head = f'{"requests":>9} {"stream MB":>9} {"stream s":>8} {"us/req":>6} {"run MB":>7} {"run s":>6}'
    print(head)
    print('-' * len(head))
    for n in args.sizes:
        s = _child(n, 8, 'stream', args.model)
        r = _child(n, 8, 'run', args.model) if n <= args.baseline_max else None
        run_cols = f'{r["rss_mb"]:>7.0f} {r["wall"]:>6.1f}' if r else f'{"-":>7} {"-":>6}'
        print(f'{n:>9} {s["rss_mb"]:>9.0f} {s["wall"]:>8.1f} {s["wall"] / n * 1e6:>6.0f} {run_cols}', flush=True)
    print(f'run: skipped above {args.baseline_max} requests (--baseline-max)')


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--part', choices=('throughput', 'memory', 'both'), default='both')
    p.add_argument('--n', type=int, default=4096)
    p.add_argument('--group', type=int, default=8)
    p.add_argument('--slots', type=int, default=128)
    p.add_argument('--concurrency', type=int, default=256)
    p.add_argument('--decode-ms', type=float, default=2.0)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--producers', nargs='+', default=['stream', 'batch-async'],
                   choices=('stream', 'batch-async', 'batch-lockstep'),
                   help='batch-lockstep is slow (minutes at 4096 requests): add it by name')
    p.add_argument('--sizes', type=int, nargs='+', default=[10000, 100000])
    p.add_argument('--baseline-max', type=int, default=100000)
    p.add_argument('--model', choices=('stateless', 'scripted'), default='stateless',
                   help='memory part: a stateless async rollout_fn, or the scripted backend (per-uuid counters, '
                        'forgotten at delivery)')
    args = p.parse_args()
    if args.part in ('throughput', 'both'):
        bench_throughput(args)
    if args.part in ('memory', 'both'):
        bench_memory(args)


if __name__ == '__main__':
    main()
