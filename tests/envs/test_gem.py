"""GEM's environments (``env: {gem: ...}``, gem-llm 0.1.0) through ``mtflow run`` with the scripted
model: each request's per-step rewards and end equal what GEM's own environments give for the same
replies (a differential test), for two of its games (GuessTheNumber, Mastermind), in GEM's venv.

gem-llm pins reasoning-gym 0.1.23, nltk 3.9.1 and msgspec 0.19 (the main venv has 0.1.25, 3.10 and
0.23, which ms-swift needs), so it has a venv of its own (scripts/test.sh: ``.extras/gem-venv``)
with mtflow's own four dependencies; mtflow runs there from this checkout (``PYTHONPATH``)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VENV_PYTHON = ROOT / '.extras' / 'gem-venv' / 'bin' / 'python'

pytestmark = pytest.mark.skipif(not VENV_PYTHON.is_file(), reason='the GEM venv is not there (scripts/test.sh makes '
                                '.extras/gem-venv with gem-llm 0.1.0)')


def test_two_gem_games_get_gems_own_rewards_for_the_same_replies(tmp_path):
    done = subprocess.run([str(VENV_PYTHON), str(HERE / 'gem_run.py'), str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for game, seen in report.items():
        assert seen['exit_code'] == 0, game
        assert seen['mtflow'] == seen['gem'], game
        totals = {round(sum(rewards), 6) for rewards, _ in seen['gem'].values()}
        assert len(totals) > 1, game  # some replies earn more than others: the comparison can fail
    guess = report['game:GuessTheNumber-v0-easy']
    assert guess['gem']['s0'][0][-1] == 1.0  # found on the second reply
    assert guess['opening'].startswith('You are playing Guess The Number.')  # GEM's reset opens the chat
