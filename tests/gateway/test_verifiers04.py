"""A verifiers 0.4 environment (its v1 stack: ``vf-eval``, ``SingleAgentEnv``, the ``null``
harness's chat program per rollout behind verifiers' interception server) against the gateway
with no proxy: verifiers' client names each rollout by the ``X-Session-ID`` header (the rollout's
trace id), so each rollout is a session of its own; each is finished with the reward verifiers'
own task gave it, and every trajectory is exact.

verifiers 0.4 runs in its own venv (``.extras/verifiers04-venv``, made by scripts/test.sh): it
would move pins of this one. Its ``null`` harness prepares its chat program with ``uv`` (PEP 723
dependencies from the package index) the first time."""
from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from mtflow.backends.scripted import ScriptedBackend
from mtflow.gateway import Gateway
from tests.gateway.helpers import assert_tokens_exact, lines
from tests.tiny_model import make_tokenizer

HERE = Path(__file__).resolve().parent
VENV = HERE.parents[1] / '.extras' / 'verifiers04-venv' / 'bin'

pytestmark = pytest.mark.skipif(not (VENV / 'vf-eval').is_file(), reason='the verifiers 0.4 venv is not there '
                                '(scripts/test.sh makes .extras/verifiers04-venv with verifiers 0.4.0)')


def _answer(request) -> str:
    """Right for sums that are odd, one off for the even ones: the rewards differ by task."""
    total = sum(int(n) for n in request.messages[-1]['content'].replace('?', ' ').split() if n.isdigit())
    return f'The sum is {total if total % 2 else total + 1}.'


def test_each_rollout_is_a_session_by_x_session_id_finished_with_its_own_reward(tmp_path):
    backend = ScriptedBackend(respond=_answer, tokenizer=make_tokenizer())
    out = tmp_path / 'vf'
    with Gateway(backend, tmp_path / 'run') as gw:
        (tmp_path / 'sums.toml').write_text(textwrap.dedent(f'''\
            model = "m"
            push = false
            output_dir = "{out}"
            [client]
            base_url = "{gw.url}/v1"
            [env.agent.harness]
            id = "null"
            [env.agent.runtime]
            type = "subprocess"
            [env.taskset]
            id = "vf04_sums"
            '''))
        env = dict(os.environ, PRIME_API_KEY='unused', PATH=f'{VENV}:{os.environ.get("PATH", "")}', PYTHONPATH=str(HERE))
        done = subprocess.run([str(VENV / 'vf-eval'), '@', str(tmp_path / 'sums.toml')], capture_output=True, text=True,
                              env=env, timeout=600)
        assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
        episodes = [json.loads(line) for line in next(out.glob('*/traces.jsonl')).read_text().splitlines()]
        rewards = {}
        for episode in episodes:  # the environment's own reward finishes each rollout's session
            trace = episode['traces'][0]
            rewards[trace['id']] = sum(r['score'] * r.get('weight', 1.0) for r in trace['rewards'].values())
            gw.finish(trace['id'], reward=rewards[trace['id']], info={'task': episode['task']['data']['idx']})
    assert sorted(rewards.values()) == [0.0, 1.0, 1.0, 1.0]  # 4 + 4 is the even sum: the comparison can fail
    by_session = {line['uuid']: line for line in lines(tmp_path / 'run')}
    assert sorted(by_session) == sorted(rewards)  # one session per rollout, named by its trace id
    for name, reward in rewards.items():
        assert (by_session[name]['reward'], by_session[name]['num_turns']) == (reward, 1)
    assert_tokens_exact(tmp_path / 'run', segments=4)
