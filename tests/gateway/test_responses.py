"""The OpenAI Responses API through the gateway, with the ``openai`` client unchanged: instructions,
a function tool, the model's reasoning as a ``reasoning`` item, ``function_call`` /
``function_call_output`` items sent back, streaming events, ``previous_response_id`` continuing
the conversation the gateway kept; every call extends the model's own ids (one exact segment)."""
from __future__ import annotations

import json

import httpx
import pytest

from mtflow import RequestConfig
from mtflow.gateway import Gateway
from tests.gateway.helpers import ADD_TOOL, CALLS_ADD, TIMEOUT_S, assert_tokens_exact, lines, scripted

openai = pytest.importorskip('openai')

ADD = {'type': 'function', 'name': 'add', 'description': 'add two integers',
       'parameters': ADD_TOOL['function']['parameters']}


def test_a_tool_call_round_trip_streamed_and_continued_by_previous_response_id(tmp_path):
    backend = scripted('<think>I should add.</think>' + CALLS_ADD, 'It is 5.', '<think>done</think>Bye.')
    with Gateway(backend, tmp_path / 'run', request_config=RequestConfig(max_tokens=64)) as gw:
        client = openai.OpenAI(base_url=gw.base_url('ep'), api_key='unused', max_retries=0, timeout=TIMEOUT_S)
        first = client.responses.create(model='m', instructions='You add.', input='What is 2 + 3?', tools=[ADD])
        assert [o.type for o in first.output] == ['reasoning', 'message', 'function_call']
        reasoning, message, call = first.output
        assert reasoning.content[0].text == 'I should add.' and message.content[0].text == 'I will add them.'
        assert (call.name, json.loads(call.arguments)) == ('add', {'a': 2, 'b': 3}) and first.status == 'completed'
        assert first.usage.output_tokens > 0 and first.usage.input_tokens > 0
        items = [{'role': 'user', 'content': 'What is 2 + 3?'}] + [o.model_dump(exclude_none=True) for o in first.output]
        items.append({'type': 'function_call_output', 'call_id': call.call_id, 'output': '5'})
        with client.responses.stream(model='m', instructions='You add.', input=items, tools=[ADD]) as events:
            kinds = [event.type for event in events]
            second = events.get_final_response()
        assert kinds[:2] == ['response.created', 'response.in_progress'] and kinds[-1] == 'response.completed'
        assert 'response.output_text.delta' in kinds and second.output_text == 'It is 5.'
        third = client.responses.create(model='m', instructions='You add.', input='Thanks.', tools=[ADD],
                                        previous_response_id=second.id)
        assert third.output_text == 'Bye.' and third.previous_response_id == second.id
        done = httpx.post(f'{gw.url}/s/ep/finish', json={'reward': 1.0}, timeout=TIMEOUT_S).json()
    assert (done['turns'], done['segments']) == (3, 1)
    [line] = lines(tmp_path / 'run')
    roles = [m['role'] for m in line['messages']]
    assert roles == ['system', 'user', 'assistant', 'tool', 'assistant', 'user', 'assistant']
    assert line['messages'][2]['content'] == '<think>I should add.</think>' + CALLS_ADD  # the model's own text
    assert_tokens_exact(tmp_path / 'run', segments=1)


def test_previous_response_id_alone_names_the_session_and_store_false_keeps_nothing(tmp_path):
    with Gateway(scripted('one', 'two', 'three'), tmp_path / 'run') as gw:
        client = openai.OpenAI(base_url=f'{gw.url}/v1', api_key='unused', max_retries=0, timeout=TIMEOUT_S,
                               default_headers={'X-Session-ID': 'by-header'})
        first = client.responses.create(model='m', input='Start.')
        bare = openai.OpenAI(base_url=f'{gw.url}/v1', api_key='unused', max_retries=0, timeout=TIMEOUT_S)
        second = bare.responses.create(model='m', input='Go on.', previous_response_id=first.id)
        assert second.output_text == 'two'
        unkept = client.responses.create(model='m', input='Again.', previous_response_id=second.id, store=False)
        with pytest.raises(openai.NotFoundError, match='no response .* is kept'):
            client.responses.create(model='m', input='More.', previous_response_id=unkept.id)
        gw.finish('by-header', reward=0.5)
    [line] = lines(tmp_path / 'run')
    assert line['uuid'] == 'by-header' and line['num_turns'] == 3
    assert [m['content'] for m in line['messages']] == ['Start.', 'one', 'Go on.', 'two', 'Again.', 'three']
    assert_tokens_exact(tmp_path / 'run', segments=1)


