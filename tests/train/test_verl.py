"""verl 0.9.1 trains on mtflow's exact rollouts: its own ``AgentLoopWorker`` runs
``MtflowAgentLoop`` (a Python scheduler with a tool message every turn, and a YAML guess-the-number
game) against a fake server manager serving the tiny model, then verl's GRPO advantage and one
optimizer step of verl's ``TrainingWorker`` (FSDP2 on CPU), whose policy loss is hooked
(``verl_check.py``, in verl's own venv). What the loss received, row by row: the response mask
mtflow's token record implies, the rollout logprobs as the old policy's on exactly the sampled
tokens, the trainer's logprobs of the same ids within 1e-4 of them, ``mtflow.train.grpo``'s
advantage; every row's prompt + response is exactly one request's last model call (each call's
prompt extending the last one's ids); ``num_turns`` and the per-turn rewards (``turn_scores``)
are the trajectory's.

verl runs in its own venv (scripts/test.sh: ``.extras/verl-venv``): its pins (transformers 5.10,
ray, hydra) are not the main venv's."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.helpers import run_check

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VENV_PYTHON = ROOT / '.extras' / 'verl-venv' / 'bin' / 'python'

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not VENV_PYTHON.is_file(), reason='the verl venv is not there (scripts/test.sh makes '
                                 '.extras/verl-venv with verl 0.9.1)')]


def test_verl_agent_loop_worker_and_training_worker_get_mtflows_exact_rollouts():
    report = run_check('verl-venv', 'verl_check.py', VERL_PLATFORM='cpu', TOKENIZERS_PARALLELISM='false',
                       CUDA_VISIBLE_DEVICES='')
    assert report['rows'] == 6 and report['turns'] == [3, 3, 3, 3, 4, 4]
    assert report['num_turns'] == [6, 6, 6, 6, 9, 9]  # verl counts messages: user, then assistant and tool turns
    assert all(len(scores) == turns for scores, turns in zip(report['turn_scores'], report['turns']))
    assert report['step'] == {**report['step'], 'losses_seen': 1, 'moved': True}
    assert report['loss_inputs']['max_logprob_gap'] < 1e-4
    assert any(a != 0 for a in report['loss_inputs']['advantages'])
