"""Interruptible generation through an OpenAI-compatible server (``OpenAIBackend(resumable=True)``,
``mtflow/backends/openai_stream.py``): the local test server streams SSE chunks of a deterministic
toy model at a set pace, a trainer thread updates the weights mid-generation, the stream
(``on_update='resume'``) cuts each generation in flight (the client closes the response; the
server sees the disconnect and stops) and continues it from the exact ids it had, in token mode
(the prefix ids appended to the token prompt) and in chat mode (``continue_final_message``)."""
from __future__ import annotations

import asyncio
import time
from typing import List

import pytest

pytest.importorskip('httpx')
pytest.importorskip('transformers')

from mtflow import Executor, RequestConfig  # noqa: E402
from mtflow.backends.base import BackendError  # noqa: E402
from mtflow.backends.openai_server import OpenAIBackend  # noqa: E402
from mtflow.engine.resume import is_resumable  # noqa: E402
from tests.backends.chat_server import ChatServer, ToyLM  # noqa: E402
from tests.backends.resume_util import check_resumed, cut_midway, every, stream_with_updates  # noqa: E402
from tests.helpers import SaysLower, req  # noqa: E402
from tests.tiny_model import make_tokenizer  # noqa: E402

CONFIG = RequestConfig(temperature=0, max_tokens=24, logprobs=True)
UPDATES, EVERY_S = 6, 0.12



@pytest.fixture(scope='module')
def tok():
    return make_tokenizer()


def _client(server, tok, mode, **kw):
    extra = {'tokenizer': tok} if mode == 'tokens' else {}
    return OpenAIBackend(model='tiny-qwen2', base_url=server.base_url, prompt_mode=mode, resumable=True,
                         backoff=0.01, **extra, **kw)


def _requests() -> List:
    return [req(f'r{i}', {'role': 'user', 'content': f'guess {i}'}) for i in range(8)]


def _stream(tok, mode: str, updates: int):
    with ChatServer(None, lm=ToyLM(tok)) as server:
        server.stream_delay = 0.008
        with _client(server, tok, mode) as client:
            ex = Executor(SaysLower(), client.async_rollout_fn(), CONFIG, max_turns=3)
            reqs = _requests()
            got, stream = stream_with_updates(ex, [reqs[i:i + 2] for i in range(0, 8, 2)], updates, every(EVERY_S), 8)
            deadline = time.monotonic() + 5  # a handler notices a disconnect at its next write
            while any(e['outcome'] is None for e in server.streams) and time.monotonic() < deadline:
                time.sleep(0.01)
            return got, stream, list(server.streams), server.bodies


@pytest.mark.parametrize('mode', ['tokens', 'chat'])
def test_resume_through_the_server_equals_an_uninterrupted_run(tok, mode):
    ref, ref_stream, ref_log, _ = _stream(tok, mode, 0)
    assert ref_stream.stats['resumed_generations'] == 0 and all(e['outcome'] == 'finished' for e in ref_log)
    mine, stream, log, bodies = _stream(tok, mode, UPDATES)
    resumed = stream.stats['resumed_generations']
    assert resumed > 0
    aborted = [e for e in log if e['outcome'] == 'aborted']
    assert 1 <= len(aborted) <= resumed, (len(aborted), resumed)  # the cut calls' streams were closed ...
    assert all(e['sent'] < e['planned'] for e in aborted)  # ... and the server stopped them early
    assert sum(e['planned'] - e['sent'] for e in aborted) > 0
    assert len(ref) == 8
    assert check_resumed(ref, mine, turns=3) > 0  # some turn was sampled by two versions and still came out exact
    resumed_bodies = [b for b in bodies if b.get('continue_final_message')]
    if mode == 'chat':  # each turn starts with a user message: only a resumed call continues one
        assert resumed_bodies and all(b['messages'][-1]['role'] == 'assistant' and b['add_generation_prompt'] is False
                                      for b in resumed_bodies)
    else:  # token mode: the prefix ids went into the token prompt, never a chat continuation
        assert not resumed_bodies and all(b['stream'] is True and 'prompt' in b for b in bodies)