def test_a_previous_response_of_another_session_is_refused(tmp_path):
    """A call naming session B that continued a response of session A was answered 200: A's
    conversation joined B's trajectory (a new segment, B's reward), without a word."""
    with Gateway(scripted('one', 'two', 'three'), tmp_path / 'run') as gw:
        first = httpx.post(f'{gw.base_url("A")}/responses', json={'model': 'm', 'input': 'hi A'}, timeout=TIMEOUT_S).json()
        httpx.post(f'{gw.base_url("B")}/responses', json={'model': 'm', 'input': 'hi B'}, timeout=TIMEOUT_S)
        for url, headers in ((f'{gw.base_url("B")}/responses', {}), (f'{gw.url}/v1/responses', {'X-Session-ID': 'B'})):
            crossed = httpx.post(url, headers=headers, json={'model': 'm', 'input': 'more', 'previous_response_id':
                                                              first['id']}, timeout=TIMEOUT_S)
            assert crossed.status_code == 400
            error = crossed.json()['error']
            assert error['code'] == 'session_mismatch' and error['param'] == 'previous_response_id'
            assert f"{first['id']!r} is a response of session 'A', not of 'B'" in error['message']
        gw.finish('A', reward=1.0)
        gw.finish('B', reward=0.0)
    by_uuid = {line['uuid']: line for line in lines(tmp_path / 'run')}
    assert [m['content'] for m in by_uuid['B']['messages']] == ['hi B', 'two']


def test_a_function_call_output_without_its_call_id_is_refused(tmp_path):
    """It became a tool message answering the call '' (200, the model shown a result of no call)."""
    with Gateway(scripted('ok'), tmp_path / 'run') as gw:
        answer = httpx.post(f'{gw.base_url("s")}/responses', timeout=TIMEOUT_S, json={'model': 'm', 'input': [
            {'role': 'user', 'content': 'x'}, {'type': 'function_call_output', 'output': '5'}]})
        assert answer.status_code == 400 and answer.json()['error']['param'] == 'input.1.call_id'


def test_what_the_responses_api_cannot_serve_is_said(tmp_path):
    with Gateway(scripted('ok'), tmp_path / 'run') as gw:
        url = f'{gw.base_url("bad")}/responses'

        def post(body):
            return httpx.post(url, json={'model': 'm', **body}, timeout=TIMEOUT_S)

        bad = post({'input': [{'type': 'computer_call_output', 'call_id': 'c'}]})
        assert bad.status_code == 400 and bad.json()['error']['param'] == 'input.0.type'
        assert 'not served by the gateway' in bad.json()['error']['message']
        bad = post({'input': 'x', 'text': {'format': {'type': 'json_schema', 'name': 'n', 'schema': {}}}})
        assert bad.status_code == 400 and bad.json()['error']['code'] == 'unsupported_response_format'
        bad = post({'input': 'x', 'conversation': 'conv_1'})
        assert bad.status_code == 400 and bad.json()['error']['param'] == 'conversation'
        bad = post({'input': [{'role': 'user', 'content': [{'type': 'input_image', 'image_url': 'https://x/y.png'}]}]})
        assert bad.status_code == 400 and 'remote images are not fetched' in bad.json()['error']['message']
        hosted = post({'input': 'x', 'tools': [ADD, {'type': 'web_search'}]})
        assert hosted.status_code == 200
        assert hosted.headers['x-mtflow-warning'].startswith('tools not offered to the model: web_search')
        assert hosted.json()['tools'][1] == {'type': 'web_search'}  # echoed as sent
        gw.finish('bad')
