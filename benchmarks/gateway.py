"""The gateway's overhead per model call, its memory over many calls, and how it batches a real
model's sessions (``docs/benchmarks.md``).

**Latency** (``--part latency``): ``N`` concurrent sessions (``--sessions``, default 1, 64, 1000),
each an agent that makes ``--turns`` calls (its messages growing: each call extends the last),
thinks between calls (uniform in ``[0, 2 * N / --rate]`` seconds, so that the offered load is
about ``--rate`` calls/s whatever ``N``), finishes, and starts a new session; the agents start
spread over one think time (a steady stream, not all first calls at once). The same agents run
three ways against the same scripted backend (text only, no tokenizer: the backend costs almost
nothing, so what is measured is the path):

* ``direct``: in the benchmark's process, each call is ``await rollout_fn([request], config)``,
  the backend's async path the gateway itself uses (its dynamic batcher, no wait);
* ``chat``: ``mtflow gateway`` in a child process, its run directory written as usual; each
  call is an HTTP ``POST /s/<session>/v1/chat/completions`` from this process (aiohttp, kept
  connections); the latency is the client's;
* ``responses``: the same gateway, each call a ``POST /s/<session>/v1/responses`` (the whole
  input each time, ``store: false``, as Codex CLI sends it).

The added latency is the gateway's p50 (p99) minus the direct p50 (p99) at the same ``N``. All
share the machine's cores with the load generator (``--api``: which of chat and responses). Each
session's ``POST /finish`` is timed too (``finish_p50_ms``): it is answered once the trajectory is
durable (written and fsynced). ``--baseline DIR`` runs the gateway a second time from another
tree of mtflow (e.g. the last landed commit, ``git archive <commit> | tar -x -C DIR``), in the
same run, for a before/after table (through chat completions only when that tree has no
Responses API).

**Memory** (``--part memory``): the gateway's resident memory (``VmRSS`` of the child process)
sampled every ``--calls``/10 calls over ``--calls`` calls (default 100k) by ``--mem-sessions``
agents at full speed (no thinking), sessions recycled every ``--turns`` calls; ``--exact``: the
scripted model keeps exact token records (the tiny test tokenizer), whose memory counts too.

**Batching** (``--part batching``): ``--hf-sessions`` sessions (default 64) against an in-process
gateway in front of a real transformers model (``--hf-model``: the tiny random test model, or
``embedded``), its batch size as large as the sessions, each session making ``--hf-turns`` calls
back to back (no thinking: a call leaves as soon as its answer is back). What is counted is the
model's ``generate`` calls per turn against the ideal (one per turn), with the batcher the
gateway uses and, in the same run, with the one it used before (no wait for the sessions of the
batch that just returned), which phase-locked the sessions into groups that never merged.

    .venv/bin/python benchmarks/gateway.py                      # latency and memory
    .venv/bin/python benchmarks/gateway.py --part latency --sessions 1 64 1000 --rate 300
    .venv/bin/python benchmarks/gateway.py --part memory --calls 100000
    .venv/bin/python benchmarks/gateway.py --part memory --calls 100000 --exact
    .venv/bin/python benchmarks/gateway.py --part latency --sessions 64 --baseline /tmp/mtflow-base
    .venv/bin/python benchmarks/gateway.py --part batching --hf-sessions 64 --hf-turns 6
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtflow.backends.scripted import ScriptedBackend  # noqa: E402
from mtflow.core.protocol import RequestConfig, RolloutInferRequest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REPLY = 'I looked at it and will go on.'


def _percentiles(values: List[float]) -> Dict[str, float]:
    values = sorted(values)
    if not values:
        return {'p50_ms': float('nan'), 'p99_ms': float('nan')}

    def at(q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] * 1000

    return {'p50_ms': round(at(0.50), 3), 'p99_ms': round(at(0.99), 3)}


class Agents:
    """``n`` agents, each running sessions of ``turns`` calls with ``think()`` between calls, until
    ``calls`` calls were made in all; ``call(session, messages) -> reply message`` and
    ``finish(session)`` are the path under test."""

    def __init__(self, n: int, turns: int, calls: int, think_mean_s: float, prefix: str = 'a') -> None:
        self.n, self.turns, self.calls, self.think_mean_s = n, turns, calls, think_mean_s
        self.prefix = prefix
        self.latencies: List[float] = []
        self.finish_latencies: List[float] = []
        self.made = 0
        self.sessions = 0
        self.on_calls: Any = None  # called with the count every so often (the memory part samples)

    def think(self) -> float:
        return random.uniform(0, 2 * self.think_mean_s) if self.think_mean_s > 0 else 0.0

    async def run(self, call: Any, finish: Any) -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(self._agent(k, call, finish) for k in range(self.n)))
        return time.perf_counter() - t0

    async def _agent(self, k: int, call: Any, finish: Any) -> None:
        pause = self.think()  # agents start spread over a think time, as a steady stream of episodes does
        if pause:
            await asyncio.sleep(pause)
        while self.made < self.calls:
            self.sessions += 1
            session = f'{self.prefix}{k}-{self.sessions}'
            messages = [{'role': 'user', 'content': f'Task {session}: look around.'}]
            for t in range(self.turns):
                if self.made >= self.calls:
                    break
                self.made += 1
                if self.on_calls is not None and self.made % max(1, self.calls // 10) == 0:
                    self.on_calls(self.made)
                t0 = time.perf_counter()
                reply = await call(session, messages)
                self.latencies.append(time.perf_counter() - t0)
                messages += [reply, {'role': 'user', 'content': f'observation {t}'}]
                pause = self.think()
                if pause:
                    await asyncio.sleep(pause)
            t0 = time.perf_counter()
            await finish(session)
            self.finish_latencies.append(time.perf_counter() - t0)


# ---- the direct path ---------------------------------------------------------------------------------
async def run_direct(agents: Agents) -> float:
    backend = ScriptedBackend(outputs=[REPLY], cycle=True)
    rollout_fn = backend.async_rollout_fn(max_wait_s=0.0, settle_s=0.0)
    config = RequestConfig(max_tokens=32)

    async def call(session: str, messages: List[Dict[str, Any]]) -> Dict[str, Any]:
        [out] = await rollout_fn([RolloutInferRequest(uuid=session, messages=list(messages))], config)
        return {'role': 'assistant', 'content': out.response.choices[0].message.content}

    async def finish(session: str) -> None:
        backend.forget(session)

    try:
        return await agents.run(call, finish)
    finally:
        rollout_fn.close()


# ---- the gateway ----------------------------------------------------------------------------------
class ServedGateway:
    """``mtflow gateway`` on a scripted backend in a child process."""

    def __init__(self, workdir: Path, max_sessions: int, exact: bool = False, root: Path = ROOT) -> None:
        (workdir / 'script.jsonl').write_text(json.dumps(REPLY) + '\n')
        tokenizer = ''
        if exact:  # exact token records under the tiny test tokenizer: the records' memory is measured too
            from tests.tiny_model import make_tokenizer

            make_tokenizer().save_pretrained(workdir / 'tok')
            tokenizer = f', tokenizer: {workdir / "tok"}'
        config = workdir / 'gateway.yaml'
        config.write_text(f'backend: scripted\nbackend_options: {{path: script.jsonl, cycle: true{tokenizer}}}\n'
                          f'request_config: {{max_tokens: 32}}\ngateway: {{max_sessions: {max_sessions}, '
                          'idle_timeout_s: 600, tool_parser: null}\n')
        env = dict(os.environ, PYTHONPATH=str(root))
        self.proc = subprocess.Popen([sys.executable, '-m', 'mtflow', 'gateway', str(config), '--port', '0', '--out',
                                      str(workdir / 'run'), '-q'], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, cwd=workdir)
        line = self.proc.stdout.readline()
        found = re.search(r'serving (http://\S+)', line)
        if found is None:
            raise RuntimeError(f'the gateway did not start: {line!r} {self.proc.stderr.read()[-2000:]}')
        self.url = found.group(1)

    def rss_mb(self) -> float:
        with open(f'/proc/{self.proc.pid}/status') as f:
            kb = int(next(line for line in f if line.startswith('VmRSS')).split()[1])
        return round(kb / 1024, 1)

    def stop(self) -> Dict[str, Any]:
        self.proc.send_signal(signal.SIGINT)
        self.proc.communicate(timeout=600)
        return {'exit': self.proc.returncode}


async def run_gateway(agents: Agents, gateway: ServedGateway, api: str = 'chat') -> float:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        async def call(session: str, messages: List[Dict[str, Any]]) -> Dict[str, Any]:
            if api == 'responses':
                body = {'model': 'm', 'input': messages, 'store': False}
                path = 'responses'
            else:
                body, path = {'model': 'm', 'messages': messages}, 'chat/completions'
            async with http.post(f'{gateway.url}/s/{session}/v1/{path}', json=body) as response:
                answer = await response.json()
                if response.status != 200:
                    raise RuntimeError(f'{response.status}: {answer}')
            if api == 'responses':
                return {'role': 'assistant', 'content': answer['output'][-1]['content'][0]['text']}
            return answer['choices'][0]['message']

        async def finish(session: str) -> None:
            async with http.post(f'{gateway.url}/s/{session}/finish', json={'reward': 1.0}) as response:
                await response.read()

        return await agents.run(call, finish)


def _check_tree(root: Path) -> None:
    """``--baseline``: a tree of mtflow whose own package the gateway child imports (not the venv's
    editable install), else the comparison would measure the wrong code."""
    if not (root / 'mtflow' / '__init__.py').is_file():
        raise SystemExit(f'--baseline {root}: no mtflow/ there; give a tree of mtflow, e.g. mkdir -p DIR && '
                         'git archive <commit> | tar -x -C DIR')
    env = dict(os.environ, PYTHONPATH=str(root))
    found = subprocess.run([sys.executable, '-c', 'import mtflow; print(mtflow.__file__)'], env=env,
                           capture_output=True, text=True, cwd=root).stdout.strip()
    if not found.startswith(str(root.resolve())):
        raise SystemExit(f'--baseline {root}: its mtflow is not what a child imports there ({found or "none"}); give '
                         'a tree of mtflow, e.g. mkdir -p DIR && git archive <commit> | tar -x -C DIR')


def latency(args: argparse.Namespace) -> List[Dict[str, Any]]:
    if args.baseline:
        _check_tree(Path(args.baseline))
    rows = []
    for n in args.sessions:
        calls = max(args.min_calls, n * args.turns)
        think = n / args.rate if args.rate else 0.0
        direct = Agents(n, args.turns, calls, think)
        wall_direct = asyncio.run(run_direct(direct))
        d = _percentiles(direct.latencies)
        trees = ([('baseline', Path(args.baseline))] if args.baseline else []) + [('this tree', ROOT)]
        for tree, root in trees:
            row: Dict[str, Any] = {'sessions': n, 'calls': calls, 'offered_calls_per_s': args.rate, 'tree': tree,
                                   'direct': {**d, 'calls_per_s': round(calls / wall_direct, 1)}}
            apis = [a for a in args.api if a == 'chat' or (root / 'mtflow' / 'gateway' / 'responses_api.py').is_file()]
            for api, (served, wall) in zip(apis, _served(n, args.turns, calls, think, root, apis)):
                g = _percentiles(served.latencies)
                finish = _percentiles(served.finish_latencies)
                row[api] = {**g, 'calls_per_s': round(calls / wall, 1),
                            'added_p50_ms': round(g['p50_ms'] - d['p50_ms'], 3),
                            'added_p99_ms': round(g['p99_ms'] - d['p99_ms'], 3),
                            'finish_p50_ms': finish['p50_ms'], 'finish_p99_ms': finish['p99_ms']}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _served(n: int, turns: int, calls: int, think: float, root: Path, apis: List[str]) -> List[tuple]:
    """The agents against ``mtflow gateway`` run from the tree ``root``, through each of ``apis``:
    ``[(agents, wall seconds)]``."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        gateway = ServedGateway(Path(tmp), max(n, 64), root=root)
        try:
            for api in apis:
                warm = Agents(n, turns, min(calls, max(200, n)), think, prefix=f'warm-{api}')
                asyncio.run(run_gateway(warm, gateway, api))  # warm-up: connections, first sessions
                served = Agents(n, turns, calls, think, prefix=api)
                out.append((served, asyncio.run(run_gateway(served, gateway, api))))
        finally:
            gateway.stop()
    return out


