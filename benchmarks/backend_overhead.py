#!/usr/bin/env python
"""What mtflow adds on top of plain ``model.generate`` for a multi-turn rollout.

The same conversations are rolled out twice, interleaved (A B A B ...), with the same model:

* **plain**: a hand-written loop: per turn, render every conversation with the chat template,
  left-pad, one ``model.generate`` call (greedy, raw logits returned), cut each row at EOS,
  gather the sampled tokens' logprobs, decode, append the reply and the next user message;
* **mtflow**: ``mtflow.Executor`` with a scheduler that appends the same user message, driving
  ``HFBackend`` (same generate parameters): state machines, contract accounting of ids, masks
  and logprobs, traces, output objects.

Decoding is greedy, so both paths compute exactly the same tokens (the script checks that the
final conversations are identical) and the difference in wall time is mtflow's overhead.
Target: under 5%.

    .venv/bin/python benchmarks/backend_overhead.py                   # embedded SmolLM2, 8 x 3 turns
    .venv/bin/python benchmarks/backend_overhead.py --model tiny      # a tiny random Qwen2 (overhead-bound)
    .venv/bin/python benchmarks/backend_overhead.py --load            # embedded model: first vs cached load
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FOLLOW_UP = 'Wrong. Guess again with another number.'


def plain_rollout(model: Any, tok: Any, convs: List[List[Dict[str, Any]]], turns: int, max_tokens: int) -> Tuple[
        List[List[Dict[str, Any]]], int]:
    """The baseline: the same work written directly against transformers."""
    import torch

    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    convs = copy.deepcopy(convs)
    generated = 0
    for turn in range(1, turns + 1):
        prompts = [
            tok(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False)['input_ids'] for c in convs
        ]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
        gen = out.sequences[:, width:]
        logp = torch.stack([torch.log_softmax(step.float(), -1) for step in out.logits], 1)
        sampled = logp.gather(2, gen[:, :, None]).squeeze(2)
        for row, conv in enumerate(convs):
            tokens = gen[row].tolist()
            n = tokens.index(eos) + 1 if eos in tokens else len(tokens)
            _ = sampled[row, :n].tolist()  # the logprobs a trainer needs
            generated += n
            text = tok.decode(tokens[:n], skip_special_tokens=True)
            conv.append({'role': 'assistant', 'content': text})
            if turn < turns:
                conv.append({'role': 'user', 'content': FOLLOW_UP})
    return convs, generated


def mtflow_rollout(backend: Any, convs: List[List[Dict[str, Any]]], turns: int, max_tokens: int) -> Tuple[
        List[List[Dict[str, Any]]], int]:
    from mtflow import Executor, RequestConfig, RolloutInferRequest, Scheduler

    class FollowUp(Scheduler):

        def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
            return False

        def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
            infer_request.messages.append({'role': 'user', 'content': FOLLOW_UP})
            ids = response_choice.token_ids
            return {'infer_request': infer_request, 'response_token_ids': ids, 'response_loss_mask': [1] * len(ids)}

    requests = [RolloutInferRequest(messages=copy.deepcopy(c), uuid=f'r{i}') for i, c in enumerate(convs)]
    before = backend.stats.completion_tokens
    result = Executor(FollowUp(), backend, RequestConfig(temperature=0, max_tokens=max_tokens, logprobs=True),
                      max_turns=turns).run(requests)
    assert result.ok, result.failures
    return [o.messages for o in result.outputs], backend.stats.completion_tokens - before


class GenerateTimer:
    """Wraps ``model.generate`` (on the instance) and adds up the seconds spent inside it, so the
    work each path does *around* generation can be compared apart from generation itself, which
    other jobs on a shared machine slow down unevenly."""

    def __init__(self, model: Any) -> None:
        self.inner = model.generate
        self.seconds = 0.0
        model.generate = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def measure_load(repeats: int) -> int:
    """The embedded model's first load (dequantize the GGUF, save the converted copy) against
    later loads (the cached copy), each in a fresh subprocess with an empty cache directory."""
    import subprocess
    import tempfile

    code = ('import time, json; t = time.perf_counter(); from mtflow.backends.models import load_model; '
            'm = load_model("embedded"); print(json.dumps({"cached": m.info["cached"], '
            '"load_s": m.info["load_s"], "process_s": time.perf_counter() - t}))')
    rows = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(__import__('os').environ, MTFLOW_CACHE=cache)
            for _ in range(2):
                out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, check=True)
                rows.append(__import__('json').loads(out.stdout.strip().splitlines()[-1]))
    first = [r for r in rows if not r['cached']]
    cached = [r for r in rows if r['cached']]
    print('| load of the embedded SmolLM2 | runs | load_model s (median) | whole process s (median) |')
    print('|------------------------------|------|-----------------------|--------------------------|')
    for label, rs in (('first (convert + cache)', first), ('cached copy', cached)):
        print(f'| {label:<28} | {len(rs):4d} | {statistics.median(r["load_s"] for r in rs):21.2f} | '
              f'{statistics.median(r["process_s"] for r in rs):24.2f} |')
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--model', default='embedded', help="'embedded' (SmolLM2-135M), 'tiny', or a model directory")
    ap.add_argument('--n', type=int, default=8, help='conversations')
    ap.add_argument('--turns', type=int, default=3)
    ap.add_argument('--max-tokens', type=int, default=16)
    ap.add_argument('--repeats', type=int, default=3)
    ap.add_argument('--load', action='store_true', help='measure first vs cached load of the embedded model')
    ap.add_argument('--threads', type=int, default=0, help='torch threads (0: torch default); 1 is steadier on a '
                    'shared machine, where spinning OpenMP threads of several jobs slow each other down')
    args = ap.parse_args()
    if args.load:
        return measure_load(args.repeats)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from mtflow.backends.hf import HFBackend
    from mtflow.backends.models import load_model
    from mtflow.data import read_prompts

    if args.model == 'tiny':
        from tests.tiny_model import make_model, make_tokenizer

        tok = make_tokenizer()
        model, name = make_model(tok), 'tiny random Qwen2'
    else:
        loaded = load_model(args.model)
        model, tok, name = loaded.model, loaded.tokenizer, loaded.name
    timer = GenerateTimer(model)
    backend = HFBackend(model, tok, max_batch_size=args.n)
    prompts = read_prompts(None)
    convs = [copy.deepcopy(prompts[i % len(prompts)].messages) for i in range(args.n)]

    # warm-up (first generate call allocates), and the equality check
    plain_convs, plain_tokens = plain_rollout(model, tok, convs, args.turns, args.max_tokens)
    mt_convs, mt_tokens = mtflow_rollout(backend, convs, args.turns, args.max_tokens)
    same = plain_convs == mt_convs and plain_tokens == mt_tokens
    times: Dict[str, List[float]] = {'plain': [], 'mtflow': []}
    around: Dict[str, List[float]] = {'plain': [], 'mtflow': []}
    for _ in range(args.repeats):
        for path in ('plain', 'mtflow'):
            timer.seconds = 0.0
            t0 = time.perf_counter()
            if path == 'plain':
                plain_rollout(model, tok, convs, args.turns, args.max_tokens)
            else:
                mtflow_rollout(backend, convs, args.turns, args.max_tokens)
            wall = time.perf_counter() - t0
            times[path].append(wall)
            around[path].append(wall - timer.seconds)

    plain = statistics.median(times['plain'])
    mt = statistics.median(times['mtflow'])
    print(f'model: {name}, torch threads {torch.get_num_threads()}, {args.n} conversations x {args.turns} turns, '
          f'max_tokens {args.max_tokens}, greedy, {args.repeats} interleaved repeats (median)')
    print(f'same conversations and token counts in both paths: {"yes" if same else "NO"} ({plain_tokens} tokens)')
    print()
    # On a shared machine other jobs only ever add time, so the best run of each path is the
    # cleanest comparison; the median is shown too.
    best_plain = min(times['plain'])
    print('| path   | best s | median s | tokens/s (best) | vs plain, best | vs plain, median |')
    print('|--------|--------|----------|-----------------|----------------|------------------|')
    for label, med, runs in (('plain', plain, times['plain']), ('mtflow', mt, times['mtflow'])):
        best = min(runs)
        print(f'| {label:<6} | {best:6.3f} | {med:8.3f} | {plain_tokens / best:15.1f} | '
              f'{100 * (best / best_plain - 1):+13.1f}% | {100 * (med / plain - 1):+15.1f}% |')
    # The work outside model.generate (prompt rendering, padding, logprob gathering, decoding,
    # and for mtflow the executor, scheduler, accounting and trace): its extra cost in mtflow,
    # relative to the plain loop's whole wall time, is mtflow's overhead, free of generation noise.
    out_plain = statistics.median(around['plain'])
    out_mt = statistics.median(around['mtflow'])
    print()
    print('| outside generate (median s) | plain | mtflow | mtflow extra, % of plain wall (best) |')
    print('|-----------------------------|-------|--------|---------------------------------------|')
    print(f'| per rollout                 | {out_plain:5.3f} | {out_mt:6.3f} | '
          f'{100 * (out_mt - out_plain) / best_plain:+36.2f}% |')
    return 0 if same else 1


if __name__ == '__main__':
    sys.exit(main())
