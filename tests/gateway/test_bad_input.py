"""Bad input and faults: every refusal is the status an API client expects and names the field or
session; a fault in one session never costs another; a session's key opens only that session."""
from __future__ import annotations

import socket
import time

import httpx
import pytest

from mtflow import ContextBudget, RequestConfig
from mtflow.gateway import Gateway
from mtflow.run.agent_config import GatewayConfig
from tests.gateway.helpers import TIMEOUT_S, assert_tokens_exact, lines, scripted
from tests.tiny_model import make_tokenizer

HELLO = {'model': 'm', 'messages': [{'role': 'user', 'content': 'hello'}]}


def _post(url: str, body=None, **kw) -> httpx.Response:
    return httpx.post(url, json=body, timeout=TIMEOUT_S, **kw)


@pytest.fixture
def gw(tmp_path):
    with Gateway(scripted('fine', 'also fine'), tmp_path / 'run',
                 settings=GatewayConfig(max_body_bytes=4096), request_config=RequestConfig(max_tokens=16)) as gateway:
        yield gateway


def test_malformed_bodies_are_400s_that_name_the_field(gw):
    url = f'{gw.url}/s/a/v1/chat/completions'
    bad_json = httpx.post(url, content=b'{"model": "m", "messages": [', timeout=TIMEOUT_S)
    assert bad_json.status_code == 400
    assert 'not valid JSON at line 1 column' in bad_json.json()['error']['message']
    role = _post(url, {'model': 'm', 'messages': [{'role': 'robot', 'content': 'x'}]})
    assert role.status_code == 400 and role.json()['error']['param'] == 'messages.0.role'
    n = _post(url, {**HELLO, 'n': 2})
    assert n.status_code == 400 and n.json()['error']['param'] == 'n'
    image = _post(url, {'model': 'm', 'messages': [{'role': 'user', 'content': [{'type': 'image_url'}]}]})
    assert image.status_code == 400 and image.json()['error']['param'] == 'messages.0.content.0'
    anthropic = _post(f'{gw.url}/s/a/v1/messages', {'model': 'm', 'messages': [{'role': 'user', 'content': 'x'}]})
    assert anthropic.status_code == 400 and anthropic.json()['type'] == 'error'
    assert 'max_tokens' in anthropic.json()['error']['message']
    assert _post(url, [1, 2]).status_code == 400
    for bad, said in ((42, 'a string or a list of input items, not int'), ([1], 'item 0 is int')):
        responses = _post(f'{gw.url}/s/a/v1/responses', {'model': 'm', 'input': bad}).json()['error']
        assert responses['param'] == 'input' and said in responses['message']  # not a union member's name
    # none of these opened a session or cost anything: the session still serves its first turn
    assert _post(url, HELLO).json()['choices'][0]['message']['content'] == 'fine'


def test_a_body_over_the_limit_is_a_413(gw):
    big = {'model': 'm', 'messages': [{'role': 'user', 'content': 'x' * 10_000}]}
    response = _post(f'{gw.url}/s/a/v1/chat/completions', big)
    assert response.status_code == 413 and response.json()['error']['code'] == 'request_too_large'
    chunked = httpx.post(f'{gw.url}/s/a/v1/chat/completions', content=iter([b'{"x": "' + b'y' * 10_000 + b'"}']),
                         timeout=TIMEOUT_S)  # no Content-Length: read until the limit
    assert chunked.status_code == 413


