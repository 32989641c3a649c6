"""Plain JSON: the reply is (or contains, in fenced ``json`` blocks) call objects or lists of them."""
from __future__ import annotations

import re
from typing import List

from mtflow.declarative.parsers.base import ToolCall, ToolCallParser, calls_from_values, json_values, looks_like_call_object, strip_thinking


class JSONParser(ToolCallParser):
    """A completion that is (or contains, in fenced ```json blocks) JSON objects
    ``{"name", "arguments"}`` (``parameters`` accepted) or lists of them, several in a row
    included. JSON that is not a call (an answer written as JSON) is no call."""
    name = 'json'
    expected = '{"name": "<tool>", "arguments": {...}}'
    _FENCE = re.compile(r'```(?:json)?\s*\n(.*?)```', re.DOTALL)

    def parse(self, text: str) -> List[ToolCall]:
        text = strip_thinking(text or '')
        blocks = [m.group(1) for m in self._FENCE.finditer(text)] or [text]
        calls: List[ToolCall] = []
        for block in blocks:
            stripped = block.strip()
            start = min((i for i in (stripped.find('{'), stripped.find('[')) if i >= 0), default=-1)
            if start < 0:
                continue
            values, _, error = json_values(stripped, start)
            for value in values:
                if looks_like_call_object(value) or (isinstance(value, dict) and 'name' in value):
                    calls += calls_from_values([value], stripped)
            if error is not None and '"name"' in stripped:
                calls.append(ToolCall('', None, stripped, error, complete='ends inside' not in error))
        return calls
