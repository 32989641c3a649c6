"""Tool-call parsers: completion text -> a list of :class:`ToolCall`, and the tool list rendered
for the system prompt in the format the parser expects.

Built in: ``hermes`` (Qwen/Hermes ``<tool_call>{json}</tool_call>``, several per turn), ``react``
(``Action:`` / ``Action Input:``), ``json`` (a bare JSON object or list, or a fenced ```json
block). More with :func:`register_parser`. A call that cannot be parsed is still returned, with
``error`` set, so that the scheduler can feed the problem back to the model and count it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence


@dataclass
class ToolCall:
    """One parsed call. ``error`` is set (and ``name`` may be empty) when the text was malformed."""
    name: str
    arguments: Any
    raw: str
    error: Optional[str] = None


class ToolCallParser:
    """Base class: override :meth:`parse` and, if the model needs another format, :meth:`render_tools`."""
    name = 'base'

    def __init__(self, **options: Any) -> None:
        if options:
            raise ValueError(f'parser {self.name!r} takes no options, got {sorted(options)}')

    def parse(self, text: str) -> List[ToolCall]:
        raise NotImplementedError

    def render_tools(self, tools: Sequence[Dict[str, Any]]) -> str:
        """The tools (OpenAI function specs) as text for the system prompt."""
        return '\n'.join(json.dumps(t, ensure_ascii=False) for t in tools)


_THINK = re.compile(r'<think>.*?(</think>|$)', re.DOTALL)


def strip_thinking(text: str) -> str:
    """``text`` without ``<think>...</think>`` blocks (calls mentioned while thinking are not calls)."""
    return _THINK.sub('', text) if '<think>' in text else text


def _loads_lenient(payload: str) -> Any:
    """JSON from a model: exact first; then the first complete JSON value (trailing text ignored);
    ``ValueError`` with json's message otherwise."""
    payload = payload.strip()
    try:
        return json.loads(payload)
    except json.JSONDecodeError as exc:
        first_error = exc
    start = min((i for i in (payload.find('{'), payload.find('[')) if i >= 0), default=-1)
    if start >= 0:
        try:
            value, _ = json.JSONDecoder().raw_decode(payload[start:])
            return value
        except json.JSONDecodeError:
            pass
    raise ValueError(f'invalid JSON: {first_error.msg} at line {first_error.lineno} column {first_error.colno}')