def test_unknown_session_finished_session_and_second_finish(tmp_path):
    settings = GatewayConfig(open_on_call=False)
    with Gateway(scripted('one', 'two'), tmp_path / 'run', settings=settings) as gw:
        unknown = _post(f'{gw.url}/s/nobody/v1/chat/completions', HELLO)
        assert unknown.status_code == 404 and 'nobody' in unknown.json()['error']['message']
        assert _post(f'{gw.url}/s/nobody/finish', {'reward': 1}).status_code == 404
        opened = _post(f'{gw.url}/sessions', {'session': 'ep'}).json()
        assert opened['base_url'] == f'{gw.url}/s/ep/v1' and opened['api_key'] is None
        assert _post(f'{gw.url}/sessions', {'session': 'ep'}).status_code == 409
        assert _post(f'{gw.url}/s/ep/v1/chat/completions', HELLO).status_code == 200
        assert _post(f'{gw.url}/s/ep/finish', {'reward': 'high'}).json()['error']['param'] == 'reward'
        first = _post(f'{gw.url}/s/ep/finish', {'reward': 1})
        assert first.status_code == 200 and first.json()['reward'] == 1.0
        second = _post(f'{gw.url}/s/ep/finish', {'reward': 0})
        assert second.status_code == 409
        late = _post(f'{gw.url}/s/ep/v1/chat/completions', HELLO)
        assert late.status_code == 409 and late.json()['error']['code'] == 'session_finished'
    [line] = lines(tmp_path / 'run')
    assert line['reward'] == 1.0


def test_a_sessions_key_opens_that_session_only(tmp_path):
    with Gateway(scripted('mine'), tmp_path / 'run') as gw:
        a = _post(f'{gw.url}/sessions', {'session': 'a', 'key': True}).json()
        b = _post(f'{gw.url}/sessions', {'session': 'b', 'key': True}).json()
        assert a['api_key'] and a['api_key'] != b['api_key']
        url = f'{gw.url}/s/a/v1/chat/completions'
        assert _post(url, HELLO).status_code == 401
        assert _post(url, HELLO, headers={'Authorization': f'Bearer {b["api_key"]}'}).status_code == 401
        assert _post(f'{gw.url}/s/a/finish', {'reward': 1}, headers={'x-api-key': b['api_key']}).status_code == 401
        # the key alone names its session: a client whose base URL is the gateway's own /v1
        by_key = _post(f'{gw.url}/v1/chat/completions', HELLO, headers={'Authorization': f'Bearer {a["api_key"]}'})
        assert by_key.status_code == 200
        by_header = _post(f'{gw.url}/v1/chat/completions', HELLO, headers={'X-Mtflow-Session': 'c'})
        assert by_header.status_code == 200
        assert _post(f'{gw.url}/v1/chat/completions', HELLO).status_code == 400  # no session named at all
        assert _post(f'{gw.url}/s/a/finish', {'reward': 1}, headers={'x-api-key': a['api_key']}).status_code == 200
        assert _post(f'{gw.url}/s/c/finish', {}).status_code == 200
    assert sorted(line['uuid'] for line in lines(tmp_path / 'run')) == ['a', 'c']
    assert all(line['reward'] is None or line['uuid'] == 'a' for line in lines(tmp_path / 'run'))


