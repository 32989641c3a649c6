"""Llama 3.1 / 3.2 / 4: JSON calls (``{"name": ..., "parameters": {...}}``, optionally after
``<|python_tag|>``, several separated by ``;``), the built-in call form
``<|python_tag|>brave_search.call(query="...")``, and the pythonic list
``[get_weather(city="Paris"), get_time()]`` of Llama 3.2 and Llama 4."""
from __future__ import annotations

import ast
import json
import re
from typing import Any, Dict, List, Sequence

from mtflow.declarative.parsers.base import ToolCall, ToolCallParser, calls_from_values, json_values, looks_like_call_object, strip_thinking

PYTHON_TAG = '<|python_tag|>'
_END_TOKENS = re.compile(r'<\|(?:eom_id|eot_id|end_of_text|python_end|eom|eot)\|>')
_FENCE = re.compile(r'```(?:json)?\s*\n(.*?)```', re.DOTALL)


def _literal(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise ValueError(f'argument {ast.unparse(node)[:60]!r} is not a literal') from None


def _pythonic_calls(source: str, raw: str) -> List[ToolCall]:
    """``[f(a=1), g()]`` or ``f(a=1)`` -> calls; ``ValueError`` when it is not that shape."""
    try:
        tree = ast.parse(source.strip(), mode='eval').body
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise ValueError(f'not a Python call list: {getattr(exc, "msg", exc)}') from None
    items = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    calls = []
    for item in items:
        if not isinstance(item, ast.Call):
            raise ValueError('a pythonic tool call list holds calls only, like [f(a=1)]')
        name = ast.unparse(item.func)
        if name.endswith('.call'):  # Llama 3.1 built-in tools: brave_search.call(query=...)
            name = name[:-len('.call')]
        if item.args:
            calls.append(ToolCall(name, None, raw, 'pass arguments by keyword: f(a=1), not f(1)'))
            continue
        try:
            args = {kw.arg: _literal(kw.value) for kw in item.keywords if kw.arg}
        except ValueError as exc:
            calls.append(ToolCall(name, None, raw, str(exc)))
            continue
        calls.append(ToolCall(name, args, raw))
    return calls


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1/3.2 JSON tool calls: the reply is (or, after ``<|python_tag|>`` or in a fenced
    ``json`` block, contains) ``{"name": "f", "parameters": {...}}`` objects separated by ``;``;
    ``arguments`` is accepted for ``parameters``. ``<|python_tag|>tool.call(a=...)`` (built-in
    tools) is parsed as a call too. Prose without such JSON has no call."""
    name = 'llama3_json'
    expected = '{"name": "<tool>", "parameters": {...}}'

    def parse(self, text: str) -> List[ToolCall]:
        text = _END_TOKENS.sub('', strip_thinking(text or ''))
        tag = text.find(PYTHON_TAG)
        if tag >= 0:
            body = text[tag + len(PYTHON_TAG):].strip()
            if not body.startswith(('{', '[')):
                try:
                    return _pythonic_calls(body, text[tag:])
                except ValueError as exc:
                    return [ToolCall('', None, text[tag:], f'after {PYTHON_TAG}: {exc}')]
            return self._json(body, text[tag:], required=True)
        stripped = text.strip()
        if stripped.startswith('{'):
            return self._json(stripped, stripped, required=False)
        for m in _FENCE.finditer(text):
            found = self._json(m.group(1).strip(), m.group(0), required=False)
            if found:
                return found
        return []

    def _json(self, body: str, raw: str, required: bool) -> List[ToolCall]:
        values, end, error = json_values(body)
        if error is not None and (required or '"name"' in body):
            return calls_from_values(values, raw) + [ToolCall('', None, raw, error, complete=False)]
        values = [v for v in values if required or looks_like_call_object(v)]
        return calls_from_values(values, raw)

    def render_tools(self, tools: Sequence[Dict[str, Any]]) -> str:
        specs = '\n\n'.join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        return ('Given the following functions, please respond with a JSON for a function call with its proper '
                'arguments that best answers the given prompt.\n\nRespond in the format {"name": function name, '
                '"parameters": dictionary of argument name and its value}. Do not use variables.\n\n' + specs)


class PythonicParser(ToolCallParser):
    """Pythonic calls (Llama 3.2 and Llama 4): ``[get_weather(city="Paris"), get_time()]``, the
    whole reply or between ``<|python_start|>`` and ``<|python_end|>``; arguments are keyword
    literals (read with ``ast.literal_eval``, never evaluated)."""
    name = 'pythonic'
    expected = '[tool_name(arg1="value", arg2=2)]'
    _START = re.compile(r'\[\s*[A-Za-z_][\w.]*\(')

    def parse(self, text: str) -> List[ToolCall]:
        text = strip_thinking(text or '').replace('<|python_start|>', '')
        text = _END_TOKENS.sub('', text).strip()
        m = self._START.search(text)
        if m is None:
            return []
        candidate = text[m.start():]
        end = candidate.rfind(']')
        if end < 0:
            return [ToolCall('', None, candidate, 'the call list has no closing "]"', complete=False)]
        try:
            return _pythonic_calls(candidate[:end + 1], candidate[:end + 1])
        except ValueError as exc:
            return [ToolCall('', None, candidate, str(exc))]

    def render_tools(self, tools: Sequence[Dict[str, Any]]) -> str:
        specs = '\n'.join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ('You may call one or more of these functions. To call, reply only with a Python list of calls, '
                'e.g. [func_name1(param1=value1), func_name2(param2=value2)].\n' + specs)