def test_the_backend_declares_itself_resumable(tok):
    with ChatServer(None, lm=ToyLM(tok)) as server:
        with _client(server, tok, 'tokens') as client:
            assert is_resumable(client.async_rollout_fn())
        with OpenAIBackend(model='tiny-qwen2', base_url=server.base_url, prompt_mode='chat') as plain:
            assert not is_resumable(plain.async_rollout_fn())
    with pytest.raises(BackendError, match="flavor 'openai' cannot"):
        OpenAIBackend(model='m', base_url='http://127.0.0.1:9/v1', flavor='openai', resumable=True)


@pytest.mark.parametrize('http_client', ['httpx', 'aiohttp'])
def test_a_cancelled_call_raises_generation_aborted_with_the_ids_so_far(tok, http_client):
    pytest.importorskip(http_client)
    lm = ToyLM(tok)

    def planned(content):
        text = tok.apply_chat_template([{'role': 'user', 'content': content}], tokenize=False, add_generation_prompt=True)
        return len(lm.generate(tok(text, add_special_tokens=False)['input_ids'], 24)[0])

    content = next(c for c in (f'guess {i}' for i in range(50)) if planned(c) == 24)  # one that runs to max_tokens
    with ChatServer(None, lm=lm) as server:
        server.stream_delay = 0.02
        with _client(server, tok, 'tokens', http_client=http_client) as client:
            r = req('c', {'role': 'user', 'content': content})

            partial = cut_midway(lambda: client.acall([r], CONFIG),
                                 lambda: bool(server.streams and server.streams[0]['sent'] >= 4))
            assert client.prompter.find_record(r)[0] is None, 'a cut call commits no turn to the token record'
            choice = partial.response.choices[0]
            whole = client.async_rollout_fn()  # the same request, uncut: the partial is its prefix
            full = asyncio.run(whole([req('c', {'role': 'user', 'content': content})], CONFIG))[0]
    n = len(choice.token_ids)
    assert 0 < n < 24
    ref = full.response.choices[0]
    assert choice.token_ids == ref.token_ids[:n]
    assert [c['logprob'] for c in choice.logprobs['content']] == [c['logprob'] for c in ref.logprobs['content']][:n]
    assert ref.message.content.startswith(choice.message.content)
    deadline = time.monotonic() + 5  # the handler notices the disconnect at its next write
    while server.streams[0]['outcome'] is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.streams[0]['outcome'] == 'aborted' and server.streams[0]['sent'] < server.streams[0]['planned']


@pytest.mark.parametrize('how', ['error', 'drop'])
def test_a_broken_stream_fails_only_its_request(tok, how):
    with ChatServer(None, lm=ToyLM(tok)) as server:
        server.stream_delay = 0.002
        server.break_streams = [(3, how)]
        with _client(server, tok, 'tokens', max_retries=0) as client:
            result = Executor(SaysLower(), client.async_rollout_fn(), CONFIG, max_turns=1, on_error='return',
                              mode='async').run([req('only', {'role': 'user', 'content': 'guess 0'})])
            assert result.finish_reasons == ['error']
            message = str(result.outputs[0].rollout_infos)
            want = 'failed mid-stream after 3 token' if how == 'error' else 'broke after 3 token'
            assert want in message and "'only'" in message, message
            again = Executor(SaysLower(), client.async_rollout_fn(), CONFIG, max_turns=1, on_error='return',
                             mode='async').run([req(f'ok{i}', {'role': 'user', 'content': 'guess 0'}) for i in range(3)])
    assert again.finish_reasons == ['max_turns'] * 3


def test_a_server_that_does_not_stream_is_a_clear_error(tok):
    with ChatServer(None) as server:  # no lm: it answers stream: true with one JSON body
        server.complete = lambda body: (200, {'id': 'x', 'model': 'tiny-qwen2', 'choices': [
            {'index': 0, 'message': {'role': 'assistant', 'content': 'hi'}, 'finish_reason': 'stop'}]})
        with _client(server, tok, 'chat') as client:
            result = Executor(SaysLower(), client.async_rollout_fn(), CONFIG, max_turns=1, on_error='return',
                              mode='async').run([req('nostream')])
    assert result.finish_reasons == ['error']
    message = str(result.outputs[0].rollout_infos)
    assert "request 'nostream'" in message and 'needs a server that streams' in message, message