def test_a_client_that_goes_away_mid_stream_costs_only_that_call(tmp_path):
    with Gateway(scripted('first answer', 'second answer', 'third answer'), tmp_path / 'run') as gw:
        host, port = gw.url.removeprefix('http://').split(':')
        body = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
        with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
            sock.sendall(b'POST /s/gone/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                         b'Content-Length: ' + str(len(body)).encode() + b'\r\n\r\n' + body)
            assert sock.recv(64).startswith(b'HTTP/1.1 200')  # the answer began; the client hangs up
        other = _post(f'{gw.url}/s/other/v1/chat/completions', HELLO)
        assert other.status_code == 200
        # the same client tries again: its session goes on (the lost answer is a turn; this is a retry)
        again = _post(f'{gw.url}/s/gone/v1/chat/completions', {'model': 'm', 'messages': [
            {'role': 'user', 'content': 'hi'}]})
        assert again.status_code == 200
        for name in ('gone', 'other'):
            assert _post(f'{gw.url}/s/{name}/finish', {'reward': 1}).status_code == 200
    by_uuid = {line['uuid']: line for line in lines(tmp_path / 'run')}
    assert by_uuid['gone']['num_turns'] == 2
    [closed] = by_uuid['gone']['rollout_infos']['context_segments']
    assert closed['ended_by']['kind'] == 'retry'
    assert_tokens_exact(tmp_path / 'run', segments=3)


def test_a_failing_session_costs_no_other(tmp_path):
    backend = scripted({'uuid': 'good', 'content': 'g1'}, {'uuid': 'good', 'content': 'g2'}, cycle=False)
    with Gateway(backend, tmp_path / 'run') as gw:
        assert _post(f'{gw.url}/s/good/v1/chat/completions', HELLO).status_code == 200
        bad = _post(f'{gw.url}/s/bad/v1/chat/completions', HELLO)  # the script has nothing for it
        assert bad.status_code == 500 and 'ran out of outputs' in bad.json()['error']['message']
        later = _post(f'{gw.url}/s/bad/v1/chat/completions', HELLO)  # it ended: a 409 that says why
        assert later.status_code == 409 and '(error: BackendError: scripted backend ran out' in later.text
        second = _post(f'{gw.url}/s/good/v1/chat/completions', {'model': 'm', 'messages': [
            {'role': 'user', 'content': 'hello'}, {'role': 'assistant', 'content': 'g1'},
            {'role': 'user', 'content': 'more'}]})
        assert second.json()['choices'][0]['message']['content'] == 'g2'
        assert _post(f'{gw.url}/s/good/finish', {'reward': 1}).status_code == 200
    by_uuid = {line['uuid']: line for line in lines(tmp_path / 'run')}
    assert by_uuid['bad']['finish_reason'] == 'error' and by_uuid['good']['finish_reason'] == 'client_finished'


def test_limits_end_a_session_with_the_error_a_client_expects_and_the_reward_still_counts(tmp_path):
    budget = ContextBudget(context_length=120, max_tokens=16)
    with Gateway(scripted('short'), tmp_path / 'run', max_turns=2, context=budget,
                 settings=GatewayConfig(finish_grace_s=30)) as gw:
        history = [{'role': 'user', 'content': 'go'}]
        for _ in range(2):
            answer = _post(f'{gw.url}/s/turns/v1/chat/completions', {'model': 'm', 'messages': history}).json()
            history += [answer['choices'][0]['message'], {'role': 'user', 'content': 'again'}]
        third = _post(f'{gw.url}/s/turns/v1/chat/completions', {'model': 'm', 'messages': history})
        assert third.status_code == 400 and third.json()['error']['code'] == 'max_turns'
        long = [{'role': 'user', 'content': 'word ' * 200}]
        full = _post(f'{gw.url}/s/full/v1/chat/completions', {'model': 'm', 'messages': long})
        assert full.status_code == 400 and full.json()['error']['code'] == 'context_length_exceeded'
        # the reward comes after the limit ended the session: it is still the trajectory's
        done = _post(f'{gw.url}/s/turns/finish', {'reward': 0.5}).json()
        assert done == {'session': 'turns', 'finish_reason': 'max_turns', 'turns': 2, 'segments': 1, 'reward': 0.5}
    by_uuid = {line['uuid']: line for line in lines(tmp_path / 'run')}
    assert by_uuid['turns']['reward'] == 0.5 and by_uuid['full']['finish_reason'] == 'context_full'


def test_a_total_token_budget_cuts_the_last_reply_and_refuses_the_next_call(tmp_path):
    text = 'go on now'
    sampled = len(make_tokenizer()(text, add_special_tokens=False)['input_ids']) + 1  # its EOS too
    budget = ContextBudget(max_tokens=32, total_response_tokens=sampled + 2)
    with Gateway(scripted(text, honor_max_tokens=True), tmp_path / 'run', context=budget) as gw:
        history = [{'role': 'user', 'content': 'spend'}]
        for expected in ('stop', 'length'):  # the second reply gets the 2 tokens left
            answer = _post(f'{gw.url}/s/total/v1/chat/completions', {'model': 'm', 'messages': history}).json()
            assert answer['choices'][0]['finish_reason'] == expected
            history += [answer['choices'][0]['message'], {'role': 'user', 'content': 'again'}]
        spent = _post(f'{gw.url}/s/total/v1/chat/completions', {'model': 'm', 'messages': history})
        assert spent.status_code == 400 and spent.json()['error']['code'] == 'length_total'
        assert _post(f'{gw.url}/s/total/finish', {'reward': 0.0}).status_code == 200
    [line] = lines(tmp_path / 'run')
    assert (line['finish_reason'], line['num_turns'], line['reward']) == ('length_total', 2, 0.0)
    assert sum(map(sum, line['response_loss_mask'])) == sampled + 2


def test_an_idle_session_finishes_idle_timeout(tmp_path):
    with Gateway(scripted('hi'), tmp_path / 'run', settings=GatewayConfig(idle_timeout_s=0.3)) as gw:
        assert _post(f'{gw.url}/s/idle/v1/chat/completions', HELLO).status_code == 200
        deadline = time.monotonic() + TIMEOUT_S
        while not gw.written and time.monotonic() < deadline:
            time.sleep(0.05)
        late = _post(f'{gw.url}/s/idle/v1/chat/completions', HELLO)
        assert late.status_code == 409
    [line] = lines(tmp_path / 'run')
    assert line['finish_reason'] == 'idle_timeout' and line['num_turns'] == 1


def test_sessions_by_header_and_the_status_codes_the_docs_give(tmp_path):
    """``X-Session-ID`` by default (verifiers' header: its client sends an API key beside it), a
    configured header instead, ``X-Mtflow-Session`` always; no session named is a 400 (a key that
    is no session's own too), a key that is not the session's a 401."""
    with Gateway(scripted('one'), tmp_path / 'default') as gw:
        v1 = f'{gw.url}/v1/chat/completions'
        verifiers_like = _post(v1, HELLO, headers={'X-Session-ID': 'rollout-1', 'Authorization': 'Bearer sk-any'})
        assert verifiers_like.status_code == 200
        stray = _post(v1, HELLO, headers={'Authorization': 'Bearer sk-nobody'})
        assert stray.status_code == 400 and stray.json()['error']['code'] == 'no_session'
        assert "no session's own" in stray.json()['error']['message'] and 'X-Session-ID' in stray.json()['error']['message']
        gw.finish('rollout-1', reward=1.0)
    with Gateway(scripted('two'), tmp_path / 'custom', settings=GatewayConfig(session_header='X-Rollout')) as gw:
        v1 = f'{gw.url}/v1/chat/completions'
        assert _post(v1, HELLO, headers={'X-Rollout': 'r1'}).status_code == 200
        assert _post(v1, HELLO, headers={'X-Mtflow-Session': 'r2'}).status_code == 200
        unnamed = _post(v1, HELLO, headers={'X-Session-ID': 'not-read-here'})
        assert unnamed.status_code == 400 and 'X-Rollout' in unnamed.json()['error']['message']
        too_long = _post(v1, HELLO, headers={'X-Rollout': 'r' * 201})
        assert too_long.status_code == 400 and too_long.json()['error']['param'] == 'session'
        for name in ('r1', 'r2'):
            gw.finish(name)
    assert sorted(line['uuid'] for line in lines(tmp_path / 'custom')) == ['r1', 'r2']
    with pytest.raises(Exception, match='session_header'):
        GatewayConfig(session_header='X Session')


def test_every_route_not_served_answers_json_naming_what_is(gw):
    embeddings = httpx.post(f'{gw.url}/v1/embeddings', json={'input': 'x'}, timeout=TIMEOUT_S)
    assert embeddings.status_code == 404
    message = embeddings.json()['error']['message']
    assert 'POST /v1/embeddings' in message and 'POST /s/{session}/v1/responses' in message
    wrong_method = httpx.get(f'{gw.url}/s/a/v1/chat/completions', timeout=TIMEOUT_S)
    assert wrong_method.status_code == 405 and wrong_method.json()['error']['code'] == 'method_not_allowed'
    count = httpx.post(f'{gw.url}/s/a/v1/messages/count_tokens', json={}, timeout=TIMEOUT_S)
    assert count.status_code == 404 and count.json()['error']['type'] == 'not_found_error'  # Anthropic's shape
    root = httpx.get(gw.url, timeout=TIMEOUT_S)
    assert root.status_code == 200 and 'POST /v1/responses' in root.json()['routes']
    assert httpx.head(gw.url, timeout=TIMEOUT_S).status_code == 200  # Claude Code's reachability probe
