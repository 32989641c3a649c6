"""ReAct: ``Action: <tool>`` then ``Action Input: <json or text>``, in the spellings models use.

Labels are matched case-insensitively and may be wrapped in Markdown (``**Action:**``,
``**Action**:``, ``### Action:``) or numbered (``Action 1:``). Also read: the original paper's
``Action: Search[query]`` and LangChain's JSON blob (``Action:`` then ```json {"action": ...,
"action_input": ...}```)."""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mtflow.declarative.parsers.base import ToolCall, ToolCallParser, json_values, loads_lenient, strip_thinking

_LABELS = ('action input', 'action_input', 'action', 'observation', 'thought', 'final answer', 'final_answer')
_LABEL = re.compile(
    r'^[ \t]*(?:[#>*_]+[ \t]*)?(?P<label>action[ _]input|action|observation|thought|final[ _]answer)'
    r'(?:[ \t]*\d+)?[ \t]*(?:\*\*|__|\*)?[ \t]*:[ \t]*(?:\*\*|__|\*)?[ \t]?(?P<rest>.*)$', re.IGNORECASE)
_BRACKET = re.compile(r'^([A-Za-z_][\w.\-]*)\[(.*)\]$', re.DOTALL)


def _labelled_lines(text: str) -> List[Tuple[Optional[str], str]]:
    out = []
    for line in text.split('\n'):
        m = _LABEL.match(line)
        out.append((m.group('label').lower().replace('_', ' '), m.group('rest')) if m else (None, line))
    return out


def _clean_name(name: str) -> str:
    return name.strip().strip('*_').strip().strip('`"\'').strip()


class ReActParser(ToolCallParser):
    """``Action:`` / ``Action Input:`` pairs, up to the next label (``Observation:``, ``Thought:``,
    ``Action:``, ``Final Answer:``) or the end. An input that runs to the end of the reply is
    ``complete=False`` unless it is a whole JSON value."""
    name = 'react'
    expected = 'Action: <tool>\nAction Input: {"arg": "value"}'

    def parse(self, text: str) -> List[ToolCall]:
        lines = _labelled_lines(strip_thinking(text or ''))
        calls: List[ToolCall] = []
        i = 0
        while i < len(lines):
            label, rest = lines[i]
            if label != 'action':
                i += 1
                continue
            start = i
            name_text, i = self._block(lines, i, rest)
            has_input = i < len(lines) and lines[i][0] == 'action input'
            if has_input:
                input_text, i = self._block(lines, i, lines[i][1])
                terminated = i < len(lines)
                raw = '\n'.join(r if l is None else f'{l}: {r}' for l, r in lines[start:i])
                calls.append(self._call(_clean_name(name_text), input_text.strip(), raw, terminated))
                continue
            raw = '\n'.join(r if l is None else f'{l}: {r}' for l, r in lines[start:i])
            calls.append(self._without_input(name_text.strip(), raw, terminated=i < len(lines)))
        return calls

    @staticmethod
    def _block(lines: List[Tuple[Optional[str], str]], i: int, first: str) -> Tuple[str, int]:
        """The text of a label: its own line's rest plus unlabelled lines after it."""
        parts = [first]
        i += 1
        while i < len(lines) and lines[i][0] is None:
            parts.append(lines[i][1])
            i += 1
        while len(parts) > 1 and not parts[-1].strip():
            parts.pop()
        return '\n'.join(parts), i

    def _call(self, name: str, raw_input: str, raw: str, terminated: bool) -> ToolCall:
        if raw_input.startswith('```'):
            raw_input = re.sub(r'^```\w*\n?|```\s*$', '', raw_input).strip()
        if not name:
            return ToolCall('', None, raw, 'the "Action:" line names no tool', terminated)
        if raw_input.startswith(('{', '[')):
            try:
                args: Any = loads_lenient(raw_input)
            except ValueError as exc:
                return ToolCall(name, None, raw, str(exc), complete=False if 'ends inside' in str(exc) else terminated)
            return ToolCall(name, args, raw)
        return ToolCall(name, raw_input, raw, None, terminated)

    def _without_input(self, name_text: str, raw: str, terminated: bool) -> ToolCall:
        body = name_text.strip()
        if body.startswith('```') or body.startswith('{'):  # LangChain JSON blob
            payload = re.sub(r'^```\w*\n?|```\s*$', '', body).strip()
            values, _, error = json_values(payload)
            if error is not None:
                return ToolCall('', None, raw, error, complete=False)
            if values and isinstance(values[0], dict) and 'action' in values[0]:
                blob = values[0]
                return ToolCall(str(blob['action']), blob.get('action_input', {}), raw)
            return ToolCall('', None, raw, 'the JSON after "Action:" has no "action" key')
        first = body.split('\n', 1)[0].strip()
        m = _BRACKET.match(_clean_name(first))
        if m is not None:
            return ToolCall(m.group(1), m.group(2), raw)
        if not first:
            return ToolCall('', None, raw, 'the "Action:" line names no tool', terminated)
        return ToolCall(_clean_name(first), None, raw, 'found "Action:" without a following "Action Input:"', terminated)

    def render_tools(self, tools: Sequence[Dict[str, Any]]) -> str:
        lines = []
        for t in tools:
            f = t.get('function', t)
            lines.append(f"{f['name']}: {f.get('description', '')} Parameters: "
                         f"{json.dumps(f.get('parameters', {}), ensure_ascii=False)}")
        names = ', '.join(t.get('function', t)['name'] for t in tools)
        return ('\n'.join(lines) + '\n\nUse the following format:\nThought: what to do next\n'
                f'Action: the tool to use, one of [{names}]\nAction Input: the input to the tool, as JSON\n'
                'Observation: the result of the tool\n... (repeat Thought/Action/Action Input/Observation as needed)\n'
                'Thought: I now know the final answer\nFinal Answer: the answer')
