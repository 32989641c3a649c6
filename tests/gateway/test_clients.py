"""The plain ``openai`` client (streaming and not) and the ``anthropic`` client against a real gateway
server, unchanged: each call is a turn of its session, tool calls go out in the client's wire format
and come back as the model's exact text, and every segment passes ``mtflow check-tokens``."""
from __future__ import annotations

import json

import httpx
import pytest

from mtflow import RequestConfig
from mtflow.cli import main
from mtflow.gateway import Gateway
from tests.gateway.helpers import ADD_TOOL, CALLS_ADD, TIMEOUT_S, assert_tokens_exact, events, lines, scripted

openai = pytest.importorskip('openai')


def _finish(gw: Gateway, session: str, reward: float) -> dict:
    response = httpx.post(f'{gw.url}/s/{session}/finish', json={'reward': reward, 'info': {'tests': 1}},
                          timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize('stream', [False, True])
def test_openai_client_with_a_function_tool(tmp_path, stream):
    backend = scripted({'uuid': 'ep', 'turn': 1, 'content': CALLS_ADD},
                       {'uuid': 'ep', 'turn': 2, 'content': 'It is 5.'})
    with Gateway(backend, tmp_path / 'run', request_config=RequestConfig(max_tokens=64)) as gw:
        client = openai.OpenAI(base_url=gw.base_url('ep'), api_key='unused', timeout=TIMEOUT_S, max_retries=0)
        messages = [{'role': 'system', 'content': 'You add.'}, {'role': 'user', 'content': 'What is 2 + 3?'}]
        if stream:
            chunks = list(client.chat.completions.create(model='m', messages=messages, tools=[ADD_TOOL], stream=True))
            text = ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices)
            calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assistant = {'role': 'assistant', 'content': text,
                         'tool_calls': [{'id': tc.id, 'type': 'function', 'function': {
                             'name': tc.function.name, 'arguments': tc.function.arguments}} for tc in calls]}
            call_id, name, args = calls[0].id, calls[0].function.name, calls[0].function.arguments
        else:
            reply = client.chat.completions.create(model='m', messages=messages, tools=[ADD_TOOL])
            message = reply.choices[0].message
            finish, text = [reply.choices[0].finish_reason], message.content
            assistant = message.model_dump(exclude_none=True)
            call_id, name, args = message.tool_calls[0].id, message.tool_calls[0].function.name, \
                message.tool_calls[0].function.arguments
            assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 0
        assert finish == ['tool_calls'] and text == 'I will add them.'
        assert (name, json.loads(args)) == ('add', {'a': 2, 'b': 3})
        messages += [assistant, {'role': 'tool', 'tool_call_id': call_id, 'content': '5'}]
        second = client.chat.completions.create(model='m', messages=messages, tools=[ADD_TOOL], stream=stream)
        if stream:
            assert ''.join(c.choices[0].delta.content or '' for c in second if c.choices) == 'It is 5.'
        else:
            assert second.choices[0].message.content == 'It is 5.' and second.choices[0].finish_reason == 'stop'
        assert _finish(gw, 'ep', 1.0) == {'session': 'ep', 'finish_reason': 'client_finished', 'turns': 2,
                                          'segments': 1, 'reward': 1.0}
    [line] = lines(tmp_path / 'run')
    assert (line['finish_reason'], line['num_turns'], line['reward']) == ('client_finished', 2, 1.0)
    assert line['rollout_infos']['gateway_finish'] == {'tests': 1}
    # the model saw its own text, not the client's rendering of it: the second turn extended the first
    assert [m['content'] for m in line['messages'] if m['role'] == 'assistant'] == [CALLS_ADD, 'It is 5.']
    assert line['messages'][-2] == {'role': 'tool', 'content': '5', 'tool_call_id': call_id}
    assert 'context_segments' not in line['rollout_infos']
    assert_tokens_exact(tmp_path / 'run', segments=1)
    path = [(e['from'], e['to']) for e in events(tmp_path / 'run', 'ep')]
    assert path == [('pending', 'generating'), ('generating', 'tool_step'), ('tool_step', 'generating'),
                    ('generating', 'tool_step'), ('tool_step', 'finished')]
    steps = [e for e in events(tmp_path / 'run', 'ep') if e['from'] == 'tool_step']
    assert all(e['duration_s'] is not None and e['duration_s'] >= 0 for e in steps)  # the agent's own time