def _call_from_obj(obj: Any, raw: str) -> ToolCall:
    """A call from a decoded ``{"name": ..., "arguments": ...}`` (OpenAI ``function`` wrapper and
    string-encoded arguments accepted)."""
    if isinstance(obj, dict) and isinstance(obj.get('function'), dict):
        obj = obj['function']
    if not isinstance(obj, dict):
        return ToolCall('', None, raw, f'a tool call must be a JSON object, got {type(obj).__name__}')
    name = obj.get('name')
    if not isinstance(name, str) or not name:
        return ToolCall('', None, raw, 'the tool call has no "name"')
    args = obj.get('arguments', obj.get('parameters', {}))
    if isinstance(args, str):
        stripped = args.strip()
        if stripped.startswith(('{', '[')):
            try:
                args = json.loads(stripped)
            except json.JSONDecodeError as exc:
                return ToolCall(name, None, raw, f'invalid JSON in "arguments": {exc.msg}')
    return ToolCall(name, args, raw)


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, any number per completion.

    An opening tag without a closing one (the completion was cut) is a malformed call; text inside
    ``<think>`` blocks is ignored."""
    name = 'hermes'
    _CALL = re.compile(r'<tool_call>(.*?)(</tool_call>|(?=<tool_call>)|$)', re.DOTALL)

    def parse(self, text: str) -> List[ToolCall]:
        text = strip_thinking(text or '')
        calls = []
        for m in self._CALL.finditer(text):
            body, closed = m.group(1), m.group(2) == '</tool_call>'
            try:
                obj = _loads_lenient(body)
            except ValueError as exc:
                hint = '' if closed else ' (no closing </tool_call>)'
                calls.append(ToolCall('', None, m.group(0), f'{exc}{hint}'))
                continue
            calls.append(_call_from_obj(obj, m.group(0)))
        return calls

    def render_tools(self, tools: Sequence[Dict[str, Any]]) -> str:
        lines = '\n'.join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (f'<tools>\n{lines}\n</tools>\n\nFor each function call, return a json object with function name and '
                'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n'
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


class ReActParser(ToolCallParser):
    """ReAct: ``Action: <tool>`` then ``Action Input: <json or text>``, up to ``Observation:`` (or
    the next ``Action:``, ``Thought:``, ``Final Answer:``) or the end."""
    name = 'react'
    _ACTION = re.compile(
        r'Action:[ \t]*(?P<name>[^\n]*?)[ \t]*\n+[ \t]*Action Input:[ \t]*(?P<input>.*?)'
        r'(?=\n[ \t]*(?:Observation:|Action:|Thought:|Final Answer:)|$)', re.DOTALL)

    def parse(self, text: str) -> List[ToolCall]:
        text = strip_thinking(text or '')
        calls = []
        for m in self._ACTION.finditer(text):
            name = m.group('name').strip().strip('`"\'')
            raw_input = m.group('input').strip()
            if raw_input.startswith('```'):
                raw_input = re.sub(r'^```\w*\n?|```$', '', raw_input).strip()
            if not name:
                calls.append(ToolCall('', None, m.group(0), 'the "Action:" line names no tool'))
                continue
            if raw_input.startswith(('{', '[')):
                try:
                    args: Any = _loads_lenient(raw_input)
                except ValueError as exc:
                    calls.append(ToolCall(name, None, m.group(0), str(exc)))
                    continue
            else:
                args = raw_input
            calls.append(ToolCall(name, args, m.group(0)))
        if not calls and re.search(r'(^|\n)\s*Action:', text) and 'Final Answer:' not in text:
            calls.append(ToolCall('', None, text[-200:], 'found "Action:" without a following "Action Input:"'))
        return calls

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


class JSONParser(ToolCallParser):
    """A completion that is (or contains, in a fenced ```json block) a JSON object
    ``{"name", "arguments"}`` or a list of them. Text without JSON has no call."""
    name = 'json'
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
            try:
                obj = _loads_lenient(stripped[start:])
            except ValueError as exc:
                if '"name"' in stripped:
                    calls.append(ToolCall('', None, stripped, str(exc)))
                continue
            for item in obj if isinstance(obj, list) else [obj]:
                if isinstance(item, dict) and ('name' in item or 'function' in item):
                    calls.append(_call_from_obj(item, stripped))
        return calls


_PARSERS: Dict[str, Callable[..., ToolCallParser]] = {
    'hermes': HermesParser,
    'qwen': HermesParser,
    'react': ReActParser,
    'json': JSONParser,
}


def register_parser(name: str, factory: Callable[..., ToolCallParser]) -> None:
    """Make a parser available by name in YAML (``parser: <name>``)."""
    _PARSERS[name] = factory


def parser_names() -> List[str]:
    return sorted(_PARSERS)


def get_parser(name: str, options: Optional[Dict[str, Any]] = None, base_dir: Optional[str] = None) -> ToolCallParser:
    """A parser instance: a registered name, or ``module:Class`` (a :class:`ToolCallParser` subclass)."""
    options = dict(options or {})
    if name in _PARSERS:
        return _PARSERS[name](**options)
    if ':' in name:
        from ..tools.registry import resolve_ref
        factory = resolve_ref(name, base_dir)
        parser = factory(**options)
        if not callable(getattr(parser, 'parse', None)):
            raise TypeError(f'{name} does not produce a parser (no parse(text) method)')
        return parser
    raise KeyError(f'unknown parser {name!r} (known: {", ".join(parser_names())}, or module:Class)')
