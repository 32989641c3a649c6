"""TRL 1.16 (the newest on the registry) beside the venv's 0.29.1 (what ms-swift 4.6 pins):
``environment_factory`` over mtflow schedulers, with ``rollout_func`` (the exact-token path) and
alone (TRL's own tool loop: ``tests/train/trl116``), and ``rollout_func``
(``tests/train/test_trl.py``, unchanged) pass under it, in a process that has
``.extras/trl116`` (scripts/test.sh: ``pip install --no-deps --target``; no other package moves)
first on its path."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRL116 = ROOT / '.extras' / 'trl116'

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (TRL116 / 'trl').is_dir(), reason='TRL 1.16 is not there (scripts/test.sh installs '
                                 'it into .extras/trl116)')]


def test_environment_factory_alone_and_with_rollout_func_pass_under_trl_1_16():
    env = dict(os.environ, PYTHONPATH=f'{TRL116}{os.pathsep}{ROOT}', TRL_EXPERIMENTAL_SILENCE='1')
    done = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-rs',
                           'tests/train/trl116', 'tests/train/test_trl.py'], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    outcome = done.stdout.strip().splitlines()[-1]  # every test passed, none skipped or deselected
    passed = re.fullmatch(r'\d+ passed(, \d+ warnings?)? in [\d.]+s( \(\S+\))?', outcome)
    assert passed and 'skipped' not in done.stdout, done.stdout[-2000:]
