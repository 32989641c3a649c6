"""A tool, a reward and a scripted model for the TRL-native tests (``test_native_tool_loop.py``,
``tests/train/test_trl_native.py``, the example in ``docs/training.md``): ``submit`` records every
answer it was called with, so a test sees which calls reached mtflow's tool runner; ``graded``
scores an episode from what its environment saw (the last ``submit`` call against
``data_dict['answer']``, a quarter off per failed call), as a TRL-native reward must: an
environment never sees the model's text. The tiny random model never writes a tool call, so
``scripted_generate`` stands in for its ``generate``: TRL's own loop then parses, calls and
tokenizes as it would for a real model's replies."""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Dict, List, Optional

#: a YAML scheduler over them: a calculator and ``submit``, the observation written by its templates,
#: the reward ``graded``
ARITH = {'name': 'arith',
         'tools': [{'name': 'calculator'}, {'name': 'submit', 'impl': 'tests.train.trl116.native_tools:submit'}],
         'observation': {'template': 'Result: {result}', 'error_template': 'Oops: {error}'},
         'reward': 'tests.train.trl116.native_tools:graded'}
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


#: the questions of the scripted episodes and their answers
QUESTIONS = {'6 * 7': '42', '5 + 5': '10'}
TOOL_RESPONSE = re.compile(r'<tool_response>\n(.*?)\n</tool_response>', re.DOTALL)


def tool_call(name: str, **arguments: Any) -> str:
    """A Qwen-style tool call ending the reply."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call><|im_end|>'


def scripted_reply(prompt: str, copy: int) -> str:
    """What the scripted model writes after ``prompt`` (the decoded ids TRL generates from):
    copy ``k`` of a question computes one of four expressions (right, off by one, right, broken),
    then submits what the calculator said, then stops."""
    question = re.search(r'What is (.*?)\?', prompt).group(1)
    results = TOOL_RESPONSE.findall(prompt)
    if not results:
        return tool_call('calculator', expression=[question, f'{question} + 1', f'({question})', f'{question} +'][copy])
    if len(results) == 1:
        said = results[0]
        return tool_call('submit', answer=said[len('Result: '):] if said.startswith('Result: ') else 'none')
    return 'Done.<|im_end|>'


def scripted_generate(tok: Any) -> Callable[..., Any]:
    """``model.generate`` for TRL: each row's scripted reply (the first call of a batch has every
    rollout, in order: row ``i`` is copy ``i % 4``), right-padded."""
    import torch

    def generate(input_ids: Any, attention_mask: Any, **_: Any) -> Any:
        rows = []
        for i, (ids, mask) in enumerate(zip(input_ids.tolist(), attention_mask.tolist())):
            prompt = tok.decode([t for t, m in zip(ids, mask) if m])
            rows.append(ids + tok.encode(scripted_reply(prompt, i % 4), add_special_tokens=False))
        width = max(len(r) for r in rows)
        return torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    return generate
