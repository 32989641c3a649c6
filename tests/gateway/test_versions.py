"""Policy versions and ``max_staleness`` apply to a gateway's calls as they do to a stream: every
turn is stamped with the weights that served it, and a session whose oldest turn falls too far
behind is dropped (its next call answered ``409 stale``) while sessions begun after the update go on."""
from __future__ import annotations

import httpx

from mtflow.gateway import Gateway
from mtflow.run.agent_config import GatewayConfig
from tests.gateway.helpers import TIMEOUT_S, lines, scripted


def _call(gw: Gateway, session: str, messages: list) -> httpx.Response:
    return httpx.post(f'{gw.base_url(session)}/chat/completions', json={'model': 'm', 'messages': messages},
                      timeout=TIMEOUT_S)


def test_turns_carry_their_version_and_a_too_stale_session_is_dropped(tmp_path):
    with Gateway(scripted('a reply'), tmp_path / 'run', settings=GatewayConfig(max_staleness=0)) as gw:
        first = [{'role': 'user', 'content': 'old task'}]
        reply = _call(gw, 'old', first).json()['choices'][0]['message']
        update = httpx.post(f'{gw.url}/policy_version', json={'version': 1}, timeout=TIMEOUT_S)
        assert update.status_code == 200 and gw.executor.policy_version == 1
        assert httpx.post(f'{gw.url}/policy_version', json={'version': 0}, timeout=TIMEOUT_S).status_code == 400
        stale = _call(gw, 'old', first + [reply, {'role': 'user', 'content': 'more'}])
        assert stale.status_code == 409 and stale.json()['error']['code'] == 'stale'
        assert 'max_staleness=0' in stale.json()['error']['message']
        fresh = [{'role': 'user', 'content': 'new task'}]
        reply = _call(gw, 'new', fresh).json()['choices'][0]['message']
        assert _call(gw, 'new', fresh + [reply, {'role': 'user', 'content': 'more'}]).status_code == 200
        assert httpx.post(f'{gw.url}/s/new/finish', json={'reward': 1}, timeout=TIMEOUT_S).status_code == 200
        assert httpx.post(f'{gw.url}/s/old/finish', json={'reward': 1}, timeout=TIMEOUT_S).status_code == 409
    [line] = lines(tmp_path / 'run')  # the dropped session is not a trajectory
    assert line['uuid'] == 'new' and line['rollout_infos']['policy_versions'] == [1, 1]
