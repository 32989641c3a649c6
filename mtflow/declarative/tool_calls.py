"""The tools of a YAML scheduler: built from the ``tools`` section, the calls read from a
completion (made safe to act on), and one turn's calls run, every failure a result the model sees."""
from __future__ import annotations

from dataclasses import replace as dc_replace
from typing import Any, Dict, List, Optional

from mtflow.core.registry import resolve_reference
from mtflow.declarative.parsers import ToolCall, foreign_format, parse_calls
from mtflow.declarative.schema import ToolConfig
from mtflow.tools.registry import make_builtin
from mtflow.tools.runner import ToolResult, ToolRunner
from mtflow.tools.tool import Tool, tool_from_callable

__all__ = ['build_tool', 'read_calls', 'run_calls', 'parse_error']


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
