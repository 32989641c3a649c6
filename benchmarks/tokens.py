#!/usr/bin/env python
"""Re-tokenization drift, before (re-rendering every turn) and after (token-in/token-out), and
what keeping the token record costs per turn.

For each model, N conversations are rolled out for T turns with the HF backend twice, from the
same seed: once with ``exact_ids=False`` (every turn's prompt rendered from text and tokenized
again: the old path) and once with exact ids (the default). A turn transition *drifts* when the
next prompt does not start with the previous prompt + the ids sampled at the previous turn: the
model is then conditioned on ids it did not sample. The user turns invite non-ASCII text, and
short replies cut by ``max_tokens`` often end inside a multi-byte character.

The cost per turn compares, on the same recorded conversations, building the next prompt by
re-rendering (``render_prompt``: template + tokenize the whole conversation) with building it
from the record (``TokenPrompter.plan`` + ``commit``: the template's delta, tokenized alone, and
the prefix-stability check), and reports the record's size.

    .venv/bin/python benchmarks/tokens.py                       # embedded SmolLM2 + tiny Qwen2/Llama
    .venv/bin/python benchmarks/tokens.py --models tiny-qwen2 tiny-llama --conversations 32
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ['Écris une phrase en français avec des accents.', 'Schreib etwas über Größe und Übermaß.',
           'Write a word in Japanese (日本語) and explain it.', 'Name three emojis and what they mean 🙂.',
           'Translate "naïve café" to Spanish.', 'Spell «façade» letter by letter.',
           'Write 東京 and 北京 in romaji.', 'Use the symbols €, £ and ¥ in a sentence.']
FOLLOW = 'Continue, with more accented or non-Latin words (é, ü, ñ, 中文).'


def load(name: str) -> Tuple[Any, Any, str]:
    if name == 'embedded':
        from mtflow.backends.models import load_model

        loaded = load_model('embedded')
        return loaded.model, loaded.tokenizer, 'SmolLM2-135M-Instruct (own template)'
    from tests.tiny_model import make_model, make_tokenizer

    style = 'llama' if name == 'tiny-llama' else 'chatml'
    tok = make_tokenizer(style=style)
    return make_model(tok, seed=0), tok, f'{name} ({"llama3" if style == "llama" else "chatml"} template)'


def rollout(model: Any, tok: Any, exact: bool, n: int, turns: int, max_tokens: int, temperature: float,
            seed: int) -> Tuple[int, int, List[Any], float]:
    """(drifted transitions, transitions, final requests, seconds)."""
    from mtflow import RequestConfig, RolloutInferRequest
    from mtflow.backends.hf import HFBackend

    backend = HFBackend(model, tok, exact_ids=exact, max_batch_size=n)
    requests = [RolloutInferRequest(messages=[{'role': 'user', 'content': PROMPTS[i % len(PROMPTS)]}], uuid=f'c{i}')
                for i in range(n)]
    last: Dict[str, Tuple[List[int], List[int]]] = {}
    drift = total = 0
    t0 = time.perf_counter()
    for turn in range(turns):
        outs = backend(requests, RequestConfig(max_tokens=max_tokens, temperature=temperature, seed=seed + turn))
        for req, out in zip(requests, outs):
            prompt, sampled = out.response.prompt_token_ids, out.response.choices[0].token_ids
            if req.uuid in last:
                p0, s0 = last[req.uuid]
                total += 1
                drift += prompt[:len(p0) + len(s0)] != p0 + s0
            last[req.uuid] = (prompt, sampled)
            req.messages.append({'role': 'assistant', 'content': out.response.choices[0].message.content})
            req.messages.append({'role': 'user', 'content': FOLLOW})
    return drift, total, requests, time.perf_counter() - t0


def prompt_cost(tok: Any, requests: List[Any], repeat: int) -> Tuple[float, float, float]:
    """Per turn: microseconds to re-render the prompt, microseconds to build it from the record,
    and the record's ids per request (its size, in ints)."""
    from mtflow import RolloutInferRequest
    from mtflow.backends.hf import render_prompt
    from mtflow.backends.tokens import TokenPrompter

    # the conversations, turn by turn (the request as each turn saw it), replayed with the text
    # replies: each turn's completion is re-encoded (the record's content, not the point here)
    histories = []
    for req in requests:
        msgs = req.messages
        cuts = [i for i, m in enumerate(msgs) if m['role'] == 'user']
        histories.append([msgs[:c + 1] for c in cuts])
    turns = sum(len(h) for h in histories)
    t0 = time.perf_counter()
    for _ in range(repeat):
        for hist in histories:
            for msgs in hist:
                render_prompt(tok, RolloutInferRequest(messages=copy.deepcopy(msgs)))
    rerender = (time.perf_counter() - t0) / (repeat * turns) * 1e6
    sizes = []
    t_record = 0.0
    for _ in range(repeat):
        prompter = TokenPrompter(tok)
        for k, hist in enumerate(histories):
            req = RolloutInferRequest(messages=copy.deepcopy(hist[0]), uuid=f'h{k}')
            for t, msgs in enumerate(hist):
                req.messages = copy.deepcopy(msgs)
                reply = msgs_next_reply(hist, t)
                t1 = time.perf_counter()
                plan = prompter.plan(req)
                prompter.commit(req, plan, tok.encode(reply, add_special_tokens=False), reply)
                t_record += time.perf_counter() - t1
            rec = req.token_record
            sizes.append(len(rec.last_prompt) + sum(len(x.sampled) + len(x.appended) for x in rec.turns))
    return rerender, t_record / (repeat * turns) * 1e6, sum(sizes) / len(sizes)


