"""What a client asks beyond the messages, honoured or refused with a 400 that says so: logprobs
and top logprobs, ``tool_choice`` (``none`` honoured, a forced call checked), ``response_format``;
the reasoning split from the content in each API and found again when the client sends the
answer back without it; images through the multimodal path, stored once, exact ids; and mtflow's
own ``openai`` backend naming each request's session to the gateway in front of it."""
from __future__ import annotations

import base64
import json
import io
import os

import anthropic
import httpx
import pytest

from mtflow import RequestConfig
from mtflow.gateway import Gateway
from mtflow.run.agent_config import GatewayConfig
from tests.gateway.helpers import ADD_TOOL, CALLS_ADD, TIMEOUT_S, assert_tokens_exact, lines, scripted

openai = pytest.importorskip('openai')
ASK = [{'role': 'user', 'content': 'What is 2 + 3?'}]


def _client(gw: Gateway, session: str) -> 'openai.OpenAI':
    return openai.OpenAI(base_url=gw.base_url(session), api_key='unused', max_retries=0, timeout=TIMEOUT_S)


def test_logprobs_and_top_logprobs_when_asked(tmp_path):
    pytest.importorskip('torch')
    from mtflow.backends.hf import HFBackend
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    backend = HFBackend(make_model(tok, max_position_embeddings=2048), tok, seed=0)
    with Gateway(backend, tmp_path / 'run', request_config=RequestConfig(max_tokens=8)) as gw:
        plain = _client(gw, 'a').chat.completions.create(model='m', messages=ASK)
        assert plain.choices[0].logprobs is None  # not asked: none sent
        asked = _client(gw, 'b').chat.completions.create(model='m', messages=ASK, logprobs=True, top_logprobs=2)
        items = asked.choices[0].logprobs.content
        assert len(items) == asked.usage.completion_tokens and all(len(i.top_logprobs) == 2 for i in items)
        assert all(i.logprob <= 0 and i.top_logprobs[0].logprob >= i.top_logprobs[1].logprob for i in items)
        response = _client(gw, 'c').responses.create(model='m', input='Hi.', top_logprobs=3,
                                                     include=['message.output_text.logprobs'])
        part = response.output[-1].content[0]
        assert len(part.logprobs) == response.usage.output_tokens and len(part.logprobs[0].top_logprobs) == 3
        bad = httpx.post(f'{gw.base_url("d")}/chat/completions', json={'model': 'm', 'messages': ASK,
                                                                        'top_logprobs': 2}, timeout=TIMEOUT_S)
        assert bad.status_code == 400 and bad.json()['error']['param'] == 'top_logprobs'
        for name in 'abc':
            gw.finish(name)
    assert_tokens_exact(tmp_path / 'run', segments=3)


def test_tool_choice_none_is_honoured_and_a_forced_call_is_checked(tmp_path):
    backend = scripted({'uuid': 'none', 'content': CALLS_ADD}, {'uuid': 'req', 'content': CALLS_ADD},
                       {'uuid': 'req', 'content': 'No call.'}, {'uuid': 'named', 'content': CALLS_ADD})
    with Gateway(backend, tmp_path / 'run') as gw:
        none = _client(gw, 'none').chat.completions.create(model='m', messages=ASK, tools=[ADD_TOOL],
                                                           tool_choice='none').choices[0]
        assert none.message.tool_calls is None and none.message.content == CALLS_ADD and none.finish_reason == 'stop'
        client = _client(gw, 'req')
        forced = client.chat.completions.create(model='m', messages=ASK, tools=[ADD_TOOL], tool_choice='required')
        assert forced.choices[0].message.tool_calls[0].function.name == 'add'
        with pytest.raises(openai.BadRequestError, match='asked for a tool call and the model.s reply .turn 2. made none'):
            client.chat.completions.create(model='m', messages=ASK + [{'role': 'user', 'content': 'again'}],
                                           tools=[ADD_TOOL], tool_choice='required')
        messages = anthropic.Anthropic(base_url=gw.base_url('named', 'anthropic'), api_key='unused', max_retries=0,
                                       timeout=TIMEOUT_S)
        with pytest.raises(anthropic.BadRequestError, match="a call of 'sub'"):
            messages.messages.create(model='m', max_tokens=32, messages=ASK, tool_choice={'type': 'tool', 'name': 'sub'},
                                     tools=[{'name': 'add', 'input_schema': ADD_TOOL['function']['parameters']},
                                            {'name': 'sub', 'input_schema': {'type': 'object'}}])
        odd = httpx.post(f'{gw.base_url("x")}/chat/completions', json={'model': 'm', 'messages': ASK,
                                                                        'tool_choice': 'sometimes'}, timeout=TIMEOUT_S)
        assert odd.status_code == 400 and odd.json()['error']['code'] == 'unsupported_tool_choice'
        fmt = httpx.post(f'{gw.base_url("x")}/chat/completions', json={
            'model': 'm', 'messages': ASK, 'response_format': {'type': 'json_schema', 'json_schema': {'name': 'n'}}},
            timeout=TIMEOUT_S)
        assert fmt.status_code == 400 and fmt.json()['error']['param'] == 'response_format.type'
        assert 'cannot constrain its output' in fmt.json()['error']['message']
        for name in ('none', 'req', 'named'):
            gw.finish(name)
    by_uuid = {line['uuid']: line for line in lines(tmp_path / 'run')}
    assert by_uuid['req']['num_turns'] == 2  # the unmet reply is in the trajectory: the model sampled it
    assert 'x' not in by_uuid  # refused before any model call


