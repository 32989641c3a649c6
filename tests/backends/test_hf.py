"""The transformers backend with a tiny random Qwen2 and a BPE tokenizer trained on the fly:
real chat templates, real batched ``generate``, logprobs checked against a plain forward pass."""
import copy

import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')

from mtflow import Executor, RequestConfig, RolloutInferRequest, Scheduler  # noqa: E402
from mtflow.accounting import ContractAccounting  # noqa: E402
from mtflow.backends import BackendError, make_backend  # noqa: E402
from mtflow.backends.hf import HFBackend, render_prompt  # noqa: E402
from tests.tiny_model import make_model, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.hf

GREEDY = dict(temperature=0, max_tokens=12, logprobs=True)
# a random tiny model repeats one token under greedy decoding; seeded sampling gives varied text
SAMPLED = dict(temperature=1.0, max_tokens=12, logprobs=True, seed=3)


@pytest.fixture(scope='module')
def tok():
    return make_tokenizer()


@pytest.fixture(scope='module')
def model(tok):
    return make_model(tok, seed=1)


@pytest.fixture
def backend(model, tok):
    return HFBackend(model, tok)


def _req(uuid, *messages, **kw):
    return RolloutInferRequest(messages=[dict(m) for m in messages], uuid=uuid, **kw)


def _user(uuid, text='guess a number between 1 and 100'):
    return _req(uuid, {'role': 'user', 'content': text})


def _choice(output):
    return output.response.choices[0]


def _forward_logprobs(model, prompt, ids):
    full = torch.tensor([list(prompt) + list(ids)])
    with torch.no_grad():
        logits = model(full).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)]


def test_greedy_ids_and_logprobs_match_a_plain_forward_pass(backend, model, tok):
    request = _user('a')
    out = backend([request], RequestConfig(**GREEDY))[0]
    choice = _choice(out)
    prompt = render_prompt(tok, request)
    assert choice.finish_reason == 'length' and len(choice.token_ids) == 12
    logprobs = [item['logprob'] for item in choice.logprobs['content']]
    assert logprobs == pytest.approx(_forward_logprobs(model, prompt, choice.token_ids), abs=1e-4)
    # greedy: every sampled token is the argmax of its step
    full = torch.tensor([prompt + choice.token_ids])
    with torch.no_grad():
        argmax = model(full).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
    assert argmax == choice.token_ids
    assert choice.message.content == tok.decode(choice.token_ids, skip_special_tokens=True)
    assert [item['token'] for item in choice.logprobs['content']] == [tok.decode([t]) for t in choice.token_ids]
    assert out.response.usage.prompt_tokens == len(prompt)
    assert out.response.usage.completion_tokens == 12
    assert out.response.prompt_token_ids == prompt


def test_a_left_padded_batch_gives_what_each_request_gives_alone(backend):
    requests = [_user('short', 'hi'), _user('long', 'please guess a number between 1 and 100, lower or higher'),
                _user('mid', 'guess a number')]
    batch = backend(copy.deepcopy(requests), RequestConfig(**GREEDY))
    for request, out in zip(requests, batch):
        alone = _choice(backend([request], RequestConfig(**GREEDY))[0])
        assert _choice(out).token_ids == alone.token_ids, request.uuid
        got = [i['logprob'] for i in _choice(out).logprobs['content']]
        assert got == pytest.approx([i['logprob'] for i in alone.logprobs['content']], abs=1e-4)


def test_micro_batches_return_outputs_in_request_order(model, tok):
    small = HFBackend(model, tok, max_batch_size=2)
    requests = [_user(f'r{i}', 'guess ' * (i + 1)) for i in range(5)]
    outs = small(requests, RequestConfig(**GREEDY))
    whole = HFBackend(model, tok)(requests, RequestConfig(**GREEDY))
    assert [_choice(o).token_ids for o in outs] == [_choice(o).token_ids for o in whole]
    assert small.stats.calls == 1 and small.stats.requests == 5 and small.stats.completion_tokens == 60


