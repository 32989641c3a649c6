#!/usr/bin/env python
"""10k concurrent multi-turn requests against simulated engine replicas: does the client keep the
servers busy, does it hang, what does it cost per request; httpx against aiohttp.

The replicas run in subprocesses (their CPU is not the client's; ``--fleet-procs``, default one
per replica, each with its own event loop), and ``--client-cpus`` / ``--fleet-cpus`` pin the
client and the fleet to separate cores (``os.sched_setaffinity``), so that on a small machine
the client's share of the CPU is known. They are aiohttp web servers on 127.0.0.1 that behave like a continuous-batching engine with a prefix cache: at most
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
    .venv/bin/python benchmarks/serving.py --clients aiohttp --client-cpus 0 --fleet-cpus 1
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
    import os

    from aiohttp import web

    if args.get('cpus'):
        os.sched_setaffinity(0, args['cpus'])
    import random

    rng = random.Random(ports[0])

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
                if args['spread']:  # replies of different lengths, as a model's are: 1 - spread .. 1 of max_tokens
                    completion = max(1, round(completion * (1 - args['spread'] * rng.random())))
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


def _cpus(spec: str) -> List[int]:
    """``'0'``, ``'1-3'``, ``'0,2'`` as a list of CPU numbers (empty: no pinning)."""
    out: List[int] = []
    for part in filter(None, spec.split(',')):
        lo, _, hi = part.partition('-')
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _cpu_s(pids: List[int]) -> float:
    """User + system CPU seconds the processes used so far (``/proc/<pid>/stat``)."""
    import os

    tick = os.sysconf('SC_CLK_TCK')
    total = 0
    for pid in pids:
        with open(f'/proc/{pid}/stat') as f:
            fields = f.read().rsplit(')', 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / tick


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
    ap.add_argument('--spread', type=float, default=0.0,
                    help='reply lengths uniform in [1 - spread, 1] x max_tokens (0: every reply max_tokens long, '
                         'so every call takes the same time and the replies of a wave arrive together)')
    ap.add_argument('--admission', choices=('both', 'bounded', 'none'), default='both',
                    help='rows with the per-replica bound, without it, or both')
    ap.add_argument('--fleet-procs', type=int, default=0, help='server processes (0: one per replica)')
    ap.add_argument('--client-cpus', default='', help="pin the client to these CPUs ('0', '0-1'); '': no pinning")
    ap.add_argument('--fleet-cpus', default='', help='pin the simulated servers to these CPUs')
    args = ap.parse_args()
    import os

    if args.client_cpus:
        os.sched_setaffinity(0, _cpus(args.client_cpus))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.requests + 1024)), hard))

    ports = _free_ports(args.replicas)
    procs = args.fleet_procs or args.replicas
    ctx = mp.get_context('spawn')
    servers, readies = [], []
    for k in range(procs):
        ready = ctx.Event()
        servers.append(ctx.Process(target=_serve, args=(ports[k::procs], {
            'max_num_seqs': args.max_num_seqs, 'ttft': args.ttft, 'prefill': args.prefill, 'decode': args.decode,
            'cpus': _cpus(args.fleet_cpus), 'spread': args.spread}, ready), daemon=True))
        readies.append(ready)
    for server in servers:
        server.start()
    for ready in readies:
        ready.wait(60)
    fleet_pids = [server.pid for server in servers]
    urls = [f'http://127.0.0.1:{p}/v1' for p in ports]
    # the service time of a cached turn (turn >= 2: only the new tokens are prefilled) and of turn 1
    mean_tokens = args.max_tokens * (1 - args.spread / 2)  # the mean reply length
    first = args.ttft + (200 * 5 // 4 + 8) * args.prefill + mean_tokens * args.decode
    later = args.ttft + 20 * args.prefill + mean_tokens * args.decode
    mean_service = (first + (args.turns - 1) * later) / args.turns
    capacity = args.replicas * args.max_num_seqs / mean_service
    calls = args.requests * args.turns
    ideal = calls / capacity + mean_service
    print(f'{args.requests} requests x {args.turns} turns = {calls} model calls; {args.replicas} replicas x '
          f'{args.max_num_seqs} seqs, service {mean_service * 1000:.0f} ms (reply lengths spread {args.spread:g}): '
          f'capacity {capacity:.0f} calls/s, '
          f'ideal wall {ideal:.1f} s')
    print(f'fleet: {procs} process(es) on CPUs {args.fleet_cpus or "any"}; client on CPUs '
          f'{args.client_cpus or "any"}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start')
    print('| client | admission | wall s | calls/s | of capacity | client CPU ms/call | client cores busy '
          '| fleet CPU ms/call | hit after turn 1 | finished | queued |')
    print('|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
    try:
        for client in args.clients.split(','):
            for bounded in {'both': (True, False), 'bounded': (True, ), 'none': (False, )}[args.admission]:
                fleet0 = _cpu_s(fleet_pids)
                r = _run(urls, client, bounded, args)
                fleet = _cpu_s(fleet_pids) - fleet0
                rate = r['calls'] / r['wall_s']
                print(f"| {client} | {'per replica ' + str(args.max_num_seqs) if bounded else 'none (10k sockets)'} "
                      f"| {r['wall_s']:.1f} | {rate:.0f} | {rate / capacity:.0%} | {1000 * r['cpu_s'] / r['calls']:.2f} "
                      f"| {r['cpu_s'] / r['wall_s']:.2f} | {1000 * fleet / r['calls']:.2f} "
                      f"| {r['hit']:.0%} | {r['ok']}/{args.requests} (delivered {r['delivered']}) | {r['queued']} |",
                      flush=True)
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.join(5)


if __name__ == '__main__':
    main()