def msgs_next_reply(hist: List[List[Dict[str, Any]]], t: int) -> str:
    """The assistant reply that followed turn ``t`` (the last turn's is unknown: a fixed text)."""
    if t + 1 < len(hist):
        return hist[t + 1][len(hist[t])]['content']
    return 'done'


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--models', nargs='+', default=['embedded', 'tiny-qwen2', 'tiny-llama'])
    ap.add_argument('--conversations', type=int, default=16)
    ap.add_argument('--turns', type=int, default=4)
    ap.add_argument('--max-tokens', type=int, default=12)
    ap.add_argument('--temperature', type=float, default=1.2)
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--repeat', type=int, default=3, help='repetitions of the prompt-cost measurement')
    args = ap.parse_args()
    import torch

    print(f'{args.conversations} conversations x {args.turns} turns, {args.max_tokens}-token replies, '
          f'temperature {args.temperature}, seed {args.seed}')
    print('| model | drift before (re-render) | drift after (exact ids) | rollout s before / after | '
          'prompt build per turn: re-render / record | record size (ids) |')
    print('|---|---|---|---|---|---|', flush=True)
    rows = []
    for name in args.models:  # one row as soon as its model is done (the embedded one is slow on CPU)
        model, tok, label = load(name)
        result = {}
        for exact in (False, True):
            torch.manual_seed(args.seed)
            result[exact] = rollout(model, tok, exact, args.conversations, args.turns, args.max_tokens,
                                    args.temperature, args.seed)
        rr, rec, size = prompt_cost(tok, result[True][2], args.repeat)
        (before, after) = result[False][:2], result[True][:2]
        rows.append((label, before, after))
        print(f'| {label} | {before[0]} of {before[1]} ({before[0] / max(1, before[1]):.0%}) | '
              f'{after[0]} of {after[1]} ({after[0] / max(1, after[1]):.0%}) | '
              f'{result[False][3]:.1f} / {result[True][3]:.1f} | {rr:.0f} us / {rec:.0f} us | {size:.0f} |', flush=True)
    return 0 if all(after[0] == 0 for _, _, after in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
