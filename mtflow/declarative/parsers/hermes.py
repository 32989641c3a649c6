"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Sequence, Tuple

from mtflow.declarative.parsers.base import ToolCall, ToolCallParser, calls_from_values, json_values, loads_lenient, strip_thinking

OPEN, CLOSE = '<tool_call>', '</tool_call>'


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, any number per completion.

    The JSON is decoded first and the closing tag looked for after it, so code arguments that
    contain ``</tool_call>`` stay whole, and several JSON objects in one tag are several calls.
    Reasoning (``<think>`` blocks, or text before a ``</think>`` whose opening tag was in the
    prompt, as Qwen3 writes it) is ignored. A call without its closing tag is ``complete=False``
    (truncated when the reply hit the token limit)."""
    name = 'hermes'
    expected = '<tool_call>\n{"name": "<tool>", "arguments": {...}}\n</tool_call>'

    def parse(self, text: str) -> List[ToolCall]:
        text = strip_thinking(text or '')
        calls: List[ToolCall] = []
        pos = text.find(OPEN)
        while pos >= 0:
            body = pos + len(OPEN)
            values, end, error = json_values(text, body)
            if values and error is None:  # text after the JSON, before the closing tag, is tolerated
                close, nxt = text.find(CLOSE, end), text.find(OPEN, end)
                closed = close >= 0 and (nxt < 0 or close < nxt)
                stop = close + len(CLOSE) if closed else (nxt if nxt >= 0 else len(text))
                calls += calls_from_values(values, text[pos:stop], complete=closed)
                pos = text.find(OPEN, stop)
                continue
            # not a clean JSON body: take the text up to the closing tag (or the next call) as one call
            close, nxt = text.find(CLOSE, body), text.find(OPEN, body)
            ends = [i for i in (close, nxt) if i >= 0]
            stop = min(ends) if ends else len(text)
            closed = stop == close
            raw = text[pos:stop + (len(CLOSE) if closed else 0)]
            try:
                obj: Any = loads_lenient(text[body:stop])
            except ValueError as exc:
                hint = '' if closed else f' (no closing {CLOSE})'
                calls.append(ToolCall('', None, raw, f'{exc}{hint}', complete=closed))
            else:
                calls += calls_from_values([obj], raw, complete=closed)
            pos = text.find(OPEN, stop + (len(CLOSE) if closed else 0))
        return calls

    def render_tools(self, tools: Sequence[Dict[str, Any]]) -> str:
        lines = '\n'.join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (f'<tools>\n{lines}\n</tools>\n\nFor each function call, return a json object with function name and '
                'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n'
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def render_calls(self, calls: Sequence[Tuple[str, Any]]) -> str:
        return '\n'.join(f'{OPEN}\n{json.dumps({"name": name, "arguments": args}, ensure_ascii=False)}\n{CLOSE}'
                         for name, args in calls)
