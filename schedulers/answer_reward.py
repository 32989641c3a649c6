"""A reward for YAML schedulers with an ``answer`` section: 1.0 when the final answer matched the
reference (``rollout_infos['answer_correct']``), else 0.0. Used by ``scripted_tools.yaml``::

    reward: answer_reward:correct
"""
from typing import Any, Dict


def correct(infer_request: Any, rollout_infos: Dict[str, Any]) -> float:
    return 1.0 if rollout_infos.get('answer_correct') else 0.0
