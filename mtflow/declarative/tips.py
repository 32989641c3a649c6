"""The ``tips`` section: which tip a turn gets (the first whose condition holds and that the
request has not had ``max_times``), and how an inline tip cuts the completion before it."""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from mtflow.core.registry import resolve_reference
from mtflow.declarative.parsers import ToolCall
from mtflow.declarative.schema import TipConfig

__all__ = ['TipRules', 'cut_before_markers']


class TipRules:
    """One scheduler's tips, their regexes compiled and predicates resolved once."""

    def __init__(self, tips: List[TipConfig], base_dir: Optional[str] = None) -> None:
        self.checks = [(tip, re.compile(tip.regex) if tip.regex else None,
                        resolve_reference(tip.predicate, base_dir) if tip.predicate else None) for tip in tips]

    def choose(self, tips_given: Dict[str, int], completion: str, calls: List[ToolCall], answer: Optional[str],
               correct: Optional[bool], request: Any, choice: Any, turn: int) -> Optional[TipConfig]:
        """The tip this turn gets, or ``None``."""
        for tip, regex, predicate in self.checks:
            if tips_given.get(tip.name, 0) >= tip.max_times:
                continue
            if self.applies(tip, regex, predicate, completion, calls, answer, correct, request, choice, turn):
                return tip
        return None

    @staticmethod
    def applies(tip: TipConfig, regex: Any, predicate: Any, completion: str, calls: List[ToolCall],
                answer: Optional[str], correct: Optional[bool], request: Any, choice: Any, turn: int) -> bool:
        when = tip.when
        if when == 'always':
            return True
        if when == 'wrong_answer':
            return not correct
        if when == 'no_answer':
            return answer is None
        if when == 'no_tool_call':
            return not calls
        if when == 'regex':
            return bool(regex.search(completion))
        return bool(predicate(request, choice, turn))


def cut_before_markers(tokenizer: Any, completion: str, model_ids: Optional[List[int]], logprobs: List[float],
                       markers: List[str]) -> Tuple[str, Optional[List[int]], List[float]]:
    """Cut the completion before the first marker; ids and logprobs are cut to the longest
    token prefix whose text is a prefix of the cut text, and the text is that prefix's
    decoding, so text and ids stay the same string."""
    cut = min((completion.find(m) for m in markers if m in completion), default=-1)
    if cut < 0:
        return completion, model_ids, logprobs
    if not model_ids or tokenizer is None:
        return completion[:cut], model_ids, logprobs
    kept_text, n = '', 0
    for i in range(1, len(model_ids) + 1):
        text = tokenizer.decode(model_ids[:i])
        if len(text) > cut or not completion.startswith(text):
            break
        kept_text, n = text, i
    return kept_text, model_ids[:n], logprobs[:n]
