"""The tools of a YAML scheduler: built from the ``tools`` section, the calls read from a
completion (made safe to act on) or given structured by the server (OpenAI's ``tool_calls``), and
one turn's calls run, every failure a result the model sees."""
from __future__ import annotations

import json
from dataclasses import replace as dc_replace
from typing import Any, Dict, List, Optional, Tuple

from mtflow.core.registry import resolve_reference
from mtflow.declarative.parsers import ToolCall, foreign_format, parse_calls
from mtflow.declarative.schema import ToolConfig
from mtflow.tools.registry import make_builtin
from mtflow.tools.runner import ToolResult, ToolRunner
from mtflow.tools.tool import Tool, tool_from_callable

__all__ = ['build_tool', 'read_calls', 'server_calls', 'run_calls', 'parse_error']


def build_tool(tool_config: ToolConfig, base_dir: Optional[str] = None) -> Tool:
    """The :class:`Tool` one ``tools`` entry describes (its ``impl``, or a built-in)."""
    c = tool_config
    fn = resolve_reference(c.impl, base_dir) if c.impl else make_builtin(c.builtin, c.options)
    return tool_from_callable(fn, c.name, description=c.description, parameters=c.parameters, timeout_s=c.timeout_s,
                              max_concurrency=c.max_concurrency, max_observation=c.max_observation,
                              truncate_side=c.truncate_side)


def read_calls(parser: Any, tool_names: List[str], completion: str, finish_reason: Optional[str],
               tools: Optional[List[Dict[str, Any]]] = None) -> List[ToolCall]:
    """The turn's tool calls (see :meth:`YamlScheduler.read_calls`); ``tools``: the OpenAI specs
    that type the text values of the XML formats."""
    calls = parse_calls(parser, completion, tools)
    if finish_reason == 'length':
        calls = [c if c.error is not None or getattr(c, 'complete', True) else dc_replace(
            c, error='the reply was cut off by the token limit (finish_reason length) before this call was '
            'complete; it was not run') for c in calls]
    if not calls and tool_names:
        fmt = foreign_format(completion, getattr(parser, 'name', ''), tool_names)
        if fmt is not None:
            calls = [ToolCall('', None, completion[-200:], f'this looks like a {fmt} tool call, but this '
                              f'scheduler reads the {getattr(parser, "name", "configured")} format')]
    return calls


def server_calls(tool_calls: List[Any]) -> Tuple[List[ToolCall], List[Dict[str, Any]]]:
    """The calls a server returned structured (a reply's ``message.tool_calls``: vLLM with
    ``--enable-auto-tool-choice``, SGLang, hosted APIs) as the scheduler's calls, and as the
    OpenAI ``tool_calls`` of the assistant message (``arguments`` a JSON string, each call its
    ``id``, ``call_<k>`` where the server gave none), which the next turn sends back to the server.
    Arguments that are not a JSON object make that call malformed (an error observation, never
    run), as a malformed call in text is."""
    calls: List[ToolCall] = []
    message_calls: List[Dict[str, Any]] = []
    for k, item in enumerate(tool_calls):
        item = item if isinstance(item, dict) else item.model_dump()
        function = item.get('function') or {}
        name, raw_args = str(function.get('name') or ''), function.get('arguments')
        error = None if name else 'the server returned a tool call without a function name'
        args: Any = raw_args
        if isinstance(raw_args, str):
            try:
                args = json.loads(raw_args) if raw_args.strip() else {}
            except json.JSONDecodeError as exc:
                error = error or f'the arguments are not valid JSON ({exc.msg} at column {exc.colno}): {raw_args[:200]}'
        elif raw_args is None:
            args = {}
        if error is None and not isinstance(args, dict):
            error = f'the arguments must be a JSON object, not {type(args).__name__}: {str(raw_args)[:200]}'
        text_args = raw_args if isinstance(raw_args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(name, args if error is None else None, text_args, error))
        message_calls.append({'id': str(item.get('id') or f'call_{k}'), 'type': 'function',
                              'function': {'name': name, 'arguments': text_args}})
    return calls, message_calls


def parse_error(parser: Any, error: str) -> str:
    """A parse error as the model reads it: what went wrong, and the format expected."""
    name = getattr(parser, 'name', None)
    expected = getattr(parser, 'expected', None)
    hint = f' ({name} format; write calls like: {expected})' if name and expected else ''
    return f'could not parse the tool call: {error}{hint}'


async def run_calls(runner: ToolRunner, parser: Any, calls: List[ToolCall], max_calls: int) -> List[ToolResult]:
    """Run the well-formed calls among the first ``max_calls`` concurrently; one result per call,
    in call order (a malformed call and one over the limit get an error result, unrun)."""
    runnable = [(i, c) for i, c in enumerate(calls[:max_calls]) if c.error is None]
    ran = await runner.call_all([(c.name, c.arguments) for _, c in runnable])
    by_index = {i: r for (i, _), r in zip(runnable, ran)}
    results: List[ToolResult] = []
    for i, call in enumerate(calls):
        if i in by_index:
            results.append(by_index[i])
        elif call.error is not None:
            results.append(ToolResult(call.name, call.arguments, False, error=parse_error(parser, call.error),
                                      error_kind='parse'))
        else:
            results.append(ToolResult(call.name, call.arguments, False, error_kind='too_many_calls',
                                      error=f'more than {max_calls} tool calls in one turn; this one was not run'))
    return results
