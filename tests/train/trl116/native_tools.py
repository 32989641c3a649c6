"""A tool and a reward for the TRL-native tests (``test_native_tool_loop.py``,
``tests/train/test_trl_native.py``): ``submit`` records every answer it was called with, so a test
sees which calls reached mtflow's tool runner; ``graded`` scores an episode from what its
environment saw (the last ``submit`` call against ``data_dict['answer']``, a quarter off per failed
call), as a TRL-native reward must: an environment never sees the model's text."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

#: every answer ``submit`` received, in order
SUBMITTED: List[str] = []


def submit(answer: str) -> str:
    """Submit the final answer.

    Args:
        answer: the number you computed, as text.
    """
    SUBMITTED.append(answer)
    return f'received {answer}'


def last_submitted(messages: List[Dict[str, Any]]) -> Optional[str]:
    """The answer of the last ``submit`` call among the assistant messages' tool calls."""
    found = None
    for message in messages:
        for call in message.get('tool_calls') or []:
            if call['function']['name'] == 'submit':
                found = json.loads(call['function']['arguments']).get('answer')
    return found


def graded(infer_request: Any, rollout_infos: Dict[str, Any]) -> float:
    right = last_submitted(infer_request.messages) == str(infer_request.data_dict['answer'])
    return (1.0 if right else 0.0) - 0.25 * rollout_infos['tool_errors']
