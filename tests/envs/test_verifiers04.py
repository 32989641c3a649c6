"""verifiers 0.4 environments in-process (``env: {verifiers: ...}``): two OpenEnv environments through
verifiers' own OpenEnv taskset (its ``OpenEnvEnv.run`` stepping the server host-side), and a plain
taskset (``vf_arith.py``: ``SingleAgentEnv``, a task's ``@vf.reward``), under ``mtflow run`` with the
scripted model, against verifiers' own evaluation (``vf-eval`` with its ``null``
harness: a chat program per rollout calling a reference server) with the same model: every task's
reward and number of model turns are equal (a differential test).

verifiers 0.4 pins mcp 2.0 and openai 2.54 (the main venv has mcp 2.3, openai 3.63), so it has a venv of
its own with mtflow's four dependencies (scripts/test.sh: ``.extras/verifiers04-venv``); mtflow runs
there from this checkout. ``uv`` in that venv runs verifiers' harness program (its dependencies come
from PyPI the first time)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VENV_PYTHON = ROOT / '.extras' / 'verifiers04-venv' / 'bin' / 'python'

pytestmark = pytest.mark.skipif(not VENV_PYTHON.is_file(), reason='the verifiers 0.4 venv is not there '
                                '(scripts/test.sh makes .extras/verifiers04-venv)')


@pytest.mark.slow  # ~30 s idle: verifiers' own evaluation runs its harness program per rollout
def test_two_environments_in_process_get_verifiers_own_rewards(tmp_path):
    done = subprocess.run([str(VENV_PYTHON), str(HERE / 'verifiers04_run.py'), str(tmp_path)], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)])))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for name, seen in report.items():
        assert seen['exit_code'] == 0, name
        assert seen['mtflow'] == seen['vf'], name  # {task: [reward, model turns]}
        assert {reward for reward, _ in seen['vf'].values()} == {0.0, 1.0}, name  # the comparison can fail
        named = {'correct'} if name == 'arith' else {'openenv_reward'}  # the task's @vf.reward, or the env's own
        assert all(set(infos) == named for infos in seen['infos'].values()), name
    assert sorted(report) == ['arith', 'digit', 'number']
