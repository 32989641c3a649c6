"""Real agent harnesses, unchanged, through the gateway: Codex CLI (its Responses API, as a custom
model provider), Claude Code (``ANTHROPIC_BASE_URL``) and mini-swe-agent (LiteLLM's chat
completions). A scripted model makes each run one shell command in a scratch directory and
finish; the command ran, the reward is the file it wrote, and every segment passes ``mtflow
check-tokens``. Each runs in a network namespace with loopback only when the machine allows one
(as root, or through a user namespace), so a harness that needed any other host would fail here.

Opt-in: they need Node and the npm packages, or mini-swe-agent's own venv, which
``MTFLOW_HARNESSES=1 bash scripts/test.sh`` (or ``bash scripts/harnesses_setup.sh``) installs
into ``.extras/``; without them each test is skipped and says what is missing."""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

from tests.gateway.harness_run import BIN, MINI
from tests.gateway.helpers import assert_tokens_exact, lines

HERE = Path(__file__).resolve().parent
SETUP = 'MTFLOW_HARNESSES=1 bash scripts/test.sh (or bash scripts/harnesses_setup.sh) installs it into .extras/'


def _missing(harness: str) -> str:
    if harness == 'mini':
        return '' if MINI.is_file() else f'mini-swe-agent is not installed: {SETUP}'
    if shutil.which('node') is None:
        return 'Node is not installed (Codex CLI and Claude Code are Node programs)'
    name = {'codex': '@openai/codex', 'claude': '@anthropic-ai/claude-code'}[harness]
    return '' if (BIN / harness).exists() else f'{name} is not installed: {SETUP}'


@functools.lru_cache(maxsize=None)
def _offline_prefix() -> Tuple[str, ...]:
    """How to run a command with loopback only: ``unshare -n`` as root, ``unshare -rn`` (a user
    namespace) otherwise; ``()`` when neither works here."""
    if shutil.which('unshare') is None or shutil.which('ip') is None:
        return ()
    for prefix in (('unshare', '-n'), ('unshare', '-rn')):
        probe = subprocess.run([*prefix, 'ip', 'link', 'set', 'lo', 'up'], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return prefix
    return ()


def _offline(argv: List[str]) -> Tuple[List[str], bool]:
    prefix = _offline_prefix()
    if not prefix:
        return argv, False
    return [*prefix, 'sh', '-c', 'ip link set lo up && exec "$0" "$@"', *argv], True


@pytest.mark.parametrize('harness', ['codex', 'claude', 'mini'])
def test_a_real_harness_runs_one_command_and_every_segment_is_exact(tmp_path, harness):
    missing = _missing(harness)
    if missing:
        pytest.skip(missing)
    argv, isolated = _offline([sys.executable, str(HERE / 'harness_run.py'), harness, str(tmp_path / 'run'),
                               str(tmp_path / 'scratch')])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(HERE.parents[1])))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result['returncode'] == 0, (result['stdout'], result['stderr'])
    assert result['out'] == 'hello\n', result  # the command the model called ran in the scratch directory
    assert (result['finish']['reward'], result['finish']['segments'], result['finish']['turns']) == (1.0, 1, 2)
    [line] = lines(tmp_path / 'run')
    assert line['uuid'] == f'{harness}-1' and line['reward'] == 1.0
    roles = [m['role'] for m in line['messages']]
    assert roles[-3:] == ['assistant', 'tool', 'assistant']  # the call, what the harness ran, the end
    assert_tokens_exact(tmp_path / 'run', segments=1)
    if not isolated:
        pytest.xfail('ran with this machine\'s network: no network namespace here (unshare), so "offline" is unproven')
