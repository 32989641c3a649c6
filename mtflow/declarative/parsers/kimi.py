"""Kimi-K2 (Instruct, Thinking; K2.5): calls in a section of special tokens, JSON arguments.

::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Beijing"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>
    {}<|tool_call_end|><|tool_calls_section_end|>

The call id is ``functions.NAME:INDEX`` (the index counts the calls of the conversation); the name
is what is between ``functions.`` and the last ``:``.
"""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Sequence, Tuple

from mtflow.declarative.parsers.base import ToolCall, ToolCallParser, json_values, strip_thinking
from mtflow.declarative.parsers.tags import spans

SECTION_BEGIN, SECTION_END = '<|tool_calls_section_begin|>', '<|tool_calls_section_end|>'
CALL_BEGIN, ARGS, CALL_END = '<|tool_call_begin|>', '<|tool_call_argument_begin|>', '<|tool_call_end|>'


def call_name(call_id: str) -> str:
    """``functions.get_weather:0`` -> ``get_weather`` (a bare ``get_weather:0`` or name too)."""
    name = call_id.strip()
    if name.startswith('functions.'):
        name = name[len('functions.'):]
    head, sep, tail = name.rpartition(':')
    return head if sep and tail.strip().isdigit() else name


def thinking_closed_at_section(text: str) -> str:
    """``text`` with a ``<think>`` block that a tool-call section ends (Kimi-K2-Thinking writes no
    ``</think>`` before its calls) closed there, so that stripping the thinking keeps the calls
    (as :class:`~mtflow.declarative.reasoning.KimiThinking` splits it)."""
    opening = text.find('<think>')
    section = text.find(SECTION_BEGIN, opening + 1) if opening >= 0 else -1
    closing = text.find('</think>', opening + 1) if opening >= 0 else -1
    if section < 0 or 0 <= closing < section:
        return text
    return text[:section] + '</think>' + text[section:]


class KimiK2Parser(ToolCallParser):
    """Kimi-K2 calls (``<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{json}
    <|tool_call_end|>``), any number, in one or more ``<|tool_calls_section_begin|>`` sections."""
    name = 'kimi_k2'
    expected = (f'{SECTION_BEGIN}{CALL_BEGIN}functions.<tool>:0{ARGS}{{"name": "value"}}{CALL_END}{SECTION_END}')
    special_markers = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS, CALL_END)
    empty_blocks = (re.compile(re.escape(SECTION_BEGIN) + r'\s*(?:' + re.escape(SECTION_END) + '|$)'), )

    def parse(self, text: str) -> List[ToolCall]:
        text = strip_thinking(thinking_closed_at_section(text or ''))
        calls: List[ToolCall] = []
        for span in spans(text, CALL_BEGIN, CALL_END):
            body, raw, closed = span.body, span.raw, span.closed
            head, sep, payload = body.partition(ARGS)
            name = call_name(head)
            call_id = head.strip() or None  # functions.NAME:N: the tool message answers it
            if not sep:
                error = f'no {ARGS} after the call id' if closed else 'the reply ended before the arguments'
                calls.append(ToolCall(name, None, raw, error, closed, id=call_id))
                continue
            if not name:
                calls.append(ToolCall('', None, raw, 'the call id names no function (functions.NAME:N)', closed))
                continue
            values, _, error = json_values(payload.strip())
            if error is not None:
                call = ToolCall(name, None, raw, error, complete=closed and 'ends inside' not in error)
            elif not values:
                call = ToolCall(name, {}, raw, None, closed) if not payload.strip() else \
                    ToolCall(name, None, raw, 'the arguments are not a JSON object', closed)
            elif not isinstance(values[0], dict):
                call = ToolCall(name, None, raw, 'the arguments must be a JSON object', closed)
            else:
                call = ToolCall(name, values[0], raw, None, closed)
            call.id = call_id
            calls.append(call)
        return calls

    def render_tools(self, tools: Sequence[Dict[str, Any]]) -> str:
        return ('# Tools\n' + json.dumps(list(tools), ensure_ascii=False) + '\n\nTo call tools, write:\n'
                + self.expected)

    def render_calls(self, calls: Sequence[Tuple[str, Any]]) -> str:
        body = ''.join(f'{CALL_BEGIN}functions.{name}:{k}{ARGS}{json.dumps(args, ensure_ascii=False)}{CALL_END}'
                       for k, (name, args) in enumerate(calls))
        return f'{SECTION_BEGIN}{body}{SECTION_END}' if calls else ''
