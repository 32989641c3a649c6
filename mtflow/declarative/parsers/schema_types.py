"""Parameter values the XML tool-call formats write as text, typed by the tool's JSON schema.

Qwen3-Coder (``<parameter=n>5</parameter>``), GLM (``<arg_value>5</arg_value>``) and MiniMax-M2
(``<parameter name="n">5</parameter>``) carry every value as text; the model means ``5`` when the
tool's parameter is an integer and ``"5"`` when it is a string. This module is the one place that
decides, for the scheduler (which knows its tools) and the gateway (which gets them per call):

==========================  =====================================================================
schema ``type``             the text becomes
==========================  =====================================================================
``string`` (or ``enum``)    the text, as written
``integer``                 an ``int`` when the text is one (``"5"``, ``" 5 "``)
``number``                  an ``int`` or ``float`` (``"2.5"``; ``"3.0"`` is ``3``)
``boolean``                 ``true``/``false`` in any case
``object``, ``array``       JSON, else a Python literal (``{'a': 1}``)
a list / ``anyOf``          the first of its types that reads
``null`` (any type)         ``None``
==========================  =====================================================================

A value that does not read as its type stays text, so the argument check tells the model
(``argument 'n' must be of type integer, got str``) instead of a guess being run. A parameter the
schema does not describe stays text (``text_values='text'``: Qwen3-Coder, MiniMax-M2) or is read
as JSON when it parses (``'json'``: GLM's own convention).
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence

from mtflow.declarative.parsers.base import ToolCall

__all__ = ['typed_calls', 'typed_value', 'tool_properties']

_INT = re.compile(r'[+-]?\d+')
_STRINGS = ('string', 'str', 'text', 'enum')


def tool_properties(tools: Optional[Sequence[Dict[str, Any]]], name: str) -> Optional[Dict[str, Any]]:
    """The ``properties`` of the tool ``name`` among OpenAI function specs (``None``: no such tool)."""
    for spec in tools or ():
        function = spec.get('function', spec) if isinstance(spec, dict) else None
        if isinstance(function, dict) and function.get('name') == name:
            params = function.get('parameters') or {}
            props = params.get('properties') if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return None


def typed_calls(calls: List[ToolCall], tools: Optional[Sequence[Dict[str, Any]]]) -> List[ToolCall]:
    """``calls`` with the text values of the XML formats typed by ``tools`` (OpenAI function specs);
    other calls, and calls with an error, unchanged."""
    out = []
    for call in calls:
        if call.text_values is None or call.error is not None or not isinstance(call.arguments, dict):
            out.append(call)
            continue
        props = tool_properties(tools, call.name) or {}
        args = {k: typed_value(v, props.get(k), call.text_values) if isinstance(v, str) else v
                for k, v in call.arguments.items()}
        out.append(replace(call, arguments=args, text_values=None))
    return out


def typed_value(text: str, schema: Optional[Dict[str, Any]], untyped: str = 'text') -> Any:
    """``text`` as the value ``schema`` describes (the module docstring); ``untyped``: what a value
    without a schema becomes (``'text'``: itself; ``'json'``: JSON when it parses)."""
    if text.strip().lower() == 'null':
        return None
    if not isinstance(schema, dict):
        return _json_or_text(text) if untyped == 'json' else text
    for kind in _types(schema):
        value = _as(kind, text)
        if value is not _NO:
            return value
    return text


def _types(schema: Dict[str, Any]) -> List[str]:
    kind = schema.get('type')
    if isinstance(kind, str):
        return [kind.strip().lower()]
    if isinstance(kind, list):
        return [str(k).strip().lower() for k in kind if k != 'null']
    for key in ('anyOf', 'oneOf'):
        options = schema.get(key)
        if isinstance(options, list):
            return [k for o in options if isinstance(o, dict) for k in _types(o)]
    return ['enum'] if 'enum' in schema else ['string']


_NO = object()


def _as(kind: str, text: str) -> Any:
    if kind in _STRINGS:
        return text
    stripped = text.strip()
    if kind in ('integer', 'int'):
        return int(stripped) if _INT.fullmatch(stripped) else _NO
    if kind in ('number', 'float'):
        try:
            number = float(stripped)
        except ValueError:
            return _NO
        return int(number) if number.is_integer() and abs(number) < 2**63 else number
    if kind in ('boolean', 'bool'):
        return {'true': True, 'false': False}.get(stripped.lower(), _NO)
    if kind in ('object', 'array', 'dict', 'list'):
        value = _json_or_literal(stripped)
        wanted = dict if kind in ('object', 'dict') else list
        return value if isinstance(value, wanted) else _NO
    return _NO


def _json_or_literal(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _NO


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text
