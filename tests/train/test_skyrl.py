"""SkyRL (``skyrl-train`` 0.3.1) gets mtflow's exact rollouts as its generator output
(``mtflow.train.skyrl_data``): SkyRL's own ``validate_generator_output``,
``concatenate_generator_outputs``, ``convert_prompts_responses_to_batch_tensors`` (its trainer's
``convert_to_training_input``) and GRPO advantage on multi-turn tool-use rollouts of the tiny
model, every row checked against the token record (``skyrl_check.py``, in the SkyRL venv). No
optimizer step: skyrl-train 0.3.1 requires Python 3.12 (this machine and CI have 3.11; its data
modules import under 3.11, installed with ``--ignore-requires-python``), and its policy model
(``skyrl_train/model_wrapper.py``) imports ``flash_attn`` at import, which has no wheel on the
registry (a CUDA build); ``skyrl`` 0.4 (JAX) requires Python >= 3.12 throughout.

SkyRL runs in its own venv (scripts/test.sh: ``.extras/skyrl-venv``): it pins ray 2.51.1 and
datasets 4.0.0."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.helpers import run_check

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / '.extras' / 'skyrl-venv' / 'bin' / 'python'

pytestmark = pytest.mark.skipif(not VENV_PYTHON.is_file(), reason='the SkyRL venv is not there (scripts/test.sh makes '
                                '.extras/skyrl-venv with skyrl-train 0.3.1)')


def test_skyrl_builds_its_training_batch_from_mtflows_exact_rollouts():
    report = run_check('skyrl-venv', 'skyrl_check.py')
    assert report['rows'] == 6 and report['trained'] == [18] * 6
    assert report['trajectory_ids'] == ['p0_0', 'p0_1', 'p0_2', 'p1_0', 'p1_1', 'p1_2']
    assert any(a != 0 for a in report['advantages'])