def test_eos_ends_a_row_with_stop_and_keeps_the_eos_token(model, tok):
    free = _choice(HFBackend(model, tok)([_user('a')], RequestConfig(**SAMPLED))[0])
    k = next(i for i in range(2, 12) if free.token_ids[i] not in free.token_ids[:i])
    eos = free.token_ids[k]
    m = copy.deepcopy(model)
    m.generation_config.eos_token_id = eos
    choice = _choice(HFBackend(m, tok)([_user('a')], RequestConfig(**SAMPLED))[0])
    assert choice.finish_reason == 'stop'
    assert choice.token_ids == free.token_ids[:k + 1], 'the EOS token is part of the sampled ids'
    assert len(choice.logprobs['content']) == k + 1
    assert choice.message.content == tok.decode(free.token_ids[:k], skip_special_tokens=True)


def test_a_stop_string_cuts_the_text_before_it_and_the_ids_after_it(backend, tok):
    free = _choice(backend([_user('a')], RequestConfig(**SAMPLED))[0])
    text = free.message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip() and stop in text
    choice = _choice(backend([_user('a')], RequestConfig(**SAMPLED, stop=[stop]))[0])
    assert choice.finish_reason == 'stop'
    assert choice.message.content == text[:text.index(stop)]
    k = len(choice.token_ids)
    assert choice.token_ids == free.token_ids[:k]
    assert stop in tok.decode(free.token_ids[:k]) and stop not in tok.decode(free.token_ids[:k - 1])
    assert len(choice.logprobs['content']) == k


def test_stop_strings_never_match_inside_the_prompt(backend):
    prompt_word = 'guess'
    free = _choice(backend([_user('a')], RequestConfig(**SAMPLED))[0])
    assert prompt_word not in free.message.content
    choice = _choice(backend([_user('a')], RequestConfig(**SAMPLED, stop=[prompt_word]))[0])
    assert choice.finish_reason == 'length' and choice.token_ids == free.token_ids


def test_continuation_continues_the_assistant_message_without_a_new_prompt(backend, tok):
    history = [{'role': 'user', 'content': 'guess a number'}, {'role': 'assistant', 'content': 'I guess 4'}]
    cont = render_prompt(tok, _req('c', *history))
    assert tok.decode(cont).endswith('<|im_start|>assistant\nI guess 4')
    fresh = render_prompt(tok, _req('c', *history, {'role': 'user', 'content': 'higher'}))
    assert tok.decode(fresh).endswith('<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n')
    placeholder = render_prompt(tok, _req('p', history[0], {'role': 'assistant', 'content': None}))
    assert placeholder == render_prompt(tok, _req('p', history[0]))
    out = _choice(backend([_req('c', *history)], RequestConfig(**GREEDY))[0])
    assert out.token_ids and out.message.content == tok.decode(out.token_ids, skip_special_tokens=True)


TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
                  "<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                  "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                  "<|im_start|>assistant\n{% endif %}")


def test_the_chat_template_receives_the_request_tools(model, tok):
    tools = [{'type': 'function', 'function': {'name': 'calculator', 'parameters': {}}}]
    request = _req('t', {'role': 'user', 'content': 'add'}, tools=tools)
    with_tools = tok.decode(render_prompt(tok, request, chat_template=TOOLS_TEMPLATE))
    assert with_tools.startswith('<|im_start|>system\nTOOLS: calculator<|im_end|>')
    backend = HFBackend(model, tok, chat_template=TOOLS_TEMPLATE)
    out = backend([request], RequestConfig(**GREEDY))[0]
    assert out.response.prompt_token_ids == render_prompt(tok, request, chat_template=TOOLS_TEMPLATE)


