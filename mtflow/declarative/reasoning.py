"""Reasoning split from the answer: what a reply thought, and what it said.

A reasoning model writes its thinking into the same text as its answer: ``<think>...</think>``
(Qwen3, DeepSeek-R1/V3.1/V3.2, GLM-4.5+, MiniMax-M2, Kimi-K2-Thinking), harmony's ``analysis``
channel (gpt-oss), Kimi's ``◁think▷...◁/think▷``. :func:`split_reasoning` separates the two, so
that stop rules, answers, rewards and tool calls see what the model said (``content``), and the
trajectory keeps both: the assistant message's ``content`` and ``reasoning_content``. The token
record is never touched: the ids the model sampled, with their loss mask and logprobs, stay whole
(reasoning is trained as it was sampled); only the text is split.

The gateway (:mod:`mtflow.gateway`) calls :func:`split_reasoning` to return ``reasoning_content``.

========================  ==========================================================================
reasoning parser          splits
========================  ==========================================================================
``think``                 ``<think>R</think>C``; ``R</think>C`` when the chat template opened
                          ``<think>`` in the generation prompt (Qwen3-2507 thinking, Qwen3.5,
                          DeepSeek-R1-0528, MiniMax-M2, GLM-4.5 with thinking on); a reply with
                          neither tag is all reasoning when the prompt opened it (cut by
                          ``max_tokens``), else all content
``kimi``                  ``think`` with Kimi's markers too (``◁think▷``), and a tool-call section
                          ending the thinking without ``</think>``
``harmony``               gpt-oss: the ``analysis`` messages are the reasoning, the rest the content
``none``                  nothing (the text is all content)
========================  ==========================================================================

``reasoning: auto`` (the default) picks by the tool-call parser's family (``harmony`` for gpt-oss,
``kimi`` for Kimi, ``think`` otherwise) and asks the chat template, when there is one, whether its
generation prompt opens ``<think>``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mtflow.core.registry import Registry
from mtflow.declarative.parsers import PARSERS
from mtflow.declarative.parsers.harmony import MARKERS as HARMONY_MARKERS, harmony_encoding, harmony_messages

__all__ = ['Split', 'ReasoningParser', 'ThinkTags', 'KimiThinking', 'HarmonyChannels', 'REASONING',
           'split_reasoning', 'reasoning_parser', 'opens_thinking', 'split_messages', 'family_mismatch']


@dataclass(frozen=True)
class Split:
    """A reply's reasoning (``''`` when none) and content: the reply without the reasoning (and
    without the tags around it); the tool-call markup of the content is kept as written."""
    reasoning: str
    content: str


class ReasoningParser:
    """Base: no reasoning. ``split(text, continued, opened)``: ``continued`` is True for a turn that
    continued the assistant message (no generation prompt opened anything); ``opened``: whether this
    reply's generation prompt opened a thinking block (``None``: the parser's ``opened_in_prompt``).
    ``special_markers``: markers it reads that are special tokens of its models' tokenizers (as
    :attr:`ToolCallParser.special_markers <mtflow.declarative.parsers.ToolCallParser>`)."""
    name = 'none'
    opened_in_prompt: Optional[bool] = None
    special_markers: Tuple[str, ...] = ()

    def split(self, text: str, continued: bool = False, opened: Optional[bool] = None) -> Split:
        return Split('', text)


class ThinkTags(ReasoningParser):
    """``<think>...</think>`` blocks (see the module docstring). ``opened_in_prompt``: the chat
    template's generation prompt ends with the opening tag (``None``: unknown, then a reply with
    ``</think>`` and no ``<think>`` before it is still read as opened); ``implicit_end``: markers that
    end the thinking without the closing tag (a tool-call section)."""
    name = 'think'
    tags: Sequence[Tuple[str, str]] = (('<think>', '</think>'), )
    implicit_end: Sequence[str] = ()

    def __init__(self, opened_in_prompt: Optional[bool] = None) -> None:
        self.opened_in_prompt = opened_in_prompt
        starts = '|'.join(re.escape(s) for s, _ in self.tags)
        self._start = re.compile(starts)
        self._ends = {s: e for s, e in self.tags}

    def _first_end(self, text: str, pos: int, end_tag: Optional[str]) -> Tuple[int, int]:
        """``(where the reasoning stops, where the content resumes)`` from ``pos``; ``(-1, -1)``: no end."""
        ends = [e for _, e in self.tags] if end_tag is None else [end_tag]
        found = [(i, i + len(e)) for e in ends for i in [text.find(e, pos)] if i >= 0]
        found += [(i, i) for m in self.implicit_end for i in [text.find(m, pos)] if i >= 0]
        return min(found) if found else (-1, -1)

    def split(self, text: str, continued: bool = False, opened: Optional[bool] = None) -> Split:
        reasoning: List[str] = []
        content: List[str] = []
        pos = 0
        first = self._start.search(text)
        stop, resume = self._first_end(text, 0, None)
        opened = (self.opened_in_prompt if opened is None else opened) and not continued
        if stop >= 0 and (first is None or first.start() >= stop) and resume > stop:
            # R</think>C: the block was opened before this text (by the prompt, or an earlier turn continued)
            reasoning.append(text[:stop])
            pos = resume
        elif opened and first is None and stop < 0:  # no tag at all, the prompt opened it: cut while thinking
            return Split(text, '')
        elif opened and first is None:  # ended by an implicit marker (a tool-call section)
            return Split(text[:stop], text[stop:])
        while True:
            m = self._start.search(text, pos)
            if m is None:
                content.append(text[pos:])
                break
            content.append(text[pos:m.start()])
            stop, resume = self._first_end(text, m.end(), self._ends.get(m.group(0)))
            if stop < 0:  # an unclosed block: the rest is reasoning (cut by max_tokens)
                reasoning.append(text[m.end():])
                break
            reasoning.append(text[m.end():stop])
            pos = resume
        return Split('\n'.join(reasoning), ''.join(content))


class KimiThinking(ThinkTags):
    """Kimi-K2-Thinking / K2.5 (``<think>``) and Kimi-VL/K1.5 (``◁think▷...◁/think▷``); a tool-call
    section ends the thinking even without its closing tag."""
    name = 'kimi'
    tags = (('<think>', '</think>'), ('◁think▷', '◁/think▷'))
    implicit_end = ('<|tool_calls_section_begin|>', )
    special_markers = implicit_end


class HarmonyChannels(ReasoningParser):
    """gpt-oss: the ``analysis`` messages are the reasoning (their texts, joined by a newline); the
    content is the reply without them (its ``commentary`` calls and ``final`` answer as written)."""
    name = 'harmony'
    special_markers = HARMONY_MARKERS

    def __init__(self, opened_in_prompt: Optional[bool] = None) -> None:
        harmony_encoding()  # the missing package or vocabulary is said when the scheduler loads

    def split(self, text: str, continued: bool = False, opened: Optional[bool] = None) -> Split:
        if '<|channel|>analysis' not in text:  # nothing to split: no parse (openai-harmony's ~20 us a token)
            return Split('', text)
        messages, _ = harmony_messages(text)
        thought = [m for m in messages if m.channel == 'analysis' and not m.recipient]
        if not thought:
            return Split('', text)
        content = text
        for m in thought:
            content = content.replace(m.raw, '', 1)
        return Split('\n'.join(m.text for m in thought), content)


class NoReasoning(ReasoningParser):
    def __init__(self, opened_in_prompt: Optional[bool] = None) -> None:
        pass


#: name -> factory(opened_in_prompt=...) -> a reasoning parser
REASONING = Registry('mtflow.reasoning', 'unknown reasoning parser {name} (known: {known}, auto, or module:Class)',
                     builtins={'think': ThinkTags, 'kimi': KimiThinking, 'harmony': HarmonyChannels,
                               'none': NoReasoning})
#: tool-call parser -> the reasoning its family writes (``reasoning: auto``); others: ``think``
FAMILY = {'harmony': 'harmony', 'gpt_oss': 'harmony', 'kimi_k2': 'kimi', 'kimi': 'kimi'}


#: why a family's own reasoning read by another parser goes wrong without an error
_OWN_REASONING = {'harmony': "gpt-oss writes its thinking in harmony's analysis channel, which {name} does not "
                             "read: the thinking would stay in the content (stop rules, answers and rewards read it)",
                  'kimi': "a Kimi-K2 reply's tool-call section ends its thinking without </think>, which {name} "
                          "does not know: the calls after an unclosed <think> would be read as thought, never run"}


def family_mismatch(name: str, tool_parser: str) -> Optional[str]:
    """Why the reasoning parser ``name`` cannot split what ``tool_parser``'s models write (``None``:
    it can, or mtflow cannot tell: ``auto``, ``none``, a parser of the user's own). Checked when a
    scheduler loads, since the wrong split loses calls or keeps thinking in the answer silently."""
    own = FAMILY.get(tool_parser)
    if own is not None and name in ('think', 'kimi', 'harmony') and name != own:
        why = _OWN_REASONING[own].format(name=repr(name))
    elif own is None and name == 'harmony' and tool_parser in PARSERS and str(getattr(PARSERS[tool_parser], '__module__', '')).startswith(
            'mtflow.'):  # one of mtflow's parsers (a user's own may read harmony)
        why = (f"'harmony' reads only gpt-oss's analysis channel (parser: harmony), which {tool_parser} models do "
               "not write: their <think> blocks would stay in the content")
    else:
        return None
    return f'{name!r} does not split what parser {tool_parser!r} reads: {why}; give reasoning: auto (here ' \
           f'{FAMILY.get(tool_parser, "think")}) or none'


def opens_thinking(tokenizer: Any, chat_template: Optional[str] = None,
                   template_kwargs: Optional[Dict[str, Any]] = None) -> Optional[bool]:
    """Whether the chat template's generation prompt opens a thinking block (ends with ``<think>``
    or ``◁think▷``, whitespace aside), rendered with ``template_kwargs`` (a request's
    ``chat_template_kwargs``: ``enable_thinking: false`` closes it); ``None`` when there is no
    template to ask."""
    if tokenizer is None or not (chat_template or getattr(tokenizer, 'chat_template', None)):
        return None
    kwargs: Dict[str, Any] = dict(template_kwargs or {})
    if chat_template:
        kwargs['chat_template'] = chat_template
    try:
        text = tokenizer.apply_chat_template([{'role': 'user', 'content': 'Hi'}], tokenize=False,
                                             add_generation_prompt=True, **kwargs)
    except Exception:  # a template that cannot render this probe says nothing about thinking
        return None
    return str(text).rstrip().endswith(('<think>', '◁think▷'))


def reasoning_parser(name: str, tool_parser: str = '', tokenizer: Any = None, chat_template: Optional[str] = None,
                     opened_in_prompt: Optional[bool] = None, base_dir: Optional[str] = None) -> ReasoningParser:
    """The reasoning parser ``name`` names (``auto``: by ``tool_parser``'s family), told whether the
    template opens the thinking (given, else asked of the template)."""
    if name == 'auto':
        name = FAMILY.get(tool_parser, 'think')
    if opened_in_prompt is None and name != 'none':
        opened_in_prompt = opens_thinking(tokenizer, chat_template)
    return REASONING.get(name, base_dir)(opened_in_prompt=opened_in_prompt)


def split_reasoning(text: str, parser: Optional[ReasoningParser], continued: bool = False,
                    opened: Optional[bool] = None) -> Split:
    """``text`` split by ``parser`` (``None``: all content); ``opened``: the reply's generation prompt
    opened a thinking block (``None``: the parser's default). The gateway's entry point."""
    if parser is None or not text:
        return Split('', text or '')
    return parser.split(text, continued, opened)


def split_messages(messages: List[Dict[str, Any]], parser: Optional[ReasoningParser], first: int = 0,
                   opened: Optional[bool] = None) -> List[Dict[str, Any]]:
    """``messages`` with each assistant message from index ``first`` on split into ``content`` and
    ``reasoning_content`` (new dicts; a message without reasoning, or one that has its own
    ``reasoning_content``, is kept as it is)."""
    out = list(messages)
    for k in range(first, len(out)):
        m = out[k]
        if m.get('role') != 'assistant' or not isinstance(m.get('content'), str) or 'reasoning_content' in m:
            continue
        split = split_reasoning(m['content'], parser, opened=opened)
        if split.reasoning:
            out[k] = dict(m, content=split.content, reasoning_content=split.reasoning)
    return out