anthropic = pytest.importorskip('anthropic')


@pytest.mark.parametrize('stream', [False, True])
def test_anthropic_client_with_a_tool(tmp_path, stream):
    backend = scripted({'uuid': 'an', 'turn': 1, 'content': CALLS_ADD}, {'uuid': 'an', 'turn': 2, 'content': 'Five.'})
    tools = [{'name': 'add', 'description': 'add two integers', 'input_schema': ADD_TOOL['function']['parameters']}]
    with Gateway(backend, tmp_path / 'run', request_config=RequestConfig(max_tokens=64)) as gw:
        client = anthropic.Anthropic(base_url=gw.base_url('an', 'anthropic'), api_key='unused', timeout=TIMEOUT_S,
                                     max_retries=0)
        messages = [{'role': 'user', 'content': 'What is 2 + 3?'}]

        def ask() -> object:
            if not stream:
                return client.messages.create(model='m', max_tokens=64, system='You add.', messages=messages,
                                              tools=tools)
            with client.messages.stream(model='m', max_tokens=64, system='You add.', messages=messages,
                                        tools=tools) as events_:
                return events_.get_final_message()

        first = ask()
        assert first.stop_reason == 'tool_use'
        text, use = first.content
        assert text.text == 'I will add them.' and (use.name, use.input) == ('add', {'a': 2, 'b': 3})
        messages += [{'role': 'assistant', 'content': [b.model_dump(exclude_none=True) for b in first.content]},
                     {'role': 'user', 'content': [{'type': 'tool_result', 'tool_use_id': use.id, 'content': '5'}]}]
        second = ask()
        assert second.stop_reason == 'end_turn' and second.content[0].text == 'Five.'
        assert second.usage.output_tokens > 0
        _finish(gw, 'an', 0.25)
    [line] = lines(tmp_path / 'run')
    assert (line['num_turns'], line['reward']) == (2, 0.25)
    assert line['messages'][0] == {'role': 'system', 'content': line['messages'][0]['content']}
    assert line['messages'][0]['content'].startswith('You add.')  # the tools' text follows (tools_in_system)
    assert [m['content'] for m in line['messages'] if m['role'] == 'assistant'] == [CALLS_ADD, 'Five.']
    assert_tokens_exact(tmp_path / 'run', segments=1)


def test_a_real_model_streams_and_every_turn_is_exact(tmp_path, capsys):
    """The tiny random transformers model behind the gateway: real sampling, logprobs kept, three
    turns of the streaming client; the run directory passes ``mtflow check-tokens RUN_DIR``."""
    pytest.importorskip('torch')
    from mtflow.backends.hf import HFBackend
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    backend = HFBackend(make_model(tok, max_position_embeddings=2048), tok, seed=0)
    with Gateway(backend, tmp_path / 'run', request_config=RequestConfig(max_tokens=12, logprobs=True)) as gw:
        client = openai.OpenAI(base_url=gw.base_url('hf'), api_key='unused', timeout=TIMEOUT_S, max_retries=0)
        messages = [{'role': 'user', 'content': 'Say something.'}]
        for k in range(3):
            chunks = list(client.chat.completions.create(model='m', messages=messages, stream=True,
                                                         stream_options={'include_usage': True}))
            text = ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices)
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
            messages += [{'role': 'assistant', 'content': text}, {'role': 'user', 'content': f'Go on ({k}).'}]
        _finish(gw, 'hf', 0.0)
    [line] = lines(tmp_path / 'run')
    assert line['num_turns'] == 3 and line['rollout_infos']['token_record']['exact']
    assert sum(map(len, line['rollout_logprobs'])) == sum(map(sum, line['response_loss_mask'])) > 0
    assert_tokens_exact(tmp_path / 'run', segments=1)
    assert main(['check-tokens', str(tmp_path / 'run')]) == 0
    assert 'sampled' in capsys.readouterr().out
