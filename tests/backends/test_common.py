"""What every backend shares: how a request becomes a chat, how a RequestConfig is checked, and
how backends are found by name."""
import pytest

from mtflow import RequestConfig, RolloutInferRequest
from mtflow.backends import BackendError, make_backend, prepare_chat, sampling_options
from mtflow.backends.base import Backend


def _req(*messages, **kw):
    return RolloutInferRequest(messages=[dict(m) for m in messages], uuid='r1', **kw)


def test_new_turn_is_not_a_continuation():
    chat = prepare_chat(_req({'role': 'user', 'content': 'hi'}))
    assert chat.continuation is False
    assert chat.messages == [{'role': 'user', 'content': 'hi'}]


def test_last_assistant_message_is_continued():
    chat = prepare_chat(_req({'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'Let me'}))
    assert chat.continuation is True
    assert chat.messages[-1] == {'role': 'assistant', 'content': 'Let me'}


def test_placeholder_assistant_is_dropped_and_the_turn_is_new():
    request = _req({'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': None})
    chat = prepare_chat(request)
    assert chat.continuation is False
    assert chat.messages == [{'role': 'user', 'content': 'hi'}]
    assert len(request.messages) == 2, 'the request itself is never modified'


def test_placeholder_after_an_assistant_message_continues_that_message():
    chat = prepare_chat(
        _req({'role': 'user', 'content': 'q'}, {'role': 'assistant', 'content': 'a'}, {'role': 'assistant',
                                                                                       'content': None}))
    assert chat.continuation is True
    assert chat.messages[-1]['content'] == 'a'


def test_tools_and_template_kwargs_are_carried():
    tools = [{'type': 'function', 'function': {'name': 'calc', 'parameters': {}}}]
    chat = prepare_chat(_req({'role': 'user', 'content': 'q'}, tools=tools, chat_template_kwargs={'enable_thinking': 0}))
    assert chat.tools == tools
    assert chat.chat_template_kwargs == {'enable_thinking': 0}


def test_sampling_defaults_and_greedy():
    opts = sampling_options(None, default_max_tokens=77)
    assert opts.max_tokens == 77 and opts.temperature == 1.0 and not opts.greedy and not opts.logprobs
    opts = sampling_options(RequestConfig(temperature=0, max_tokens=5, stop=None, top_k=-1, seed=3), 10)
    assert opts.greedy and opts.max_tokens == 5 and opts.stop == () and opts.top_k == 0 and opts.seed == 3
    assert sampling_options({'top_logprobs': 2}, 10).logprobs, 'asking for alternatives implies logprobs'


@pytest.mark.parametrize('config, field', [
    (RequestConfig(n=2), 'request_config.n'),
    (RequestConfig(max_tokens=0), 'request_config.max_tokens'),
    (RequestConfig(temperature=-1), 'request_config.temperature'),
    (RequestConfig(top_p=0), 'request_config.top_p'),
    (RequestConfig(stop=['']), 'request_config.stop'),
    (RequestConfig(num_beams=4), 'request_config.num_beams'),
])
def test_bad_sampling_options_name_the_field(config, field):
    with pytest.raises(BackendError, match=field.replace('.', r'\.')):
        sampling_options(config, 16)


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(BackendError, match=r"unknown backend 'llamacpp'.*hf.*openai.*vllm.*scripted"):
        make_backend('llamacpp')


def test_unknown_option_lists_the_accepted_ones(tmp_path):
    script = tmp_path / 's.jsonl'
    script.write_text('"hi"\n')
    with pytest.raises(BackendError, match=r"no option\(s\) colour.*cycle"):
        make_backend('scripted', model=str(script), colour='red')


def test_an_empty_call_returns_at_once_without_generating():

    class Exploding(Backend):

        def generate(self, requests, options):
            raise AssertionError('must not be called')

    assert Exploding()([], RequestConfig(n=5)) == []
