"""Tool-call parsers: completion text -> a list of :class:`ToolCall`, and the tool list rendered
for the system prompt in the format the parser expects.

Built in (one module per format family):

=================  ===============================================================================
``hermes``         Hermes, Qwen2.5, Qwen3 (alias ``qwen``, ``qwen3``): ``<tool_call>{json}</tool_call>``
``llama3_json``    Llama 3.1/3.2 JSON ``{"name", "parameters"}`` and ``<|python_tag|>`` (alias ``llama3``)
``pythonic``       Llama 3.2 / Llama 4 ``[f(a=1), g()]``
``mistral``        ``[TOOL_CALLS] [{...}]`` (v3, v7) and ``[TOOL_CALLS]name[ARGS]{...}`` (v11)
``deepseek``       DeepSeek-V3, R1, V3.1 ``<｜tool▁call▁begin｜>...`` (aliases ``deepseek_v3``, ``deepseek_r1``)
``react``          ``Action:`` / ``Action Input:``, Markdown and lowercase variants
``json``           a bare JSON call object or list, or fenced ```json blocks
=================  ===============================================================================

More with :func:`register_parser`, or from installed packages (``mtflow.parsers`` entry points).
A call that cannot be parsed is still returned, with ``error`` set, so that the scheduler can feed
the problem back to the model (quoting the parser's ``expected`` format) and count it.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from mtflow.core.registry import Registry
from mtflow.declarative.parsers.base import ToolCall, ToolCallParser, call_from_obj, loads_lenient, strip_thinking
from mtflow.declarative.parsers.deepseek import DeepSeekParser
from mtflow.declarative.parsers.detect import detect_formats, foreign_format
from mtflow.declarative.parsers.hermes import HermesParser
from mtflow.declarative.parsers.json_calls import JSONParser
from mtflow.declarative.parsers.llama import Llama3JsonParser, PythonicParser
from mtflow.declarative.parsers.mistral import MistralParser
from mtflow.declarative.parsers.react import ReActParser

#: name -> factory(**parser_options) -> parser
PARSERS = Registry('mtflow.parsers', 'unknown parser {name} (known: {known}, or module:Class)', builtins={
    'hermes': HermesParser,
    'qwen': HermesParser,
    'qwen3': HermesParser,
    'llama3_json': Llama3JsonParser,
    'llama3': Llama3JsonParser,
    'pythonic': PythonicParser,
    'mistral': MistralParser,
    'deepseek': DeepSeekParser,
    'deepseek_v3': DeepSeekParser,
    'deepseek_r1': DeepSeekParser,
    'react': ReActParser,
    'json': JSONParser,
})


def register_parser(name: str, factory: Callable[..., ToolCallParser]) -> None:
    """Make a parser available by name in YAML (``parser: <name>``)."""
    PARSERS.register(name, factory)


def parser_names() -> List[str]:
    """Registered parsers, and those installed packages declare (``mtflow.parsers`` entry points)."""
    return PARSERS.names()


def get_parser(name: str, options: Optional[Dict[str, Any]] = None, base_dir: Optional[str] = None) -> ToolCallParser:
    """A parser instance: a registered name, an entry point, or ``module:Class`` (a
    :class:`ToolCallParser` subclass, or any factory of an object with ``parse(text)``)."""
    options = dict(options or {})
    is_reference = ':' in name and name not in PARSERS
    parser = PARSERS.get(name, base_dir)(**options)
    if is_reference and not callable(getattr(parser, 'parse', None)):
        raise TypeError(f'{name} does not produce a parser (no parse(text) method)')
    return parser


__all__ = [
    'ToolCall', 'ToolCallParser', 'HermesParser', 'Llama3JsonParser', 'PythonicParser', 'MistralParser',
    'DeepSeekParser', 'ReActParser', 'JSONParser', 'PARSERS', 'register_parser', 'parser_names', 'get_parser',
    'strip_thinking', 'loads_lenient', 'call_from_obj', 'detect_formats', 'foreign_format'
]
