"""DeepSeek-V3 / R1 / V3.1 tool calls between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``.

V3 and R1 write ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then the arguments in a
fenced ``json`` block; V3.1 writes ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}``. Both end with
``<｜tool▁call▁end｜>``. (The bars are U+FF5C, the spaces U+2581; ASCII ``|`` is accepted too.)"""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Sequence

from mtflow.declarative.parsers.base import ToolCall, ToolCallParser, json_values, strip_thinking


def _token(word: str) -> str:
    return r'<[｜|]' + word.replace('_', '[▁_ ]') + r'[｜|]>'


CALLS_BEGIN, CALLS_END = _token('tool_calls_begin'), _token('tool_calls_end')
CALL_BEGIN, CALL_END, SEP = re.compile(_token('tool_call_begin')), re.compile(_token('tool_call_end')), re.compile(
    _token('tool_sep'))
_FENCED = re.compile(r'^\s*```(?:json)?\s*\n?(.*?)(?:```|$)', re.DOTALL)


class DeepSeekParser(ToolCallParser):
    """DeepSeek-V3, R1 (and its distills' native format) and V3.1 tool calls; reasoning
    (``<think>``, or text before ``</think>``) is ignored."""
    name = 'deepseek'
    empty_blocks = (re.compile(CALLS_BEGIN + r'\s*(?:' + CALLS_END + '|$)'), )
    expected = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜><tool>\n```json\n{...}\n```'
                '<｜tool▁call▁end｜><｜tool▁calls▁end｜>')

    def parse(self, text: str) -> List[ToolCall]:
        text = strip_thinking(text or '')
        calls: List[ToolCall] = []
        for m in CALL_BEGIN.finditer(text):
            end = CALL_END.search(text, m.end())
            nxt = CALL_BEGIN.search(text, m.end())
            closed = end is not None and (nxt is None or end.start() < nxt.start())
            stop = end.start() if closed else (nxt.start() if nxt else len(text))
            body, raw = text[m.end():stop], text[m.start():end.end() if closed else stop]
            calls.append(self._call(body, raw, closed))
        return calls

    def _call(self, body: str, raw: str, closed: bool) -> ToolCall:
        sep = SEP.search(body)
        if sep is None:
            return ToolCall('', None, raw, 'no <｜tool▁sep｜> between the call type/name and its arguments', closed)
        left, right = body[:sep.start()].strip(), body[sep.end():]
        if left == 'function' or not left:  # V3 / R1: type, then name on the first line, then fenced JSON
            name, _, right = right.lstrip().partition('\n')
            name = name.strip()
        else:  # V3.1: name, then the JSON
            name = left
        fenced = _FENCED.match(right)
        payload = fenced.group(1) if fenced and '```' in right else right
        values, _, error = json_values(payload.strip())
        if not name:
            return ToolCall('', None, raw, 'the tool call names no function', closed)
        if error is not None:
            return ToolCall(name, None, raw, error, complete=False)
        if not values:
            if not payload.strip():
                return ToolCall(name, {}, raw, None, closed)
            return ToolCall(name, None, raw, 'the arguments are not a JSON object', closed)
        args: Any = values[0]
        if not isinstance(args, dict):
            return ToolCall(name, None, raw, 'the arguments must be a JSON object', closed)
        return ToolCall(name, args, raw, None, closed)

    def render_tools(self, tools: Sequence[Dict[str, Any]]) -> str:
        specs = '\n'.join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ('## Tools\nYou have access to the following tools:\n' + specs + '\n\nTo call a tool, write:\n'
                + self.expected)
