"""A tool's JSON schema as a Python signature and a Google-style docstring: the inverse of
:func:`mtflow.tools.tool.schema_from_callable`, for frameworks that read a tool's schema back from
a Python callable (TRL's environment methods, through transformers' ``get_json_schema``: the
type hints give each argument's type, the docstring's ``Args:`` section its description).

Only what a signature can say is carried: each argument's ``type`` (a JSON type, a list of them,
``null``), ``items`` of an array, ``enum`` (as ``Literal``), ``nullable``, ``description``,
``default`` (an optional argument) and ``title`` (dropped: only a label). Any other key
(``minimum``, ``pattern``, an object's own ``properties``, ``anyOf``, ...) would be lost on the
way, so :func:`tool_signature` refuses it with :class:`SchemaNotCarried`, naming the tool, the
argument and the key.
"""
from __future__ import annotations

import inspect
import keyword
from dataclasses import dataclass
from typing import Any, Dict, List, Literal, Optional, Union

__all__ = ['SchemaNotCarried', 'ToolSignature', 'tool_signature', 'CARRIED_KEYS']

#: the keys of an argument's schema a Python signature and docstring carry
CARRIED_KEYS = frozenset({'type', 'items', 'enum', 'nullable', 'description', 'default', 'title'})
#: the keys of the parameters' object schema itself that are carried (``additionalProperties`` only
#: says whether unknown keys are refused: mtflow's argument check enforces it when the tool runs)
_OBJECT_KEYS = frozenset({'type', 'properties', 'required', 'additionalProperties', 'title', 'description'})
_TYPES: Dict[str, Any] = {'string': str, 'integer': int, 'number': float, 'boolean': bool, 'array': list,
                          'object': dict, 'null': type(None)}
_ENUM_VALUE_TYPES = (str, int, float, bool, type(None))


class SchemaNotCarried(ValueError):
    """A tool whose schema a Python signature cannot carry (or whose names are no Python names)."""


@dataclass(frozen=True)
class ToolSignature:
    """What a callable needs so that ``get_json_schema`` reads ``parameters`` back."""
    signature: inspect.Signature
    annotations: Dict[str, Any]
    doc: str
    #: the tool's description as the docstring gives it (whitespace joined to one line)
    summary: str
    #: each argument's description as the docstring gives it (whitespace joined to one line)
    descriptions: Dict[str, str]


def tool_signature(name: str, description: str, parameters: Optional[Dict[str, Any]],
                   receiver: Optional[str] = 'self') -> ToolSignature:
    """The signature (keyword arguments after ``receiver``), annotations and docstring of a tool
    ``name`` with ``parameters`` (an object JSON schema); :class:`SchemaNotCarried` when the
    schema holds something they cannot say."""
    schema = parameters or {'type': 'object', 'properties': {}}
    extra = sorted(set(schema) - _OBJECT_KEYS)
    if extra:
        raise SchemaNotCarried(f'tool {name!r}: its parameters schema has {", ".join(extra)}, which a Python '
                               'signature cannot carry')
    properties: Dict[str, Any] = schema.get('properties') or {}
    required = set(schema.get('required') or [])
    params: List[inspect.Parameter] = []
    if receiver:
        params.append(inspect.Parameter(receiver, inspect.Parameter.POSITIONAL_OR_KEYWORD))
    annotations: Dict[str, Any] = {}
    descriptions: Dict[str, str] = {}
    for arg, prop in properties.items():
        if not isinstance(arg, str) or not arg.isidentifier() or keyword.iskeyword(arg) or arg == receiver:
            raise SchemaNotCarried(f'tool {name!r}: argument {arg!r} is no Python name, so it cannot be a keyword '
                                   'argument')
        prop = prop if isinstance(prop, dict) else {}
        annotations[arg] = annotation(prop, f'tool {name!r}, argument {arg!r}')
        descriptions[arg] = ' '.join(str(prop.get('description') or arg).split())
        default = inspect.Parameter.empty if arg in required else prop.get('default')
        params.append(inspect.Parameter(arg, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=annotations[arg]))
    summary = ' '.join(str(description or name).split())
    doc = summary if not descriptions else summary + '\n\nArgs:\n' + ''.join(
        f'    {arg}: {text}\n' for arg, text in descriptions.items())
    return ToolSignature(inspect.Signature(params), annotations, doc, summary, descriptions)


def annotation(prop: Dict[str, Any], where: str) -> Any:
    """The Python type hint of one argument's JSON schema (``Any`` when it names no type)."""
    extra = sorted(set(prop) - CARRIED_KEYS)
    if extra:
        raise SchemaNotCarried(f'{where}: {", ".join(extra)} cannot be carried by a Python signature')
    if prop.get('enum') is not None:
        hint = _literal(prop['enum'], where)
    else:
        hint = _typed(prop.get('type'), prop.get('items'), where)
    return Optional[hint] if prop.get('nullable') and hint is not Any else hint


def _literal(values: Any, where: str) -> Any:
    if not isinstance(values, list) or not values or not all(isinstance(v, _ENUM_VALUE_TYPES) for v in values):
        raise SchemaNotCarried(f'{where}: enum must be a list of strings, numbers, booleans or null')
    return Literal[tuple(values)]


def _typed(kind: Any, items: Any, where: str) -> Any:
    if kind is None:
        return Any
    if isinstance(kind, list):
        hints = tuple(_typed(k, items, where) for k in kind)
        return Union[hints] if len(hints) > 1 else hints[0]
    if kind not in _TYPES:
        raise SchemaNotCarried(f'{where}: type {kind!r} is no JSON Schema type')
    if kind == 'array' and items is not None:
        return List[annotation(items if isinstance(items, dict) else {}, f'{where} (items)')]
    return _TYPES[kind]
