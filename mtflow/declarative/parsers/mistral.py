"""Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (tokenizer v3, v7) and
``[TOOL_CALLS]name[ARGS]{...}`` (v11 and later, optionally with ``[CALL_ID]id``)."""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Sequence

from mtflow.declarative.parsers.base import ToolCall, ToolCallParser, calls_from_values, json_values, looks_like_call_object, strip_thinking

MARK = '[TOOL_CALLS]'
_V11 = re.compile(r'\s*([A-Za-z_][\w.\-]*)\s*(?:\[CALL_ID\]\s*([\w\-]+)\s*)?\[ARGS\]')


class MistralParser(ToolCallParser):
    """Calls after ``[TOOL_CALLS]``: a JSON list (v3/v7) or ``name[ARGS]{json}`` (v11), any number.
    When the backend skips special tokens the marker is gone: a reply that starts with a JSON
    list of ``{"name", "arguments"}`` objects is read as calls too."""
    name = 'mistral'
    expected = '[TOOL_CALLS][{"name": "<tool>", "arguments": {...}}]'

    def parse(self, text: str) -> List[ToolCall]:
        text = strip_thinking(text or '').replace('</s>', '')
        if MARK not in text:
            values, _, _ = json_values(text.strip())
            return calls_from_values(values[:1], text) if values and looks_like_call_object(values[0]) else []
        calls: List[ToolCall] = []
        for chunk in text.split(MARK)[1:]:
            raw = MARK + chunk
            m = _V11.match(chunk)
            if m is not None:
                values, end, error = json_values(chunk, m.end())
                if error is not None or not values:
                    call = ToolCall(m.group(1), None, raw, error or f'no JSON object after {m.group(1)}[ARGS]',
                                    complete=False)
                elif not isinstance(values[0], dict):
                    call = ToolCall(m.group(1), None, raw, '[ARGS] must be a JSON object')
                else:
                    call = ToolCall(m.group(1), values[0], raw)
                call.id = m.group(2)  # [CALL_ID], when the model wrote one
                calls.append(call)
                continue
            values, end, error = json_values(chunk)
            if error is not None:
                calls += calls_from_values(values, raw) + [ToolCall('', None, raw, error, complete=False)]
            elif not values:
                calls.append(ToolCall('', None, raw, f'{MARK} is followed by neither a JSON list nor name[ARGS]{{...}}'))
            else:
                calls += calls_from_values(values, raw)
        return calls

    def render_tools(self, tools: Sequence[Dict[str, Any]]) -> str:
        return '[AVAILABLE_TOOLS]' + json.dumps(list(tools), ensure_ascii=False) + '[/AVAILABLE_TOOLS]'
