"""The ``context:`` block of a run config: context budgets and the compaction policy in YAML.

::

    context:
      context_length: null          # null: the backend's own (HF config, vLLM max_model_len)
      max_tokens: 64                # per turn (null: request_config.max_tokens)
      total_response_tokens: 400    # sampled tokens per trajectory; max_tokens shrinks to the rest
      prompt_budget: null           # the most prompt tokens a turn may send
      policy: drop_observations     # stop | drop_observations | summarize | 'module:function' (a hook)
      keep_last_turns: 2
      count_tokens: backend         # backend (its exact prompt ids) | words | 'module:function'

It becomes a :class:`mtflow.ContextBudget` against the run's backend (:meth:`ContextConfig.budget`):
the backend counts the prompt tokens (``count_prompt_tokens``) and reports its context length
(``context_length``); a ``context_length`` above the backend's is an error naming the key.
``docs/context.md`` explains each key.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from pydantic import Field

from mtflow.core.errors import UserError
from mtflow.core.keys import StrictModel
from mtflow.core.registry import resolve_reference
from mtflow.engine.context_budget import DEFAULT_PLACEHOLDER, DEFAULT_SUMMARY_PROMPT, POLICIES, ContextBudget

__all__ = ['ContextConfig', 'count_words']


def count_words(request: Any) -> int:
    """A prompt's tokens counted as whitespace-separated words (for backends without a tokenizer,
    such as the scripted one, whose tokens are what its script says)."""
    return sum(len(str(m.get('content') or '').split()) for m in request.messages)


class ContextConfig(StrictModel):
    """The ``context:`` block (see the module docstring)."""

    context_length: Optional[int] = Field(None, ge=1, description="The engine's context in tokens; null: the "
                                          "backend's own.")
    max_tokens: Optional[int] = Field(None, ge=1, description='Per-turn generation cap; null: '
                                      'request_config.max_tokens.')
    total_response_tokens: Optional[int] = Field(None, ge=1, description='Sampled tokens one trajectory may use; '
                                                 "each turn's max_tokens shrinks to the rest (length_total at 0).")
    prompt_budget: Optional[int] = Field(None, ge=1, description='The most prompt tokens a turn may send.')
    policy: str = Field('stop', description="What a turn that does not fit does: stop (context_full), "
                        "drop_observations, summarize, or 'module:function' (on_context_full(request, budget) -> "
                        'messages).')
    keep_last_turns: int = Field(2, ge=0, description='drop_observations / summarize: the turns kept whole.')
    placeholder: str = Field(DEFAULT_PLACEHOLDER, description='drop_observations: what an older observation '
                             'becomes.')
    summary_max_tokens: int = Field(256, ge=1, description="summarize: the summary call's max_tokens.")
    summary_prompt: str = Field(DEFAULT_SUMMARY_PROMPT, description="summarize: the summary call's system prompt.")
    summarizer: Optional[str] = Field(None, description="summarize: 'module:function' (messages -> str) instead of "
                                      "the run's own model.")
    count_tokens: str = Field('backend', description="How prompt tokens are counted: backend (the exact prompt ids), "
                              "words, or 'module:function' (request -> int).")

    def budget(self, backend: Any, base_dir: Optional[str] = None, where: str = 'context') -> ContextBudget:
        """The :class:`mtflow.ContextBudget` of this block for ``backend``; a :class:`UserError`
        naming the key when a reference cannot be resolved or the backend cannot serve it."""
        policy: Any = self.policy
        if policy not in POLICIES:
            policy = self._reference('policy', policy, base_dir, where)
        summarizer = self._reference('summarizer', self.summarizer, base_dir, where) if self.summarizer else None
        model_length = getattr(backend, 'context_length', None)
        if self.context_length and isinstance(model_length, int) and self.context_length > model_length:
            raise UserError(f'{where}.context_length: {self.context_length} is larger than the model\'s context '
                            f'({model_length} tokens, as the {getattr(backend, "name", "")} backend reports it); '
                            f'lower it or leave it unset to use the model\'s')
        length = self.context_length or (model_length if isinstance(model_length, int) else None)
        counter: Optional[Callable[[Any], int]]
        if self.count_tokens == 'backend':
            counter = getattr(backend, 'count_prompt_tokens', None)
            if counter is None and (length or self.prompt_budget):
                raise UserError(f'{where}.count_tokens: the {getattr(backend, "name", "")} backend cannot count '
                                f'prompt tokens; set count_tokens: words or \'module:function\'')
        elif self.count_tokens == 'words':
            counter = count_words
        else:
            counter = self._reference('count_tokens', self.count_tokens, base_dir, where)
        try:
            return ContextBudget(context_length=length, max_tokens=self.max_tokens,
                                 total_response_tokens=self.total_response_tokens, prompt_budget=self.prompt_budget,
                                 policy=policy, keep_last_turns=self.keep_last_turns, placeholder=self.placeholder,
                                 summarizer=summarizer, summary_max_tokens=self.summary_max_tokens,
                                 summary_prompt=self.summary_prompt, count_tokens=counter)
        except (TypeError, ValueError) as exc:
            raise UserError(f'{where}: {exc}') from exc

    @staticmethod
    def _reference(key: str, ref: str, base_dir: Optional[str], where: str) -> Any:
        try:
            value = resolve_reference(ref, base_dir)
        except Exception as exc:
            raise UserError(f'{where}.{key}: cannot resolve {ref!r} (a policy name: {", ".join(POLICIES)}; or '
                            f"'module:function'): {exc}") from exc
        if not callable(value):
            raise UserError(f'{where}.{key}: {ref!r} is not callable')
        return value
