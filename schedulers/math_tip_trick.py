"""The Python form of ``math_tip_trick.yaml`` (ms-swift's MathTipsScheduler behaviour, written for
mtflow): a wrong answer gets the completion cut before ``<answer>``/``</think>`` and a re-check tip
appended inline with loss mask 0; the tip is given once."""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from mtflow import Scheduler
from mtflow.core.protocol import extract_logprobs

_ANSWER = re.compile(r'<answer>(.*?)</answer>|\\boxed\{([^{}]*)\}', re.DOTALL)


def extract_answer(text: str) -> Optional[str]:
    found = None
    for m in _ANSWER.finditer(text or ''):
        found = (m.group(1) or m.group(2) or '').strip() or found
    return found


def same_number(answer: Optional[str], reference: Any) -> bool:
    if answer is None:
        return False
    try:
        return abs(float(answer.replace(',', '')) - float(str(reference).replace(',', ''))) <= 1e-6 * max(
            1.0, abs(float(str(reference).replace(',', ''))))
    except ValueError:
        return answer.strip() == str(reference).strip()


class MathTipTrickScheduler(Scheduler):
    """See the module docstring. Needs ``data_dict['solution']``; a tokenizer for token ids."""
    tips_prompt = 'But wait... It seems I made a mistake,'
    markers = ('<answer>', '</think>')
    finish_reasons = ('stop_rule:correct_answer', 'stop_rule:tips_exhausted')

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tipped: Dict[Any, bool] = {}

    @staticmethod
    def key(request: Any) -> Any:
        return getattr(request, 'uuid', None) or id(request)

    async def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        answer = extract_answer(response_choice.message.content or '')
        correct = same_number(answer, infer_request.data_dict['solution'])
        infos: Dict[str, Any] = {'answer': answer, 'answer_correct': correct}
        if self.tipped.get(self.key(infer_request)):
            infos['tips_given'] = {'recheck': 1}
        reason = None
        if correct:
            reason = 'stop_rule:correct_answer'
        elif self.tipped.get(self.key(infer_request)):
            reason = 'stop_rule:tips_exhausted'
        elif self.max_turns and current_turn >= self.max_turns:
            reason = 'max_turns'
        if reason:
            infos['stop_rule'] = reason
            return {'done': True, 'finish_reason': reason, 'rollout_infos': infos}
        return {'done': False, 'rollout_infos': infos}

    def _cut(self, completion: str, ids: Optional[List[int]], logprobs: List[float]) -> Tuple[str, Any, List[float]]:
        cut = min((completion.find(m) for m in self.markers if m in completion), default=-1)
        if cut < 0:
            return completion, ids, logprobs
        if not ids or self.tokenizer is None:
            return completion[:cut], ids, logprobs
        kept, n = '', 0
        for i in range(1, len(ids) + 1):  # longest token prefix whose text is a prefix of the cut text
            text = self.tokenizer.decode(ids[:i])
            if len(text) > cut or not completion.startswith(text):
                break
            kept, n = text, i
        return kept, ids[:n], logprobs[:n]

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        self.tipped[self.key(infer_request)] = True
        completion = response_choice.message.content or ''
        ids = list(response_choice.token_ids) if response_choice.token_ids else None
        kept, ids, logprobs = self._cut(completion, ids, extract_logprobs(response_choice))
        last = infer_request.messages[-1]
        last['content'] = last['content'][:len(last['content']) - len(completion)] + kept + self.tips_prompt
        result: Dict[str, Any] = {'infer_request': infer_request, 'rollout_infos': {'tips_given': {'recheck': 1}},
                                  'trace_info': {'tip': 'recheck', 'tips_given': {'recheck': 1}}}
        if ids is not None and self.tokenizer is not None:
            tip_ids = self.tokenizer.encode(self.tips_prompt, add_special_tokens=False)
            result.update(response_token_ids=ids + tip_ids, response_loss_mask=[1] * len(ids) + [0] * len(tip_ids))
            if logprobs:
                result['rollout_logprobs'] = logprobs
        return result

    def on_request_finished(self, infer_request: Any, reason: str, turn: int) -> None:
        self.tipped.pop(self.key(infer_request), None)
