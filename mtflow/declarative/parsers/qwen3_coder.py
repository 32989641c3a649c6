"""Qwen3-Coder (and Qwen3.5, Qwen3-Next in their coder templates): XML calls with text values.

::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

One newline after the opening and before the closing parameter tag belongs to the format (the
template writes them), the rest of the value is kept as written: code keeps its indentation and
inner newlines. Values are text, typed by the tool's schema (:mod:`.schema_types`).
"""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Sequence, Tuple

from mtflow.declarative.parsers.base import ToolCall, ToolCallParser, strip_thinking
from mtflow.declarative.parsers.tags import spans

OPEN, CLOSE = '<tool_call>', '</tool_call>'
_FUNCTION = re.compile(r'<function=([^>\n]*)>')
_PARAM = re.compile(r'<parameter=([^>\n]*)>')
_PARAM_END = re.compile(r'</parameter>|(?=<parameter=)|(?=</function>)')


def _value(text: str) -> str:
    """A parameter's text without the one newline the template writes on each side."""
    if text.startswith('\n'):
        text = text[1:]
    if text.endswith('\n'):
        text = text[:-1]
    return text


def _function_call(text: str, start: int, stop: int, raw: str, closed: bool) -> ToolCall:
    """The call of ``text[start:stop]`` (the inside of ``<tool_call>``); malformed calls carry an error."""
    fn = _FUNCTION.search(text, start, stop)
    if fn is None:
        return ToolCall('', None, raw, 'no <function=NAME> in the tool call', closed)
    name = fn.group(1).strip()
    if not name:
        return ToolCall('', None, raw, '<function=> names no function', closed)
    end = text.find('</function>', fn.end(), stop)
    body_stop = end if end >= 0 else stop
    args: Dict[str, Any] = {}
    for m in _PARAM.finditer(text, fn.end(), body_stop):
        key = m.group(1).strip()
        close = _PARAM_END.search(text, m.end(), body_stop)
        cut = not (close is not None and close.group(0) == '</parameter>')
        if cut and not closed:  # the reply ended inside this value
            return ToolCall(name, None, raw, f'the value of parameter {key!r} is not closed with </parameter>', False)
        args[key] = _value(text[m.end():close.start() if close is not None else body_stop])
    return ToolCall(name, args, raw, None, closed, text_values='text')


class Qwen3CoderParser(ToolCallParser):
    """``<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>``, any number
    per reply, between text. A ``<function=...>`` without its ``<tool_call>`` is read too (the model
    sometimes drops it). A call cut by the token limit is ``complete=False``."""
    name = 'qwen3_coder'
    expected = '<tool_call>\n<function=<tool>>\n<parameter=<name>>\nvalue\n</parameter>\n</function>\n</tool_call>'

    def parse(self, text: str) -> List[ToolCall]:
        text = strip_thinking(text or '')
        if OPEN in text:
            return [_function_call(text, s.body_start, s.body_end, s.raw, s.closed) for s in spans(text, OPEN, CLOSE)]
        return [_function_call(text, s.start, s.body_end, s.raw, s.closed)
                for s in spans(text, _FUNCTION, '</function>')]

    def render_tools(self, tools: Sequence[Dict[str, Any]]) -> str:
        blocks = []
        for spec in tools:
            fn = spec.get('function', spec)
            params = (fn.get('parameters') or {}).get('properties') or {}
            lines = [f'<function>\n<name>{fn.get("name", "")}</name>']
            if fn.get('description'):
                lines.append(f'<description>{fn["description"].strip()}</description>')
            lines.append('<parameters>')
            for key, schema in params.items():
                lines.append(f'<parameter>\n<name>{key}</name>\n<type>{schema.get("type", "string")}</type>')
                if schema.get('description'):
                    lines.append(f'<description>{schema["description"].strip()}</description>')
                lines.append('</parameter>')
            lines.append('</parameters>\n</function>')
            blocks.append('\n'.join(lines))
        return ('# Tools\n\nYou have access to the following functions:\n\n<tools>\n' + '\n'.join(blocks) +
                '\n</tools>\n\nTo call a function, reply with:\n' + self.expected +
                '\nValues that are not strings are written as JSON.')

    def render_calls(self, calls: Sequence[Tuple[str, Any]]) -> str:
        out = []
        for name, args in calls:
            params = ''.join(f'<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n'
                             f'</parameter>\n' for k, v in (args or {}).items())
            out.append(f'{OPEN}\n<function={name}>\n{params}</function>\n{CLOSE}')
        return '\n'.join(out)
