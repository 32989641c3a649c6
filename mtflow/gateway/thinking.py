"""The gateway's one seam to reasoning parsers: a reply's thinking split from what it said.

A reasoning model writes its thinking into the same text as its answer. The gateway returns the
two apart (``reasoning_content`` in chat completions, a ``thinking`` block in Anthropic messages,
a ``reasoning`` item in the Responses API) and splits a stream the same way as it arrives. Every
use goes through :class:`Thinking`, so the parsers of the model-formats work (issue 46,
``mtflow.declarative.reasoning``) replace the think tags below in this one place when they land.

Until then: ``<think>R</think>C`` blocks, and ``R</think>C`` when the chat template's generation
prompt opened ``<think>`` itself (then a reply with no tag at all is all reasoning: cut by
``max_tokens`` while thinking). ``reasoning: none`` keeps the whole text as content.
"""
from __future__ import annotations

import re
from typing import Any, Optional, Tuple

__all__ = ['Thinking', 'REASONING_CHOICES']

#: the ``gateway.reasoning`` values
REASONING_CHOICES = ('auto', 'think', 'none')
_OPEN, _CLOSE = '<think>', '</think>'


def _opens_thinking(tokenizer: Any) -> bool:
    """Whether the chat template's generation prompt ends by opening a thinking block."""
    if tokenizer is None or not getattr(tokenizer, 'chat_template', None):
        return False
    try:
        text = tokenizer.apply_chat_template([{'role': 'user', 'content': 'Hi'}], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # a template that cannot render the probe says nothing about thinking
        return False
    return str(text).rstrip().endswith(_OPEN)


class Thinking:
    """How one gateway splits replies (``name``: a ``gateway.reasoning`` value; ``tokenizer``: the
    backend's, asked whether its template opens the thinking)."""

    def __init__(self, name: str = 'auto', tool_parser: Optional[str] = None, tokenizer: Any = None) -> None:
        if name not in REASONING_CHOICES:
            raise ValueError(f'gateway.reasoning: {name!r} is not one of {", ".join(REASONING_CHOICES)}')
        self.name = 'none' if name == 'none' else 'think'
        self.opened_in_prompt = self.name != 'none' and _opens_thinking(tokenizer)
        #: the strings whose first characters a stream holds back until it knows what they are
        self.markers: Tuple[str, ...] = (_OPEN, _CLOSE) if self.name != 'none' else ()

    def split(self, text: str, continued: bool = False) -> Tuple[str, str]:
        """``(reasoning, content)`` of a reply's text (``continued``: the turn continued the
        assistant message, so no generation prompt opened anything)."""
        if self.name == 'none' or not text:
            return '', text or ''
        opened = self.opened_in_prompt and not continued
        reasoning, content, pos = [], [], 0
        close = text.find(_CLOSE)
        first = text.find(_OPEN)
        if close >= 0 and (first < 0 or first > close):  # R</think>C: opened before this text
            reasoning.append(text[:close])
            pos = close + len(_CLOSE)
        elif opened and first < 0:  # the prompt opened it and nothing closed it: all thinking
            return text, ''
        for m in re.finditer(re.escape(_OPEN), text):
            if m.start() < pos:
                continue
            content.append(text[pos:m.start()])
            end = text.find(_CLOSE, m.end())
            if end < 0:  # an unclosed block: the rest is thinking (cut by max_tokens)
                reasoning.append(text[m.end():])
                pos = len(text)
                break
            reasoning.append(text[m.end():end])
            pos = end + len(_CLOSE)
        content.append(text[pos:])
        return '\n'.join(reasoning), ''.join(content)
