"""Tokens against the context budget, per turn (``docs/context.md``, ``docs/viewer.md``).

A run with a context budget records on the event that sends each turn what the turn was sent
with (``extra['context']``: the prompt's tokens, the ``max_tokens`` sent, the context length,
the total response budget and what was used of it before the turn). These figures put each turn
against the budget: how close the prompt plus ``max_tokens`` came to the context, and how much of
the total response budget was left. A run without a budget records none, and the views show
nothing of it, so their output is what it always was.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

__all__ = ['TurnBudget', 'BatchTurnBudget', 'turn_budgets', 'budget_per_turn', 'has_budget', 'sent_text',
           'response_text']


def _int(counts: Dict[str, Any], key: str) -> Optional[int]:
    value = counts.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class TurnBudget:
    """One turn of one request against the budget."""
    turn: int
    prompt_tokens: Optional[int]
    max_tokens: Optional[int]
    context_length: Optional[int]
    prompt_limit: Optional[int]
    used: Optional[int]  # response tokens used by the turns before this one
    total: Optional[int]  # the total response budget
    asked: Optional[int]  # the per-turn max_tokens, when this turn's was cut below it

    @classmethod
    def of(cls, turn: int, counts: Dict[str, Any]) -> 'TurnBudget':
        return cls(turn, _int(counts, 'prompt_tokens'), _int(counts, 'max_tokens'), _int(counts, 'context_length'),
                   _int(counts, 'prompt_limit'), _int(counts, 'used_response_tokens'),
                   _int(counts, 'total_response_tokens'), _int(counts, 'max_tokens_asked'))

    @property
    def sent(self) -> Optional[int]:
        """The prompt tokens plus the ``max_tokens`` sent: what the turn could hold at most."""
        if self.prompt_tokens is None:
            return None
        return self.prompt_tokens + (self.max_tokens or 0)

    @property
    def share(self) -> Optional[float]:
        """:attr:`sent` as a share of the context length."""
        if self.sent is None or not self.context_length:
            return None
        return self.sent / self.context_length

    @property
    def left(self) -> Optional[int]:
        """What was left of the total response budget when the turn was sent."""
        return None if self.total is None or self.used is None else self.total - self.used


def turn_budgets(view: Any) -> List[TurnBudget]:
    """The turns of one request (a :class:`~mtflow.viewer.model.RequestView`) that were sent
    under a budget, in order."""
    return [TurnBudget.of(c.turn, c.budget) for c in view.cells if c.budget]


def has_budget(views: Sequence[Any]) -> bool:
    return any(c.budget for v in views for c in v.cells)


def sent_text(b: TurnBudget) -> str:
    """``466 + 8 = 474 / 600 (79%)``, with ``(max_tokens cut from 40)`` after a cut."""
    if b.prompt_tokens is None:
        text = f'? + {b.max_tokens}' if b.max_tokens is not None else '?'
    else:
        text = f'{b.prompt_tokens} + {b.max_tokens or 0} = {b.sent}'
    if b.context_length:
        text += f' / {b.context_length}'
        if b.share is not None:
            text += f' ({100 * b.share:.0f}%)'
    if b.asked is not None:
        text += f' (max_tokens cut from {b.asked})'
    return text


def response_text(used: Optional[int], total: Optional[int]) -> str:
    """``90 / 100 used, 10 left`` (empty without a total response budget)."""
    if total is None or used is None:
        return ''
    return f'{used} / {total} used, {total - used} left'


@dataclass(frozen=True)
class BatchTurnBudget:
    """One turn across the requests sent in it: the fullest prompt plus ``max_tokens`` against
    the context, how many had their ``max_tokens`` cut, and the least total budget left."""
    turn: int
    requests: int
    fullest: TurnBudget  # the request closest to the context (the largest prompt + max_tokens)
    fullest_uuid: str
    cut: int
    least_left: Optional[int]
    total: Optional[int]


def budget_per_turn(views: Sequence[Any]) -> List[BatchTurnBudget]:
    """Per turn, the batch against the budget (empty when the run had no budget)."""
    per: Dict[int, List[tuple]] = {}
    for v in views:
        for b in turn_budgets(v):
            per.setdefault(b.turn, []).append((v.uuid, b))
    out = []
    for turn in sorted(per):
        rows = per[turn]
        uuid, fullest = max(rows, key=lambda r: -1 if r[1].sent is None else r[1].sent)
        lefts = [b.left for _, b in rows if b.left is not None]
        totals = [b.total for _, b in rows if b.total is not None]
        out.append(BatchTurnBudget(turn, len(rows), fullest, uuid, sum(1 for _, b in rows if b.asked is not None),
                                   min(lefts) if lefts else None, max(totals) if totals else None))
    return out
