"""gpt-oss: the harmony format, read and written by OpenAI's ``openai-harmony`` package.

A gpt-oss reply is a run of messages on channels: ``analysis`` (its reasoning), ``commentary``
(tool calls, addressed to ``functions.NAME``) and ``final`` (the answer)::

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Tokyo"}<|call|>

The reply's text (with its special tokens: the backend must not skip them) is encoded with the
harmony encoding and parsed by the package's ``StreamableParser``, token by token, so each
message's exact text is known (the gateway takes a call's text out of the content). The package
is an optional extra (``pip install 'mtflow[harmony]'``), imported when a harmony parser is made;
its parser costs about 20 us a token (``benchmarks/yaml_and_parsers.py``), so a reply that addresses no
function is not parsed at all;
it loads the ``o200k_base`` vocabulary, which it downloads once, or reads from
``$TIKTOKEN_ENCODINGS_BASE`` (offline: ``scripts/harmony_vocab.py`` writes that folder).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mtflow.declarative.parsers.base import ToolCall, ToolCallParser, json_error

__all__ = ['HarmonyParser', 'HarmonyMessage', 'harmony_messages', 'harmony_encoding']

FUNCTIONS = 'functions.'


@functools.lru_cache(maxsize=1)
def harmony_encoding() -> Any:
    """The gpt-oss encoding (loaded once); ``ImportError``/``RuntimeError`` saying what to do."""
    try:
        import openai_harmony
    except ImportError:
        raise ImportError("the harmony parser needs the openai-harmony package: pip install 'mtflow[harmony]'") \
            from None
    try:
        return openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as exc:  # HarmonyError: the vocabulary could not be downloaded or read
        raise RuntimeError(f'openai-harmony could not load the gpt-oss encoding ({exc}); without network, set '
                           'TIKTOKEN_ENCODINGS_BASE to a folder holding o200k_base.tiktoken (python '
                           'scripts/harmony_vocab.py FOLDER writes it)') from None


@functools.lru_cache(maxsize=1)
def _end_tokens(enc: Any) -> frozenset:
    """The ids of the tokens that end a message (``<|end|>``, ``<|call|>``, ``<|return|>``)."""
    return frozenset(enc.encode(t, allowed_special='all')[0] for t in ('<|end|>', '<|call|>', '<|return|>'))


@dataclass
class HarmonyMessage:
    """One message of a reply: its channel, recipient, content type and text, and ``raw``, the
    exact text it was written as (``complete``: its end token came)."""
    channel: Optional[str]
    recipient: Optional[str]
    content_type: Optional[str]
    text: str
    raw: str
    complete: bool


def harmony_messages(text: str) -> Tuple[List[HarmonyMessage], Optional[str]]:
    """The messages of a gpt-oss reply, the last one possibly unfinished; ``error``: why parsing
    stopped early (the messages before it are kept)."""
    import openai_harmony as oh

    enc = harmony_encoding()
    tokens = enc.encode(text, allowed_special='all')
    # a reply starts inside the assistant's header (the prompt wrote <|start|>assistant); a text that
    # starts a message of its own (the content once the reasoning is taken out) names its role
    parser = oh.StreamableParser(enc, None if text.startswith('<|start|>') else oh.Role.ASSISTANT)
    ends = _end_tokens(enc)
    out: List[HarmonyMessage] = []
    start, error = 0, None
    for k, token in enumerate(tokens):
        try:
            parser.process(token)
        except Exception as exc:  # HarmonyError: a token the format does not allow here
            error = f'not harmony at token {k}: {exc}'
            break
        if token not in ends:  # a message can only finish on its end token (reading messages costs a JSON round)
            continue
        finished = parser.messages
        while len(out) < len(finished):
            msg = finished[len(out)]
            out.append(HarmonyMessage(msg.channel, msg.recipient, msg.content_type,
                                      ''.join(c.text for c in msg.content if hasattr(c, 'text')),
                                      enc.decode(tokens[start:k + 1]), True))
            start = k + 1
    if start < len(tokens) and error is None:  # an unfinished message (cut, or its end token left out)
        rest = enc.decode(tokens[start:])
        if rest.strip():
            out.append(HarmonyMessage(parser.current_channel, parser.current_recipient, parser.current_content_type,
                                      parser.current_content or '', rest, False))
    return out, error


def _call(msg: HarmonyMessage) -> ToolCall:
    name = msg.recipient[len(FUNCTIONS):].strip()
    raw, closed = msg.raw, msg.complete
    payload = msg.text.strip()
    if msg.content_type and 'json' not in msg.content_type:
        return ToolCall(name, msg.text, raw, None, closed)  # a call with a text payload (content type given)
    if not payload:
        return ToolCall(name, {}, raw, None, closed)
    try:
        args = json.loads(payload)
    except json.JSONDecodeError as exc:
        return ToolCall(name, None, raw, json_error(exc, payload), closed and exc.pos < len(payload))
    except RecursionError:
        return ToolCall(name, None, raw, 'invalid JSON: nested too deeply', closed)
    if not isinstance(args, dict):
        return ToolCall(name, None, raw, 'the arguments must be a JSON object', closed)
    return ToolCall(name, args, raw, None, closed)


class HarmonyParser(ToolCallParser):
    """gpt-oss calls: messages addressed to ``functions.NAME`` (JSON arguments), any number per
    reply; the analysis channel is reasoning, never a call. Needs ``openai-harmony``."""
    name = 'harmony'
    expected = '<|start|>assistant<|channel|>commentary to=functions.<tool> <|constrain|>json<|message|>{...}<|call|>'

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        harmony_encoding()  # a missing package or vocabulary is said when the scheduler loads

    def parse(self, text: str) -> List[ToolCall]:
        if FUNCTIONS not in (text or ''):  # no message addressed to a function: no call (no parse, ~20 us a token)
            return []
        messages, error = harmony_messages(text)
        calls = [_call(m) for m in messages if (m.recipient or '').startswith(FUNCTIONS)]
        if error is not None and FUNCTIONS in text and not calls:
            calls.append(ToolCall('', None, text[-200:], error))
        return calls

    def render_tools(self, tools: Sequence[Dict[str, Any]]) -> str:
        """The developer message's tool section, as the package renders it (TypeScript-like signatures)."""
        import openai_harmony as oh

        enc = harmony_encoding()
        described = []
        for spec in tools:
            fn = spec.get('function', spec)
            described.append(oh.ToolDescription.new(fn.get('name', ''), fn.get('description') or '',
                                                    parameters=fn.get('parameters') or None))
        message = oh.Message.from_role_and_content(oh.Role.DEVELOPER,
                                                   oh.DeveloperContent.new().with_function_tools(described))
        text = enc.decode(enc.render(message))
        body = text.split('<|message|>', 1)[-1]
        return body[:-len('<|end|>')] if body.endswith('<|end|>') else body

    def render_calls(self, calls: Sequence[Tuple[str, Any]]) -> str:
        """The calls as gpt-oss writes them after its ``<|start|>assistant`` header, rendered by the package."""
        import openai_harmony as oh

        enc = harmony_encoding()
        parts = []
        for name, args in calls:
            message = (oh.Message.from_role_and_content(oh.Role.ASSISTANT, json.dumps(args, ensure_ascii=False))
                       .with_channel('commentary').with_recipient(f'{FUNCTIONS}{name}')
                       .with_content_type('<|constrain|>json'))
            parts.append(enc.decode(enc.render(message)))
        text = ''.join(parts)
        return text[len('<|start|>assistant'):] if text.startswith('<|start|>assistant') else text
