#!/usr/bin/env python
"""10k concurrent multi-turn requests against simulated engine replicas: does the client keep the
servers busy, does it hang, what does it cost per request; httpx against aiohttp.

The replicas run in a subprocess (their CPU is not the client's): aiohttp web servers on
127.0.0.1 that behave like a continuous-batching engine with a prefix cache: at most
``--max-num-seqs`` requests generate at once per replica (the others wait in the server's
queue, as vLLM's), each taking ``ttft + uncached prompt tokens * prefill + max_tokens * decode``
seconds, where the prompt tokens a replica served for the same conversation on its last turn
are cached (and reported as ``usage.prompt_tokens_details.cached_tokens``). The simulated
capacity is ``replicas * max_num_seqs / mean service time`` requests per second.

The client is what ``mtflow run --mode async`` runs: ``Executor(mode='async')`` over the
``openai`` backend with ``urls`` = the replicas, every request in flight at once
(``max_concurrency`` = requests), each for ``--turns`` turns. Rows: each HTTP client, with the
per-replica admission bound (``max_in_flight_per_replica`` = ``max_num_seqs``: the rest queue in
the client) and without it (every request has its own connection: 10k sockets). Figures:
model calls per second against the capacity (the ideal wall time is ``calls / capacity`` plus
one service time), client CPU per model call (``time.process_time`` of this process), the
prefix-cache hit rate, and whether every request finished (``--deadline`` s or it is a hang).

    .venv/bin/python benchmarks/serving.py                       # 10,000 requests x 3 turns, 4 replicas
    .venv/bin/python benchmarks/serving.py --requests 2000 --clients httpx
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# ---- the simulated replicas (in a subprocess) ------------------------------------------------------
def _serve(ports: List[int], args: Dict[str, Any], ready: Any) -> None:
    from aiohttp import web

    async def main() -> None:
        runners = []
        for port in ports:
            slots = asyncio.Semaphore(args['max_num_seqs'])
            cache: Dict[str, int] = {}

            async def models(request: Any) -> Any:
                return web.json_response({'object': 'list', 'data': [{'id': 'sim', 'object': 'model'}]})

            async def chat(request: Any, slots: Any = slots, cache: Dict[str, int] = cache) -> Any:
                body = await request.json()
                messages = body['messages']
                prompt = sum(len(str(m.get('content') or '')) for m in messages) // 4 + 4 * len(messages)
                key = str(messages[0].get('content'))[:64]
                cached = min(cache.get(key, 0), prompt)
                completion = int(body.get('max_tokens') or 16)
                async with slots:
                    await asyncio.sleep(args['ttft'] + (prompt - cached) * args['prefill'] + completion * args['decode'])
                cache[key] = prompt + completion
                return web.json_response({
                    'id': 'sim', 'object': 'chat.completion', 'model': 'sim',
                    'choices': [{'index': 0, 'message': {'role': 'assistant', 'content': 'ok ' * completion},
                                 'finish_reason': 'length'}],
                    'usage': {'prompt_tokens': prompt, 'completion_tokens': completion,
                              'total_tokens': prompt + completion,
                              'prompt_tokens_details': {'cached_tokens': cached}}})

            app = web.Application()
            app.router.add_get('/v1/models', models)
            app.router.add_post('/v1/chat/completions', chat)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, '127.0.0.1', port, backlog=16384).start()
            runners.append(runner)
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def _free_ports(n: int) -> List[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(('127.0.0.1', 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


# ---- the client ----------------------------------------------------------------------------------
def _run(urls: List[str], client: str, bounded: bool, args: argparse.Namespace) -> Dict[str, Any]:
    import mtflow
    from mtflow import Executor, RequestConfig, RolloutInferRequest
    from mtflow.backends.openai_server import OpenAIBackend

    class GoOn(mtflow.Scheduler):

        def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
            return False

        def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
            infer_request.messages.append({'role': 'user', 'content': 'go on'})
            return {'infer_request': infer_request}

    requests = [RolloutInferRequest(uuid=f'r{i}', messages=[{'role': 'user', 'content': f'task {i}: ' + 'word ' * 200}])
                for i in range(args.requests)]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # chat mode's exact-ids warning
        backend = OpenAIBackend(urls=urls, model='sim', flavor='openai', http_client=client, routing=args.routing,
                                max_connections=args.requests + 16, timeout=args.deadline, health_interval_s=0,
                                max_in_flight_per_replica=args.max_num_seqs if bounded else None)
    finished: List[str] = []
    cpu0, t0 = time.process_time(), time.perf_counter()
    with backend:
        result = Executor(GoOn(), backend.async_rollout_fn(), RequestConfig(max_tokens=args.max_tokens),
                          mode='async', max_concurrency=args.requests, max_turns=args.turns, on_error='return',
                          rollout_timeout_s=args.deadline, on_finished=lambda f: finished.append(f.uuid)).run(requests)
        serving = backend.serving_summary()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    calls = serving['replicas'] and sum(r['served'] for r in serving['replicas'])
    return {'client': client, 'bounded': bounded, 'wall_s': wall, 'calls': calls, 'cpu_s': cpu,
            'ok': result.finish_reasons.count('max_turns'), 'delivered': len(set(finished)),
            'hit': serving['hit_rate_after_turn_1'], 'queued': serving['queued']}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--requests', type=int, default=10_000)
    ap.add_argument('--turns', type=int, default=3)
    ap.add_argument('--replicas', type=int, default=4)
    ap.add_argument('--max-num-seqs', type=int, default=256)
    ap.add_argument('--max-tokens', type=int, default=64)
    ap.add_argument('--ttft', type=float, default=0.05, help='seconds before the first token')
    ap.add_argument('--prefill', type=float, default=0.0002, help='seconds per uncached prompt token')
    ap.add_argument('--decode', type=float, default=0.02, help='seconds per generated token')
    ap.add_argument('--routing', default='sticky_least_loaded')
    ap.add_argument('--clients', default='httpx,aiohttp')
    ap.add_argument('--deadline', type=float, default=600.0)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.requests + 1024)), hard))

    ports = _free_ports(args.replicas)
    ready = mp.get_context('spawn').Event()
    server = mp.get_context('spawn').Process(target=_serve, args=(ports, {
        'max_num_seqs': args.max_num_seqs, 'ttft': args.ttft, 'prefill': args.prefill, 'decode': args.decode}, ready),
                                             daemon=True)
    server.start()
    ready.wait(60)
    urls = [f'http://127.0.0.1:{p}/v1' for p in ports]
    # the service time of a cached turn (turn >= 2: only the new tokens are prefilled) and of turn 1
    first = args.ttft + (200 * 5 // 4 + 8) * args.prefill + args.max_tokens * args.decode
    later = args.ttft + 20 * args.prefill + args.max_tokens * args.decode
    mean_service = (first + (args.turns - 1) * later) / args.turns
    capacity = args.replicas * args.max_num_seqs / mean_service
    calls = args.requests * args.turns
    ideal = calls / capacity + mean_service
    print(f'{args.requests} requests x {args.turns} turns = {calls} model calls; {args.replicas} replicas x '
          f'{args.max_num_seqs} seqs, service {mean_service * 1000:.0f} ms: capacity {capacity:.0f} calls/s, '
          f'ideal wall {ideal:.1f} s')
    print('| client | admission | wall s | calls/s | of capacity | client CPU ms/call | hit after turn 1 | finished | queued |')
    print('|---|---|---:|---:|---:|---:|---:|---:|---:|')
    try:
        for client in args.clients.split(','):
            for bounded in (True, False):
                r = _run(urls, client, bounded, args)
                rate = r['calls'] / r['wall_s']
                print(f"| {client} | {'per replica ' + str(args.max_num_seqs) if bounded else 'none (10k sockets)'} "
                      f"| {r['wall_s']:.1f} | {rate:.0f} | {rate / capacity:.0%} | {1000 * r['cpu_s'] / r['calls']:.2f} "
                      f"| {r['hit']:.0%} | {r['ok']}/{args.requests} (delivered {r['delivered']}) | {r['queued']} |",
                      flush=True)
    finally:
        server.terminate()
        server.join(5)


if __name__ == '__main__':
    main()
