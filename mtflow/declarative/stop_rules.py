"""The ``stop`` section: the rules a completion can stop on, in their order (``correct_answer``,
the regex rules, ``stop_tools``, ``length``, ``predicate``), and every finish reason a scheduler
can report (for the state graph, declared before any run)."""
from __future__ import annotations

import re
from typing import Any, List, Optional

from mtflow.core.registry import resolve_reference
from mtflow.declarative.parsers import ToolCall
from mtflow.declarative.request_state import maybe_await
from mtflow.declarative.schema import SchedulerConfig, StopConfig

__all__ = ['StopRules']


class StopRules:
    """One scheduler's stop rules, compiled once. The environment's ``env_done`` comes first and
    the idle rule and ``max_turns`` last; the scheduler checks those itself."""

    def __init__(self, config: StopConfig, base_dir: Optional[str] = None) -> None:
        self.config = config
        self.regex = [(name, re.compile(p)) for name, p in config.regex.items()]
        self.predicate = resolve_reference(config.predicate, base_dir) if config.predicate else None

    async def first_match(self, completion: str, calls: List[ToolCall], correct: Optional[bool], infer_request: Any,
                          response_choice: Any, turn: int) -> Optional[str]:
        """The finish reason of the first rule the turn matches, or ``None``."""
        stop = self.config
        if stop.correct_answer and correct:
            return 'stop_rule:correct_answer'
        for name, rx in self.regex:
            if rx.search(completion):
                return f'stop_rule:{name}'
        if stop.stop_tools and any(c.name in stop.stop_tools for c in calls):
            return 'stop_rule:stop_tool'
        if stop.on_length and response_choice.finish_reason == 'length':
            return 'length'
        if self.predicate is not None:
            verdict = await maybe_await(self.predicate(infer_request, response_choice, turn))
            if verdict:
                return f'stop_rule:{verdict}' if isinstance(verdict, str) else 'stop_rule:predicate'
        return None

    def finish_reasons(self, config: SchedulerConfig, idle_rule: str) -> List[str]:
        """The ``stop_rule:*`` reasons this scheduler can finish with (``length`` and ``max_turns``
        are core reasons, always declared)."""
        reasons = []
        if config.env:
            reasons.append('stop_rule:env_done')
            if config.env.gym is not None:  # Gymnasium's truncated (an impl env may return it too)
                reasons.append('stop_rule:env_truncated')
        if self.config.correct_answer:
            reasons.append('stop_rule:correct_answer')
        reasons += [f'stop_rule:{name}' for name, _ in self.regex]
        if self.config.stop_tools:
            reasons.append('stop_rule:stop_tool')
        if self.config.predicate:
            reasons.append('stop_rule:predicate')
        if not config.env:
            reasons.append(f'stop_rule:{idle_rule}')
        return reasons
