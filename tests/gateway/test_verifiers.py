"""Environments written for verifiers run under mtflow unchanged: verifiers' own ``evaluate`` of a
``MultiTurnEnv`` and of a ``ToolEnv`` (``verifiers_envs.py``), its client pointed at the gateway,
each rollout a session (``extra_headers_from_state``), each finished with its rubric's reward.
The rewards are the ones verifiers' own evaluation gives for the same sampled outputs against a
plain reference server, and every trajectory is one exact segment.

verifiers runs in its own venv (scripts/test.sh: ``.extras/verifiers-venv``): installed here it
would downgrade mcp and websockets, so the two never share a process; the gateway is the way in,
not a scheduler adapter."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from mtflow.backends.scripted import ScriptedBackend
from mtflow.gateway import Gateway
from tests.gateway.helpers import TIMEOUT_S, assert_tokens_exact, lines
from tests.gateway.verifiers_model import reply_text  # the model both servers answer with
from tests.tiny_model import make_tokenizer

HERE = Path(__file__).resolve().parent
VENV_PYTHON = HERE.parents[1] / '.extras' / 'verifiers-venv' / 'bin' / 'python'

pytestmark = pytest.mark.skipif(not VENV_PYTHON.is_file(), reason='the verifiers venv is not there (scripts/test.sh '
                                'makes .extras/verifiers-venv with verifiers 0.3.1)')


def _evaluate(env: str, url: str) -> list:
    done = subprocess.run([str(VENV_PYTHON), str(HERE / 'verifiers_run.py'), env, url], capture_output=True, text=True,
                          timeout=TIMEOUT_S * 5, env=dict(os.environ, PYTHONPATH=str(HERE)))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize('env, turns', [('guess', [1, 2, 2, 3, 3]), ('add', [2, 2, 2, 2])])
def test_a_verifiers_environment_under_the_gateway_gets_its_rubrics_rewards(tmp_path, env, turns):
    backend = ScriptedBackend(respond=lambda request: reply_text(request.messages), tokenizer=make_tokenizer())
    with Gateway(backend, tmp_path / 'run') as gw:
        under_mtflow = _evaluate(env, f'{gw.url}/v1')
    reference = _evaluate(env, '--reference')
    assert all(row['error'] is None for row in under_mtflow + reference)
    rewards = [row['reward'] for row in reference]
    assert [row['reward'] for row in under_mtflow] == rewards
    assert len(set(rewards)) > 1  # some episodes earn more than others: the comparison can fail
    by_session = {line['uuid']: line for line in lines(tmp_path / 'run')}
    assert sorted(by_session) == sorted(row['session'] for row in under_mtflow)
    for row, n in zip(under_mtflow, turns):
        line = by_session[row['session']]
        assert (line['reward'], line['num_turns'], line['finish_reason']) == (row['reward'], n, 'client_finished')
        assert line['rollout_infos']['gateway_finish'] == {'example_id': row['example_id']}
    assert_tokens_exact(tmp_path / 'run', segments=len(turns))