# ---- batching: a real model's generate calls per turn ----------------------------------------------
def _hf_backend(model: str, sessions: int) -> Any:
    from mtflow.backends.hf import HFBackend

    if model == 'embedded':
        return HFBackend('embedded', max_batch_size=sessions, seed=0)
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    return HFBackend(make_model(tok, max_position_embeddings=4096), tok, max_batch_size=sessions, seed=0)


async def _batching_agents(url: str, sessions: int, turns: int) -> None:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        async def agent(k: int) -> None:
            messages = [{'role': 'user', 'content': f'Session {k}: say something.'}]
            for t in range(turns):
                async with http.post(f'{url}/s/hf{k}/v1/chat/completions',
                                     json={'model': 'm', 'messages': messages}) as response:
                    body = await response.json()
                    if response.status != 200:
                        raise RuntimeError(f'{response.status}: {body}')
                messages += [body['choices'][0]['message'], {'role': 'user', 'content': f'Go on ({t}).'}]
            async with http.post(f'{url}/s/hf{k}/finish', json={'reward': 0.0}) as response:
                await response.read()

        await asyncio.gather(*(agent(k) for k in range(sessions)))


def batching(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Generate calls per turn of ``--hf-sessions`` sessions, with the gateway's batcher now and
    with the one it had before, against the ideal of one per turn."""
    from mtflow import RequestConfig
    from mtflow.gateway import Gateway, gateway as gateway_module

    rows = []
    backend = _hf_backend(args.hf_model, args.hf_sessions)
    generate = backend.model.generate
    for label, settle_s, fraction in (('before (no wait)', 0.0, None),
                                      ('now', gateway_module.SETTLE_S, gateway_module.SETTLE_FRACTION)):
        sizes: List[int] = []

        def counted(*a: Any, **kw: Any) -> Any:
            sizes.append(int(kw['input_ids'].shape[0]))
            return generate(*a, **kw)

        backend.model.generate = counted
        saved = gateway_module.SETTLE_S, gateway_module.SETTLE_FRACTION
        gateway_module.SETTLE_S, gateway_module.SETTLE_FRACTION = settle_s, fraction
        try:
            with tempfile.TemporaryDirectory() as tmp:
                config = RequestConfig(max_tokens=args.hf_tokens, temperature=0.0)
                t0 = time.perf_counter()
                with Gateway(backend, Path(tmp) / 'run', request_config=config) as gw:
                    asyncio.run(_batching_agents(gw.url, args.hf_sessions, args.hf_turns))
                wall = time.perf_counter() - t0
        finally:
            gateway_module.SETTLE_S, gateway_module.SETTLE_FRACTION = saved
            backend.model.generate = generate
        rows.append({'batcher': label, 'model': args.hf_model, 'sessions': args.hf_sessions, 'turns': args.hf_turns,
                     'generate_calls': len(sizes), 'ideal_calls': args.hf_turns,
                     'calls_per_turn': round(len(sizes) / args.hf_turns, 2), 'batch_sizes': sizes,
                     'wall_s': round(wall, 2)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def memory(args: argparse.Namespace) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        gateway = ServedGateway(Path(tmp), args.mem_sessions, exact=args.exact)
        samples: List[Dict[str, Any]] = [{'calls': 0, 'rss_mb': gateway.rss_mb()}]
        try:
            agents = Agents(args.mem_sessions, args.turns, args.calls, 0.0)
            agents.on_calls = lambda made: samples.append({'calls': made, 'rss_mb': gateway.rss_mb()})
            wall = asyncio.run(run_gateway(agents, gateway))
            samples.append({'calls': agents.made, 'rss_mb': gateway.rss_mb()})
        finally:
            gateway.stop()
        lines = sum(1 for _ in open(Path(tmp) / 'run' / 'trajectories.jsonl'))
    result = {'calls': args.calls, 'exact': args.exact, 'sessions_at_once': args.mem_sessions,
              'turns_per_session': args.turns,
              'sessions_written': lines, 'calls_per_s': round(args.calls / wall, 1), 'rss_mb': samples}
    print(json.dumps(result), flush=True)
    return result


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--part', choices=('latency', 'memory', 'batching', 'both'), default='both',
                   help='both: latency and memory')
    p.add_argument('--api', nargs='+', choices=('chat', 'responses'), default=['chat', 'responses'],
                   help='the gateway APIs of the latency part')
    p.add_argument('--sessions', type=int, nargs='+', default=[1, 64, 1000])
    p.add_argument('--turns', type=int, default=10, help='calls per session')
    p.add_argument('--rate', type=float, default=200.0, help='offered calls/s in the latency part (0: no thinking)')
    p.add_argument('--min-calls', type=int, default=2000, help='calls measured per row, at least')
    p.add_argument('--calls', type=int, default=100_000, help='calls of the memory part')
    p.add_argument('--mem-sessions', type=int, default=64, help='sessions at once in the memory part')
    p.add_argument('--baseline', help='latency part: also run the gateway from this tree of mtflow (before/after)')
    p.add_argument('--exact', action='store_true', help='memory part: the scripted model keeps exact token records '
                   '(the tiny test tokenizer)')
    p.add_argument('--hf-sessions', type=int, default=64, help='batching part: concurrent sessions')
    p.add_argument('--hf-turns', type=int, default=6, help='batching part: calls per session')
    p.add_argument('--hf-tokens', type=int, default=16, help='batching part: max_tokens per call')
    p.add_argument('--hf-model', choices=('tiny', 'embedded'), default='tiny',
                   help='batching part: the tiny random test model, or the embedded SmolLM2-135M')
    args = p.parse_args(argv)
    if args.part in ('latency', 'both'):
        latency(args)
    if args.part in ('memory', 'both'):
        memory(args)
    if args.part == 'batching':
        batching(args)


if __name__ == '__main__':
    main()
