#!/usr/bin/env python
"""Tree training against per-leaf packing at equal leaves (``mtflow.train.tree_packing``).

The workload: G guess-the-number games (the YAML scheduler's ``guess_number`` environment), each a
branched group of 4 leaves grown by a binary tree (two branches before turns 2 and 3), T turns,
rolled out once through the HF backend at temperature 1 (seeded). Then, in turn and ``--repeats``
times, one optimizer step (the clipped policy-gradient loss with TreeRL's per-node advantages,
``agg='token-mean'``) on the same leaves, two ways:

* *per-leaf*: each leaf's whole sequence packed into rows of ``--row-len`` (``pack``, the
  block-causal mask), what ``train_step`` does;
* *tree*: each tree's nodes once, in rows of ``--row-len`` (``pack_trees``, the ancestors-only
  mask), what ``tree_train_step`` does.

Printed: the tokens through the model (real tokens, and rows x row length with the padding), the
best wall time of a step (forward, backward, optimizer) and its ratio to per-leaf, and the two
losses (equal: the tree step is the per-leaf step). The weights are not moved (SGD at lr 0), so
every repeat runs the same numbers.

    .venv/bin/python benchmarks/tree_training.py --model tiny --games 8
    .venv/bin/python benchmarks/tree_training.py --model embedded --games 2
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtflow import Branching, Executor, RequestConfig, RolloutInferRequest  # noqa: E402
from mtflow.declarative import load_scheduler  # noqa: E402
from mtflow.train import assign_tree_advantages, samples_from_result  # noqa: E402
from mtflow.train.loop import policy_loss, token_logprobs  # noqa: E402
from mtflow.train.packing import pack, to_tensors  # noqa: E402
from mtflow.train.tree_packing import pack_trees, tree_policy_loss, tree_tensors, tree_token_logprobs  # noqa: E402

GAME = {'max_turns': 4, 'env': {'impl': 'guess_number', 'kwargs': {'low': 1, 'high': 100, 'max_guesses': 99}},
        'system_prompt': 'We play a game: guess my number between 1 and 100, one guess per reply.',
        'stop': {'on_length': False}}


def binary(infer_request: Any, state: str, turn: int) -> Any:
    return 2 if state == 'generating' and turn in (2, 3) else None


def load(name: str) -> Tuple[Any, Any, str]:
    if name == 'tiny':
        from tests.tiny_model import make_model, make_tokenizer

        tok = make_tokenizer()
        return make_model(tok, seed=1), tok, 'tiny random Qwen2 (2 layers, hidden 32)'
    from mtflow.backends.models import load_model

    loaded = load_model(name)
    return loaded.model, loaded.tokenizer, f'{name} (SmolLM2-135M-Instruct)'


def rollout(model: Any, tok: Any, a: argparse.Namespace) -> Tuple[List[Any], List[Any]]:
    from mtflow.backends.hf import HFBackend

    requests = [RolloutInferRequest(messages=[{'role': 'user', 'content': f'Game {g}: your first guess?'}],
                                    uuid=f'g{g}') for g in range(a.games)]
    executor = Executor(load_scheduler({**GAME, 'max_turns': a.turns}, tokenizer=tok),
                        HFBackend(model, tok, max_batch_size=4 * a.games),
                        RequestConfig(max_tokens=a.max_tokens, temperature=1.0, seed=a.seed, logprobs=True),
                        branch=Branching(at=binary, copies=2, leaves=4))
    result = executor.run(requests)
    if result.failures:
        raise SystemExit(f'rollout failed: {result.failures[0]}')
    samples = samples_from_result(result, requests)
    # a random model wins no game, so every leaf's reward is the same and every advantage 0: a stand-in reward
    # per leaf (its length mod 5) gives the nodes advantages that differ, so the losses compared are not 0
    assign_tree_advantages(samples, result.trees, rewards={s.uuid: float(len(s.completion_ids) % 5) for s in samples})
    return samples, result.trees


def step(model: Any, optimizer: Any, batch: Dict[str, Any], tree: bool) -> Tuple[float, float]:
    t0 = time.perf_counter()
    if tree:
        loss = tree_policy_loss(tree_token_logprobs(model, batch), batch)
    else:
        loss = policy_loss(token_logprobs(model, batch), batch)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return time.perf_counter() - t0, float(loss.detach())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', default='tiny', help="'tiny' or 'embedded'")
    p.add_argument('--games', type=int, default=8)
    p.add_argument('--turns', type=int, default=4)
    p.add_argument('--max-tokens', type=int, default=16)
    p.add_argument('--row-len', type=int, default=1024, help='tokens per row (0: everything in one row each way)')
    p.add_argument('--repeats', type=int, default=3)
    p.add_argument('--seed', type=int, default=0)
    a = p.parse_args()
    import torch

    torch.manual_seed(a.seed)
    model, tok, name = load(a.model)
    model = model.float()
    t0 = time.perf_counter()
    samples, trees = rollout(model, tok, a)
    rollout_s = time.perf_counter() - t0
    model.train()
    longest = max(len(s.input_ids) for s in samples)
    total = sum(len(s.input_ids) for s in samples)
    row_len = a.row_len or None
    leaf_rows = pack(samples, row_len or total)  # no row length: one row each way, no padding
    tree_rows = pack_trees(trees, samples, row_len=row_len)
    batches = {'per-leaf': to_tensors(leaf_rows), 'tree': tree_tensors(tree_rows)}
    tokens = {'per-leaf': total,
              'tree': sum(sum(1 for n in r.node_index if n >= 0) for r in tree_rows)}
    fed = {k: int(b['input_ids'].numel()) for k, b in batches.items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    times: Dict[str, List[float]] = {'per-leaf': [], 'tree': []}
    losses: Dict[str, float] = {}
    for _ in range(a.repeats):  # alternating: a load spike hits one repeat, not one condition
        for cond in ('per-leaf', 'tree'):
            seconds, loss = step(model, optimizer, batches[cond], cond == 'tree')
            times[cond].append(seconds)
            losses[cond] = loss
    load_avg = '/'.join(f'{x:.1f}' for x in os.getloadavg())
    print(f'tree training, {name}: {a.games} games x 4 leaves (forks before turns 2 and 3) x {a.turns} turns, '
          f'max_tokens {a.max_tokens}, {len(samples)} leaves, longest leaf {longest} tokens; rollout {rollout_s:.1f} s; '
          f'best of {a.repeats}; load {load_avg}')
    print(f'{"packing":<9} {"rows":>5} {"tokens":>7} {"fed (padded)":>13} {"step s":>8} {"tokens x":>9} {"step x":>7} '
          f'{"loss":>12}')
    for cond, rows in (('per-leaf', leaf_rows), ('tree', tree_rows)):
        best = min(times[cond])
        print(f'{cond:<9} {len(rows):>5} {tokens[cond]:>7} {fed[cond]:>13} {best:>8.3f} '
              f'{tokens[cond] / tokens["per-leaf"]:>9.2f} {best / min(times["per-leaf"]):>7.2f} {losses[cond]:>12.4e}')


if __name__ == '__main__':
    main()
