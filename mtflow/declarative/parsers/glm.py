"""GLM-4.5, 4.6 and 4.7: the function name, then key/value pairs, inside ``<tool_call>``.

::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Beijing</arg_value>
    </tool_call>

(GLM-4.7 writes it without the newlines: ``<tool_call>get_weather<arg_key>city</arg_key>...``; a
call without arguments is ``<tool_call>get_time</tool_call>``.) Values are text, typed by the
tool's schema; a value the schema does not describe is read as JSON when it parses, as GLM's own
tooling does (:mod:`.schema_types`).
"""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Sequence, Tuple

from mtflow.declarative.parsers.base import ToolCall, ToolCallParser, strip_thinking
from mtflow.declarative.parsers.tags import Span, spans

OPEN, CLOSE = '<tool_call>', '</tool_call>'
_KEY, _VALUE = re.compile(r'<arg_key>(.*?)</arg_key>', re.DOTALL), re.compile(r'\s*<arg_value>')


def _call(span: Span) -> ToolCall:
    body, raw, closed = span.body, span.raw, span.closed
    first = body.find('<arg_key>')
    name = (body if first < 0 else body[:first]).strip()
    if not name:
        return ToolCall('', None, raw, 'the tool call names no function (write the name right after <tool_call>)',
                        closed)
    if name.startswith(('{', '<')) or '\n' in name:
        return ToolCall('', None, raw, f'{name[:40]!r} is not a function name', closed)
    args: Dict[str, Any] = {}
    pos = max(first, 0)
    for m in _KEY.finditer(body, pos):
        key = m.group(1).strip()
        v = _VALUE.match(body, m.end())
        if v is None:
            return ToolCall(name, None, raw, f'<arg_key>{key}</arg_key> is not followed by an <arg_value>', closed)
        end = body.find('</arg_value>', v.end())
        if end < 0:
            return ToolCall(name, None, raw, f'the value of {key!r} is not closed with </arg_value>', False)
        args[key] = body[v.end():end].strip()
        pos = end
    if '<arg_key>' in body[pos:] and not closed:
        return ToolCall(name, None, raw, 'the reply ended inside an <arg_key>', False)
    return ToolCall(name, args, raw, None, closed, text_values='json')


class GLMParser(ToolCallParser):
    """``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`` (GLM-4.5, 4.6,
    4.7; newlines between the parts optional), any number per reply, between text."""
    name = 'glm45'
    expected = '<tool_call><tool>\n<arg_key>name</arg_key>\n<arg_value>value</arg_value>\n</tool_call>'

    def parse(self, text: str) -> List[ToolCall]:
        text = strip_thinking(text or '')
        return [_call(s) for s in spans(text, OPEN, CLOSE)]

    def render_tools(self, tools: Sequence[Dict[str, Any]]) -> str:
        specs = '\n'.join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ('# Tools\n\nYou may call one or more functions. Their signatures, within <tools></tools>:\n<tools>\n'
                + specs + '\n</tools>\n\nFor each call, write the function name and its arguments as:\n'
                + self.expected + '\n(values that are not strings as JSON)')

    def render_calls(self, calls: Sequence[Tuple[str, Any]]) -> str:
        out = []
        for name, args in calls:
            pairs = ''.join(f'<arg_key>{k}</arg_key>\n<arg_value>'
                            f'{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</arg_value>\n'
                            for k, v in (args or {}).items())
            out.append(f'{OPEN}{name}\n{pairs}{CLOSE}')
        return '\n'.join(out)
