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
``qwen3_coder``    Qwen3-Coder, Qwen3.5 XML ``<tool_call><function=NAME><parameter=K>V</parameter>...``
``glm45``          GLM-4.5/4.6/4.7 ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>`` (``glm``, ``glm47``)
``kimi_k2``        Kimi-K2 ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0...`` (``kimi``)
``deepseek_v32``   DeepSeek-V3.2 DSML ``<｜DSML｜function_calls><｜DSML｜invoke name="NAME">...``
``minimax_m2``     MiniMax-M2 ``<minimax:tool_call><invoke name="NAME"><parameter name="K">V...``
``harmony``        gpt-oss channels, through ``openai-harmony`` (``gpt_oss``; an optional extra)
=================  ===============================================================================

The XML formats carry parameter values as text; :func:`typed_calls` types them by the tools' JSON
schemas (:mod:`.schema_types`), which :func:`parse_calls` applies for every caller.

More with :func:`register_parser`, or from installed packages (``mtflow.parsers`` entry points).
A call that cannot be parsed is still returned, with ``error`` set, so that the scheduler can feed
the problem back to the model (quoting the parser's ``expected`` format) and count it.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

from mtflow.core.registry import Registry
from mtflow.declarative.parsers.base import ToolCall, ToolCallParser, call_from_obj, loads_lenient, strip_thinking
from mtflow.declarative.parsers.deepseek import DeepSeekParser
from mtflow.declarative.parsers.detect import detect_formats, foreign_format
from mtflow.declarative.parsers.dsml import DeepSeekV32Parser
from mtflow.declarative.parsers.glm import GLMParser
from mtflow.declarative.parsers.harmony import HarmonyParser
from mtflow.declarative.parsers.hermes import HermesParser
from mtflow.declarative.parsers.json_calls import JSONParser
from mtflow.declarative.parsers.kimi import KimiK2Parser
from mtflow.declarative.parsers.llama import Llama3JsonParser, PythonicParser
from mtflow.declarative.parsers.minimax import MiniMaxM2Parser
from mtflow.declarative.parsers.mistral import MistralParser
from mtflow.declarative.parsers.qwen3_coder import Qwen3CoderParser
from mtflow.declarative.parsers.react import ReActParser
from mtflow.declarative.parsers.schema_types import typed_calls

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
    'qwen3_coder': Qwen3CoderParser,
    'glm45': GLMParser,
    'glm': GLMParser,
    'glm47': GLMParser,
    'kimi_k2': KimiK2Parser,
    'kimi': KimiK2Parser,
    'deepseek_v32': DeepSeekV32Parser,
    'minimax_m2': MiniMaxM2Parser,
    'minimax': MiniMaxM2Parser,
    'harmony': HarmonyParser,
    'gpt_oss': HarmonyParser,
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


def parse_calls(parser: Any, text: str, tools: Optional[Sequence[Dict[str, Any]]] = None) -> List[ToolCall]:
    """The calls ``parser`` reads from ``text``, the text values of the XML formats typed by
    ``tools`` (OpenAI function specs: the scheduler's tools, or a gateway client's)."""
    return typed_calls(list(parser.parse(text)), tools)


__all__ = [
    'ToolCall', 'ToolCallParser', 'HermesParser', 'Llama3JsonParser', 'PythonicParser', 'MistralParser',
    'DeepSeekParser', 'ReActParser', 'JSONParser', 'Qwen3CoderParser', 'GLMParser', 'KimiK2Parser',
    'DeepSeekV32Parser', 'MiniMaxM2Parser', 'HarmonyParser', 'PARSERS', 'register_parser', 'parser_names',
    'get_parser', 'parse_calls', 'typed_calls', 'strip_thinking', 'loads_lenient', 'call_from_obj',
    'detect_formats', 'foreign_format'
]