def test_reasoning_is_split_in_every_api_and_found_again_when_sent_back_without_it(tmp_path):
    thought = '<think>Add them.</think>Five.'
    with Gateway(scripted(thought, 'Anything else?'), tmp_path / 'run') as gw:
        client = _client(gw, 'chat')
        message = client.chat.completions.create(model='m', messages=ASK).choices[0].message
        assert (message.content, (message.model_extra or {})['reasoning_content']) == ('Five.', 'Add them.')
        client.chat.completions.create(model='m', messages=ASK + [{'role': 'assistant', 'content': 'Five.'},
                                                                  {'role': 'user', 'content': 'Thanks.'}])
        claude = anthropic.Anthropic(base_url=gw.base_url('claude', 'anthropic'), api_key='unused', max_retries=0,
                                     timeout=TIMEOUT_S)
        answer = claude.messages.create(model='m', max_tokens=32, messages=ASK)
        assert [(b.type, getattr(b, 'thinking', None) or getattr(b, 'text', None)) for b in answer.content] == \
            [('thinking', 'Add them.'), ('text', 'Five.')]
        history = ASK + [{'role': 'assistant', 'content': [b.model_dump(exclude_none=True) for b in answer.content]},
                         {'role': 'user', 'content': 'Thanks.'}]
        claude.messages.create(model='m', max_tokens=32, messages=history)
        for name in ('chat', 'claude'):
            gw.finish(name)
    assert_tokens_exact(tmp_path / 'run', segments=2)  # each client sent the answer back: one exact segment each
    with Gateway(scripted(thought), tmp_path / 'none', settings=GatewayConfig(reasoning='none')) as gw:
        message = _client(gw, 'raw').chat.completions.create(model='m', messages=ASK).choices[0].message
        assert message.content == thought and 'reasoning_content' not in (message.model_extra or {})
        gw.finish('raw')


def _png(color: tuple) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new('RGB', (40, 40), color).save(buf, format='PNG')
    return 'data:image/png;base64,' + base64.b64encode(buf.getvalue()).decode()


def test_images_reach_a_vision_model_stored_once_with_exact_ids(tmp_path):
    pytest.importorskip('torch')
    from mtflow.backends.hf import HFBackend
    from tests.tiny_vlm import make_vlm

    model, processor = make_vlm()
    red, blue = _png((200, 0, 0)), _png((0, 0, 200))
    with Gateway(HFBackend(model, processor=processor, seed=0), tmp_path / 'run',
                 request_config=RequestConfig(max_tokens=6)) as gw:
        client = _client(gw, 'look')
        messages = [{'role': 'user', 'content': [{'type': 'text', 'text': 'What is this? '},
                                                  {'type': 'image_url', 'image_url': {'url': red}}]}]
        first = client.chat.completions.create(model='m', messages=messages).choices[0].message
        messages += [{'role': 'assistant', 'content': first.content},
                     {'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': blue}},
                                                  {'type': 'text', 'text': ' And this, next to '},
                                                  {'type': 'image_url', 'image_url': {'url': red}}]}]
        client.chat.completions.create(model='m', messages=messages)
        remote = httpx.post(f'{gw.base_url("look")}/chat/completions', json={'model': 'm', 'messages': [
            {'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': 'https://example.com/a.png'}}]}]},
            timeout=TIMEOUT_S)
        assert remote.status_code == 400 and 'remote images are not fetched' in remote.json()['error']['message']
        gw.finish('look', reward=1.0)
    [line] = lines(tmp_path / 'run')
    assert len(line['images']) == 3 and line['images'][0] == line['images'][2]  # red twice, one file
    assert sorted(os.listdir(tmp_path / 'run' / 'images')) == sorted({p.split('/')[-1] for p in line['images']})
    assert line['messages'][0]['content'] == 'What is this? <image>'
    assert_tokens_exact(tmp_path / 'run', segments=1)


