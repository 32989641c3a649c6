"""What the YAML scheduler remembers about one request between its hooks (``on_turn_end`` decides
what ``step`` does), and how it awaits user code that may be sync or async."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from mtflow.declarative.parsers import ToolCall
from mtflow.declarative.schema import TipConfig
from mtflow.tools.runner import ToolResult

__all__ = ['RequestState', 'maybe_await']


async def maybe_await(value: Any) -> Any:
    """The value of a call to user code (an environment, a predicate, a reward): awaited when the
    code was ``async``."""
    return await value if inspect.isawaitable(value) else value


@dataclass
class RequestState:
    """One request's counters, and what its next ``step`` must do: give ``tip``, show ``env_obs``
    (the environment's observation) or run ``calls``."""
    tool_calls: int = 0
    tool_errors: int = 0
    error_kinds: Dict[str, int] = field(default_factory=dict)
    tips_given: Dict[str, int] = field(default_factory=dict)
    calls: List[ToolCall] = field(default_factory=list)
    #: the ids of ``calls`` when the server returned them structured (its tool messages answer them),
    #: and what the trace says of where they came from (``tool_calls_from``, ``text_calls_ignored``)
    call_ids: Optional[List[str]] = None
    calls_from: Dict[str, Any] = field(default_factory=dict)
    tip: Optional[TipConfig] = None
    env: Any = None
    env_obs: Optional[str] = None
    env_error: Optional[BaseException] = None  # the reset failed: raised at the request's first turn
    rewards: List[float] = field(default_factory=list)
    #: per-turn rewards (``mtflow.accounting.turn_spans``): env steps, tool rewards, ``turn_reward``
    turn_rewards: List[Dict[str, Any]] = field(default_factory=list)
    answer_correct: Optional[bool] = None
    #: the next turn continues the assistant message (inline text was appended): no generation
    #: prompt opened a thinking block for it (:mod:`mtflow.declarative.reasoning`)
    continued: bool = False
    #: a replayable environment (``replayable = True``): the request it was reset with, and each
    #: action it was stepped with and the observation it gave, so that a fork can replay it
    env_reset: Any = None
    env_actions: List[Tuple[str, Any]] = field(default_factory=list)

    def counters(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {'tool_calls': self.tool_calls, 'tool_errors': self.tool_errors}
        if self.error_kinds:
            out['tool_error_kinds'] = dict(self.error_kinds)
        if self.tips_given:
            out['tips_given'] = dict(self.tips_given)
        return out

    def count_calls(self, results: List[ToolResult]) -> List[ToolResult]:
        """Count one turn's call results; the failed ones."""
        self.tool_calls += len(results)
        failed = [r for r in results if not r.ok]
        self.tool_errors += len(failed)
        for r in failed:
            self.error_kinds[r.error_kind] = self.error_kinds.get(r.error_kind, 0) + 1
        return failed
