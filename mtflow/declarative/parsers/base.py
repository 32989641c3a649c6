"""What every tool-call parser shares: the :class:`ToolCall` record, the :class:`ToolCallParser`
base class, and the helpers for the JSON that models write (several values in a row, string
arguments, the OpenAI ``function`` wrapper) and for reasoning text (``<think>`` blocks, with or
without their opening tag).
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple


@dataclass
class ToolCall:
    """One parsed call. ``error`` is set (and ``name`` may be empty) when the text was malformed.

    ``complete`` is False when the call runs to the end of the text without the delimiter that
    closes it in its format (``</tool_call>``, ``<｜tool▁call▁end｜>``, a terminating label): a
    reply cut by ``max_tokens`` (``finish_reason == 'length'``) then has a truncated call, which
    the scheduler treats as malformed and never runs. (A stop string may also have eaten the
    closing tag, so an unclosed call of a reply that stopped normally is still run.)

    ``text_values`` is set by the XML formats (Qwen3-Coder, GLM, MiniMax-M2), whose parameter
    values are text: :func:`~mtflow.declarative.parsers.schema_types.typed_calls` converts each by
    the tool's JSON schema (an integer parameter ``"5"`` becomes ``5``); a parameter the schema does
    not describe stays text (``'text'``) or is read as JSON when it parses (``'json'``, GLM)."""
    name: str
    arguments: Any
    raw: str
    error: Optional[str] = None
    complete: bool = True
    text_values: Optional[str] = None


class ToolCallParser:
    """Base class: override :meth:`parse` and, if the model needs another format, :meth:`render_tools`.

    ``expected`` shows the model what a call looks like in this format; error observations quote it."""
    name = 'base'
    expected = '{"name": "<tool>", "arguments": {...}}'

    def __init__(self, **options: Any) -> None:
        if options:
            raise ValueError(f'parser {self.name!r} takes no options, got {sorted(options)}')

    def parse(self, text: str) -> List[ToolCall]:
        raise NotImplementedError

    def render_tools(self, tools: Sequence[Dict[str, Any]]) -> str:
        """The tools (OpenAI function specs) as text for the system prompt."""
        return '\n'.join(json.dumps(t, ensure_ascii=False) for t in tools)

    def render_calls(self, calls: Sequence[Tuple[str, Any]]) -> str:
        """The text a model of this format writes for ``calls`` (``(name, arguments)`` pairs), which
        :meth:`parse` reads back as those calls (the gateway writes a client's tool calls it did not
        produce this way). The default: :func:`json_calls`."""
        return json_calls(calls)


def json_calls(calls: Sequence[Tuple[str, Any]]) -> str:
    """``calls`` (``(name, arguments)`` pairs) as one JSON object per line: the default rendering
    of a parser, and the gateway's where no parser is configured."""
    return '\n'.join(json.dumps({'name': name, 'arguments': args}, ensure_ascii=False) for name, args in calls)


_THINK = re.compile(r'<think>.*?(?:</think>|$)', re.DOTALL)


def strip_thinking(text: str) -> str:
    """``text`` without its reasoning: ``<think>...</think>`` blocks, and everything before a
    ``</think>`` whose ``<think>`` was in the prompt (Qwen3, DeepSeek-R1 templates open the block
    themselves). Calls mentioned while thinking are not calls."""
    close = text.find('</think>')
    if close >= 0:
        opening = text.find('<think>')
        if opening < 0 or opening > close:
            text = text[close + len('</think>'):]
    return _THINK.sub('', text) if '<think>' in text else text


def json_error(exc: json.JSONDecodeError, text: str) -> str:
    where = f'at line {exc.lineno} column {exc.colno}'
    if exc.pos >= len(text.rstrip()):
        return f'invalid JSON: the text ends inside the JSON value ({exc.msg} {where})'
    return f'invalid JSON: {exc.msg} {where}'


def loads_lenient(payload: str) -> Any:
    """JSON from a model: exact first; then the first complete JSON value (trailing text ignored);
    ``ValueError`` with json's message otherwise."""
    payload = payload.strip()
    try:
        return json.loads(payload)
    except json.JSONDecodeError as exc:
        first_error = exc
    except RecursionError:
        raise ValueError('invalid JSON: nested too deeply') from None
    start = min((i for i in (payload.find('{'), payload.find('[')) if i >= 0), default=-1)
    if start >= 0:
        try:
            value, _ = json.JSONDecoder().raw_decode(payload[start:])
            return value
        except (json.JSONDecodeError, RecursionError):
            pass
    if payload.startswith('{') and "'" in payload:  # a Python dict literal (Hermes-2-Pro writes these)
        try:
            value = ast.literal_eval(payload)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
        else:
            if isinstance(value, dict):
                return value
    raise ValueError(json_error(first_error, payload))


_DECODER = json.JSONDecoder()
_WS = re.compile(r'[\s,;]*')


def json_values(text: str, pos: int = 0) -> Tuple[List[Any], int, Optional[str]]:
    """Consecutive JSON objects/lists from ``pos`` (separated by whitespace, ``,`` or ``;``):
    ``(values, end position, error)``; ``error`` is json's message for a value that starts with
    ``{`` or ``[`` but does not decode (the values before it are kept)."""
    values: List[Any] = []
    while True:
        at = _WS.match(text, pos).end()
        if at >= len(text) or text[at] not in '{[':
            return values, (pos if values else at), None
        try:
            value, end = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError as exc:
            return values, at, json_error(exc, text)
        except RecursionError:
            return values, at, 'invalid JSON: nested too deeply'

        values.append(value)
        pos = end


def call_from_obj(obj: Any, raw: str, complete: bool = True) -> ToolCall:
    """A call from a decoded ``{"name": ..., "arguments": ...}`` (``parameters`` as Llama writes it,
    the OpenAI ``function`` wrapper and string-encoded arguments accepted)."""
    if isinstance(obj, dict) and isinstance(obj.get('function'), dict):
        obj = obj['function']
    if not isinstance(obj, dict):
        return ToolCall('', None, raw, f'a tool call must be a JSON object, got {type(obj).__name__}', complete)
    name = obj.get('name')
    if not isinstance(name, str) or not name:
        return ToolCall('', None, raw, 'the tool call has no "name"', complete)
    args = obj.get('arguments', obj.get('parameters', {}))
    if isinstance(args, str):
        stripped = args.strip()
        if stripped.startswith(('{', '[')):
            try:
                args = json.loads(stripped)
            except json.JSONDecodeError as exc:
                return ToolCall(name, None, raw, f'invalid JSON in "arguments": {exc.msg}', complete)
            except RecursionError:
                return ToolCall(name, None, raw, 'invalid JSON in "arguments": nested too deeply', complete)
    return ToolCall(name, args, raw, None, complete)


def calls_from_values(values: List[Any], raw: str, complete: bool = True) -> List[ToolCall]:
    """One call per decoded value; a list value holds several calls."""
    calls = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            calls.append(call_from_obj(item, raw, complete))
    return calls


def looks_like_call_object(value: Any) -> bool:
    """A decoded JSON value that is (or lists) ``{"name": ..., "arguments"|"parameters": ...}``."""
    items = value if isinstance(value, list) else [value]
    return bool(items) and all(
        isinstance(i, dict) and (isinstance(i.get('function'), dict) or
                                 (isinstance(i.get('name'), str) and ('arguments' in i or 'parameters' in i)))
        for i in items)
