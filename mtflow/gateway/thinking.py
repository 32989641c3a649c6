"""The gateway's one seam to the reasoning parsers: a reply's thinking split from what it said.

A reasoning model writes its thinking into the same text as its answer. The gateway returns the
two apart (``reasoning_content`` in chat completions, a ``thinking`` block in Anthropic messages,
a ``reasoning`` item in the Responses API) and splits a stream the same way as it arrives. The
split is :mod:`mtflow.declarative.reasoning`'s (``gateway.reasoning``: ``auto`` by the tool-call
parser's family and the chat template, ``think``, ``kimi``, ``harmony``, ``none``, a registered
name or ``module:Class``), as a YAML scheduler's ``reasoning`` section splits it; this module
adds what a stream needs of it (:attr:`Thinking.markers`, :attr:`Thinking.streams`).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from mtflow.declarative.reasoning import ReasoningParser, ThinkTags, reasoning_parser, split_reasoning

__all__ = ['Thinking']


class Thinking:
    """How one gateway splits replies (``name``: the ``gateway.reasoning`` value; ``tool_parser``:
    the tool-call parser's name, for ``auto``; ``tokenizer``: the backend's, asked whether its
    chat template opens the thinking). An unknown name is a ``ValueError`` naming the key."""

    def __init__(self, name: str = 'auto', tool_parser: Optional[str] = None, tokenizer: Any = None) -> None:
        try:
            self.parser: ReasoningParser = reasoning_parser(name, tool_parser or '', tokenizer)
        except (KeyError, ImportError, TypeError) as exc:
            raise ValueError(f'gateway.reasoning: {exc.args[0] if exc.args else exc}') from None
        self.name = self.parser.name
        parser = self.parser
        #: the strings whose first characters a stream holds back until it knows what they are
        self.markers: Tuple[str, ...] = tuple(t for pair in parser.tags for t in pair) + tuple(parser.implicit_end) \
            if isinstance(parser, ThinkTags) else ()
        #: whether a growing text splits as its whole will (think tags do; harmony's channels are
        #: parsed whole: a stream holds them to the end)
        self.streams = self.name == 'none' or isinstance(parser, ThinkTags)

    def split(self, text: str, continued: bool = False) -> Tuple[str, str]:
        """``(reasoning, content)`` of a reply's text (``continued``: the turn continued the
        assistant message, so no generation prompt opened anything)."""
        split = split_reasoning(text, self.parser, continued)
        return split.reasoning, split.content
