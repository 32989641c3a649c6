"""The context budget of a run (``Executor(context=ContextBudget(...))``, YAML ``context:``).

Agent episodes outgrow the model's context; without a budget the prompt grows each turn until a
backend fails, truncates, or generates past its trained length without a word. A budget says
how much each trajectory may use, so that a turn is never sent when it cannot fit
(``docs/context.md``):

* ``context_length``: the engine's context (prompt plus generated tokens); ``None`` takes the
  backend's own (``rollout_fn.context_length``: the HF config's ``max_position_embeddings``,
  vLLM's ``max_model_len``); a budget larger than the backend's is an error when the executor is
  built;
* ``max_tokens``: the per-turn generation cap (``None``: the request config's ``max_tokens``);
* ``total_response_tokens``: the sampled tokens one trajectory may use over all its turns; each
  turn's ``max_tokens`` shrinks to what is left, and the request finishes ``length_total`` at 0;
* ``prompt_budget``: the most prompt tokens a turn may send (below the context length, e.g. to
  keep room for a long answer);
* ``policy``: what a turn that does not fit does: ``'stop'`` (finish ``context_full``),
  ``'drop_observations'`` (keep the system prompt, the task and the last ``keep_last_turns``
  turns; older observations become ``placeholder``), ``'summarize'`` (a model call writes a
  summary of the older turns: ``summarizer`` or the run's own ``rollout_fn``), or a callable
  ``on_context_full(request, budget) -> messages``.

This module is plain data (checked once, when built); :mod:`mtflow.engine.context` applies it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Union

__all__ = ['ContextBudget', 'BudgetView', 'POLICIES', 'DEFAULT_PLACEHOLDER', 'DEFAULT_SUMMARY_PROMPT']

#: the named compaction policies (a callable is the fourth kind: the ``on_context_full`` hook)
POLICIES = ('stop', 'drop_observations', 'summarize')

DEFAULT_PLACEHOLDER = '[observation dropped to fit the context]'
DEFAULT_SUMMARY_PROMPT = ('Summarize the conversation below for the assistant who will continue it: keep every '
                          'fact, result and decision it still needs, in a few sentences.')


def _positive(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f'context.{name} must be None or an int >= 1, not {value!r}')


@dataclass(frozen=True)
class ContextBudget:
    """The budgets and the compaction policy of a run (see the module docstring)."""
    context_length: Optional[int] = None
    max_tokens: Optional[int] = None
    total_response_tokens: Optional[int] = None
    prompt_budget: Optional[int] = None
    policy: Union[str, Callable[..., Any]] = 'stop'
    keep_last_turns: int = 2
    placeholder: str = DEFAULT_PLACEHOLDER
    summarizer: Optional[Callable[[List[dict]], str]] = None
    summary_max_tokens: int = 256
    summary_prompt: str = DEFAULT_SUMMARY_PROMPT
    count_tokens: Optional[Callable[[Any], int]] = None

    def __post_init__(self) -> None:
        for name in ('context_length', 'max_tokens', 'total_response_tokens', 'prompt_budget'):
            _positive(name, getattr(self, name))
        _positive('summary_max_tokens', self.summary_max_tokens)
        if isinstance(self.keep_last_turns, bool) or not isinstance(self.keep_last_turns, int) or \
                self.keep_last_turns < 0:
            raise ValueError(f'context.keep_last_turns must be an int >= 0, not {self.keep_last_turns!r}')
        if not callable(self.policy) and self.policy not in POLICIES:
            raise ValueError(f'context.policy must be one of {", ".join(POLICIES)} or a callable '
                             f'on_context_full(request, budget) -> messages, not {self.policy!r}')
        for name in ('summarizer', 'count_tokens'):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f'context.{name} must be callable, not {type(value).__name__}')
        if self.context_length is not None and self.max_tokens is not None and \
                self.max_tokens >= self.context_length:
            raise ValueError(f'context.max_tokens ({self.max_tokens}) leaves no room for a prompt in '
                             f'context.context_length ({self.context_length})')

    @property
    def policy_name(self) -> str:
        """The policy as the trace names it (a hook: ``hook:<its name>``)."""
        if callable(self.policy):
            return f'hook:{getattr(self.policy, "__name__", type(self.policy).__name__)}'
        return str(self.policy)


@dataclass(frozen=True)
class BudgetView:
    """What an ``on_context_full`` hook is told about the turn that does not fit."""
    context_length: Optional[int]
    prompt_limit: Optional[int]
    prompt_tokens: int
    max_tokens: int
    used_response_tokens: int
    turn: int
    count_tokens: Callable[[Any], int]
