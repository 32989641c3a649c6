"""The ``answer`` section: find the model's final answer in a completion and compare it with the
reference in ``data_dict`` (exact, numeric, or a ``module:function`` comparison)."""
from __future__ import annotations

import re
from typing import Any, Callable, Optional

from mtflow.core.registry import resolve_reference
from mtflow.declarative.schema import AnswerConfig

__all__ = ['AnswerCheck']


def _number(text: str) -> Optional[float]:
    cleaned = re.sub(r'[\s,$%]', '', str(text)).rstrip('.')
    try:
        return float(cleaned)
    except ValueError:
        return None


class AnswerCheck:
    """One scheduler's answer rule, compiled once."""

    def __init__(self, config: AnswerConfig, base_dir: Optional[str] = None) -> None:
        self.config = config
        self.pattern = re.compile(config.pattern, re.DOTALL)
        self.compare: Optional[Callable[[str, Any], bool]] = None
        if config.compare not in ('exact', 'numeric'):
            self.compare = resolve_reference(config.compare, base_dir)

    def extract(self, text: str) -> Optional[str]:
        """The first non-empty group of the last match (the whole match without groups)."""
        found = None
        for m in self.pattern.finditer(text or ''):
            groups = [g for g in m.groups() if g] if m.groups() else [m.group(0)]
            if groups:
                found = groups[0].strip()
        return found

    def is_correct(self, answer: str, infer_request: Any) -> bool:
        data = getattr(infer_request, 'data_dict', None) or {}
        if self.config.field not in data:
            raise KeyError(f'data_dict has no {self.config.field!r} (answer.field) to check the answer against')
        reference = data[self.config.field]
        if self.compare is not None:
            return bool(self.compare(answer, reference))
        if self.config.compare == 'numeric':
            a, b = _number(answer), _number(str(reference))
            if a is not None and b is not None:
                return abs(a - b) <= 1e-6 * max(1.0, abs(b))
        return answer.strip() == str(reference).strip()