def test_processed_logprobs_are_of_the_tempered_distribution(model, tok):
    request = _user('a')
    raw = HFBackend(model, tok)
    processed = HFBackend(model, tok, logprobs_mode='processed')
    config = RequestConfig(temperature=0.5, max_tokens=6, logprobs=True, seed=11)
    a = _choice(raw([request], config)[0])
    b = _choice(processed([request], config)[0])
    assert a.token_ids == b.token_ids, 'the same seed samples the same tokens'
    prompt = render_prompt(tok, request)
    full = torch.tensor([prompt + a.token_ids])
    with torch.no_grad():
        logits = model(full).logits[0, len(prompt) - 1:-1].float()
    tempered = torch.log_softmax(logits / 0.5, -1).gather(1, torch.tensor(a.token_ids)[:, None]).squeeze(1)
    plain = torch.log_softmax(logits, -1).gather(1, torch.tensor(a.token_ids)[:, None]).squeeze(1)
    assert [i['logprob'] for i in b.logprobs['content']] == pytest.approx(tempered.tolist(), abs=1e-4)
    assert [i['logprob'] for i in a.logprobs['content']] == pytest.approx(plain.tolist(), abs=1e-4)


def test_top_logprobs_list_the_best_alternatives(backend):
    choice = _choice(backend([_user('a')], RequestConfig(temperature=0, max_tokens=3, top_logprobs=3))[0])
    for item in choice.logprobs['content']:
        top = item['top_logprobs']
        assert len(top) == 3 and top[0]['logprob'] >= top[1]['logprob'] >= top[2]['logprob']
        assert item['logprob'] == pytest.approx(top[0]['logprob'], abs=1e-6), 'greedy picks the best'


def test_no_logprobs_unless_asked(backend):
    choice = _choice(backend([_user('a')], RequestConfig(temperature=0, max_tokens=3))[0])
    assert choice.logprobs is None and len(choice.token_ids) == 3


def test_a_seed_makes_sampling_repeatable(backend):
    config = RequestConfig(temperature=1.0, max_tokens=8, seed=5)
    first = _choice(backend([_user('a')], config)[0]).token_ids
    second = _choice(backend([_user('a')], config)[0]).token_ids
    other = _choice(backend([_user('a')], RequestConfig(temperature=1.0, max_tokens=8, seed=6))[0]).token_ids
    assert first == second and first != other


def test_bad_options_are_clear_errors(model, tok):
    with pytest.raises(BackendError, match='logprobs_mode'):
        HFBackend(model, tok, logprobs_mode='final')
    with pytest.raises(BackendError, match='needs its tokenizer'):
        HFBackend(model)
    with pytest.raises(BackendError, match='model directory not found'):
        make_backend('hf', model='./no/such/model')


class _Echo(Scheduler):
    """Turn 1 is answered by a user message, turn 2 by the model continuing its own message; the
    sampled ids of each turn go into the trajectory (the contract collects them from the step)."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return False  # outputs end by length here; only max_turns stops

    def step(self, infer_request, response_choice, current_turn):
        if current_turn == 1:
            infer_request.messages.append({'role': 'user', 'content': 'higher'})
        else:
            infer_request.messages[-1]['content'] += ' so'
        ids = response_choice.token_ids
        return {'infer_request': infer_request, 'response_token_ids': ids, 'response_loss_mask': [1] * len(ids)}


def test_multi_turn_under_the_executor_keeps_ids_and_logprobs_aligned(backend):
    requests = [_user('a'), _user('b', 'hi')]
    # the contract's accounting, named (the native default takes the ids from the token record,
    # tests/backends/test_tokens.py): the ids the step returned, aligned with the logprobs
    result = Executor(_Echo(), backend, RequestConfig(temperature=1.0, max_tokens=5, logprobs=True, seed=0),
                      max_turns=3, accounting=ContractAccounting()).run(requests)
    assert result.ok and result.finish_reasons == ['max_turns', 'max_turns']
    for out in result.outputs:
        assert [m['role'] for m in out.messages] == ['user', 'assistant', 'user', 'assistant']
        assert out.rollout_infos['num_turns'] == 3
        ids = [i for seg in out.response_token_ids for i in seg]
        assert len(ids) == 15 and sum(len(s) for s in out.rollout_logprobs) == 15, 'the contract check kept them'
        assert all(lp <= 0 for seg in out.rollout_logprobs for lp in seg)
    path = result.trace.path('a')
    assert path.endswith('generating -> tool_step -> continuing -> finished(max_turns)')
