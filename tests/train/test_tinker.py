"""The Tinker cookbook (``tinker-cookbook`` 0.6.1, ``tinker`` 0.38) gets mtflow's exact rollouts:
``mtflow.train.tinker_data``'s ``Datum``\\ s of multi-turn tool-use rollouts of the tiny model equal,
token for token and field for field, what the cookbook's own ``assemble_training_data`` builds
from the same rollout as its ``Trajectory``\\ s (each turn's observation the exact prompt of that
turn, checked against the token record), with its ``compute_advantages``
(``tinker_check.py``, in the Tinker venv). No optimizer step: Tinker trains on its service
(``TrainingClient.forward_backward`` / ``optim_step`` are API calls), which is not reachable here.

The cookbook runs in its own venv (scripts/test.sh: ``.extras/tinker-venv``): 0.6.1 requires
``tml-renderers>=0.4.1``, which is not on the registry (0.2.1 is its newest), so the cookbook is
installed without it (its RL data path does not import it)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.helpers import run_check

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / '.extras' / 'tinker-venv' / 'bin' / 'python'

pytestmark = pytest.mark.skipif(not VENV_PYTHON.is_file(), reason='the Tinker venv is not there (scripts/test.sh makes '
                                '.extras/tinker-venv with tinker 0.38 and tinker-cookbook 0.6.1)')


def test_tinker_datums_equal_the_cookbooks_own_on_the_same_rollout():
    report = run_check('tinker-venv', 'tinker_check.py')
    assert report['datums'] == 6 and report['trained'] == [18] * 6  # three turns of six sampled ids each
    assert len(report['advantages']) > 1  # rewards differ within the groups: the comparison can fail