def test_the_openai_backend_names_each_requests_session_to_a_gateway_in_front(tmp_path):
    """mtflow as the client of a gateway: each request of a run is its own session there, by the
    ``X-Session-ID`` header the backend sends (two requests, two sessions; nothing in the URL)."""
    from mtflow import Executor, RolloutInferRequest, Scheduler
    from mtflow.backends.openai_server import OpenAIBackend

    with Gateway(scripted('from the gateway'), tmp_path / 'front') as gw:
        with pytest.warns(UserWarning, match='re-render'):  # chat completions: the gateway in front renders
            backend = OpenAIBackend('m', f'{gw.url}/v1', prompt_mode='chat', flavor='openai', max_retries=0)
        try:
            requests = [RolloutInferRequest(uuid=f'req-{k}', messages=[{'role': 'user', 'content': f'task {k}'}])
                        for k in range(2)]
            result = Executor(Scheduler(max_turns=1), backend, max_turns=1).run(requests)
        finally:
            backend.close()
        assert [o.response.choices[0].message.content for o in result.outputs] == ['from the gateway'] * 2
        assert sorted(gw.table.sessions) == ['req-0', 'req-1']
        for k in range(2):
            gw.finish(f'req-{k}')
    with pytest.raises(Exception, match='session_header must be an HTTP header name'):
        OpenAIBackend('m', 'http://127.0.0.1:9/v1', prompt_mode='chat', flavor='openai', session_header='X Bad')


def test_a_servers_structured_calls_and_reasoning_reach_the_client(tmp_path):
    """An ``openai`` backend in chat mode in front of a server that parses the calls and the
    reasoning itself (``vllm serve --enable-auto-tool-choice --tool-call-parser hermes
    --reasoning-parser qwen3``): the content the server returns holds neither, so the gateway
    passes on the server's ``tool_calls`` and ``reasoning_content``. (Before, the client got an
    empty answer with no call, finish ``stop``, and its agent ended at turn 1 without a word.)"""
    from mtflow.backends.openai_server import OpenAIBackend
    from mtflow.backends.scripted import ScriptedBackend
    from tests.backends.chat_server import ChatServer
    from tests.tiny_model import make_tokenizer

    def respond(request):
        if request.messages[-1]['role'] == 'tool':
            return f'<think>It returned {request.messages[-1]["content"]}.</think>The sum is 5.'
        return '<think>I should add.</think>' + CALLS_ADD.replace('I will add them.\n', '')

    server_model = ScriptedBackend(respond=respond, tokenizer=make_tokenizer())
    with ChatServer(server_model, model_name='m', tool_call_parser='hermes', reasoning_field='reasoning_content') \
            as server, pytest.warns(UserWarning, match='chat completions re-render'):
        backend = OpenAIBackend('m', server.base_url, prompt_mode='chat', flavor='openai', max_retries=0,
                                server_tool_calls=True)
        with backend, Gateway(backend, tmp_path / 'run', request_config=RequestConfig(max_tokens=64)) as gw:
            client = _client(gw, 's')
            first = client.chat.completions.create(model='m', messages=ASK, tools=[ADD_TOOL]).choices[0]
            assert first.finish_reason == 'tool_calls' and not first.message.content
            call = first.message.tool_calls[0]
            assert (call.function.name, json.loads(call.function.arguments)) == ('add', {'a': 2, 'b': 3})
            assert first.message.model_extra.get('reasoning_content') == 'I should add.'
            back = ASK + [first.message.model_dump(exclude_none=True),
                          {'role': 'tool', 'tool_call_id': call.id, 'content': '5'}]
            second = client.chat.completions.create(model='m', messages=back, tools=[ADD_TOOL]).choices[0]
            assert second.finish_reason == 'stop' and second.message.content == 'The sum is 5.'
            assert second.message.model_extra.get('reasoning_content') == 'It returned 5.'
            assert httpx.post(f'{gw.url}/s/s/finish', json={'reward': 1}, timeout=TIMEOUT_S).status_code == 200
    (line, ) = lines(tmp_path / 'run')
    assert line['num_turns'] == 2 and line['finish_reason'] == 'client_finished'
