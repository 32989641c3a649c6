"""A tool: a name, a description, JSON-schema parameters, and a sync or async implementation.

A :class:`Tool` is what the YAML scheduler runs and what the runner calls. For a plain Python
function, :func:`tool_from_callable` derives the parameters from its signature and the description
from its docstring, so a ``module:function`` named in YAML needs no schema written by hand.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Literal, Optional

from mtflow.core.calls import is_async_callable
from mtflow.tools.bounds import DEFAULT_MAX_OBSERVATION
from mtflow.core.signatures import describe_callable

__all__ = ['Tool', 'TruncateSide', 'parameters_problems', 'schema_from_callable', 'tool_from_callable']

TruncateSide = Literal['right', 'left']


@dataclass
class Tool:
    """A callable tool with the metadata the model and the runner need."""
    name: str
    fn: Callable[..., Any]
    description: str = ''
    parameters: Dict[str, Any] = field(default_factory=lambda: {'type': 'object', 'properties': {}})
    timeout_s: Optional[float] = None
    max_concurrency: Optional[int] = None
    #: the longest observation of one call: tokens with the scheduler's tokenizer, else characters
    #: (:mod:`mtflow.tools.bounds`)
    max_observation: int = DEFAULT_MAX_OBSERVATION
    truncate_side: TruncateSide = 'right'

    @property
    def is_async(self) -> bool:
        return is_async_callable(self.fn)

    def spec(self) -> Dict[str, Any]:
        """The OpenAI/Qwen function-calling description of this tool."""
        return {'type': 'function',
                'function': {'name': self.name, 'description': self.description, 'parameters': self.parameters}}


# ---- deriving a schema from a Python callable ---------------------------------------------------
_JSON_TYPES = {str: 'string', int: 'integer', float: 'number', bool: 'boolean', list: 'array', dict: 'object'}


def _json_type(annotation: Any) -> Optional[str]:
    if annotation in _JSON_TYPES:
        return _JSON_TYPES[annotation]
    if isinstance(annotation, str):
        return {'str': 'string', 'int': 'integer', 'float': 'number', 'bool': 'boolean', 'list': 'array',
                'dict': 'object'}.get(annotation.split('[')[0].strip())
    origin = getattr(annotation, '__origin__', None)
    return _JSON_TYPES.get(origin) if origin is not None else None


def _doc_parts(doc: str) -> tuple:
    """(summary, {arg: description}) from a Google-style docstring."""
    doc = inspect.cleandoc(doc or '')
    summary_lines, args, section, current = [], {}, None, None
    for line in doc.splitlines():
        stripped = line.strip()
        if re.match(r'^(Args|Arguments|Parameters|Returns|Raises|Yields):\s*$', stripped):
            section = stripped[:-1].lower()
            continue
        if section is None:
            summary_lines.append(stripped)
        elif section in ('args', 'arguments', 'parameters') and stripped:
            m = re.match(r'^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$', stripped)
            if m and line.startswith((' ', '\t')) and len(line) - len(line.lstrip()) <= 8:
                current = m.group(1).lstrip('*')
                args[current] = m.group(3)
            elif current:
                args[current] += ' ' + stripped
    summary = ' '.join(' '.join(summary_lines).split())
    return summary, args


def schema_from_callable(fn: Callable[..., Any]) -> tuple:
    """(description, JSON-schema parameters) derived from ``fn``'s signature and docstring."""
    summary, arg_docs = _doc_parts(inspect.getdoc(fn) or '')
    props: Dict[str, Any] = {}
    required: List[str] = []
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return summary, {'type': 'object', 'properties': {}}
    for name, param in sig.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        prop: Dict[str, Any] = {}
        jtype = _json_type(param.annotation) if param.annotation is not param.empty else None
        if jtype:
            prop['type'] = jtype
        if name in arg_docs:
            prop['description'] = arg_docs[name]
        if param.default is param.empty:
            required.append(name)
        elif param.default is None or isinstance(param.default, (str, int, float, bool)):
            prop['default'] = param.default
        props[name] = prop
    schema: Dict[str, Any] = {'type': 'object', 'properties': props}
    if required:
        schema['required'] = required
    return summary, schema


def parameters_problems(fn: Callable[..., Any], parameters: Dict[str, Any]) -> List[tuple]:
    """What makes a call whose arguments pass ``parameters`` (the tool's declared JSON Schema)
    fail on ``fn``'s signature, as ``[(where in parameters, message)]`` (``('properties', 'q')``,
    ``('required', )``): the runner checks a call's arguments against the schema alone, then calls
    ``fn(**arguments)``, so a property ``fn`` does not take, or a parameter ``fn`` requires that the
    schema leaves out or leaves optional, would fail such calls at run time, counted as the model's
    ``bad_arguments``. ``[]`` when they agree, or when ``fn``'s signature cannot be read."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    params = {n: p for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    any_keyword = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    props = parameters.get('properties') if isinstance(parameters.get('properties'), dict) else {}
    required = [r for r in parameters.get('required') or [] if isinstance(r, str)]
    shown = '(' + ', '.join(str(p.replace(annotation=inspect.Parameter.empty)) for p in sig.parameters.values()) + ')'
    where = describe_callable(fn).replace('()', shown, 1)  # search(query, limit=5) in tools.py:4
    at_required = ('required', ) if 'required' in parameters else ()
    at_properties = ('properties', ) if 'properties' in parameters else ()
    found: List[tuple] = []
    for name in dict.fromkeys([*props, *required]):
        param = params.get(name)
        at = ('properties', name) if name in props else at_required
        if param is None and not any_keyword:
            found.append((at, f'parameter {name!r} is declared, but {where} takes no argument {name!r}: every call '
                          'that passes it fails'))
        elif param is not None and param.kind == param.POSITIONAL_ONLY:
            found.append((at, f'parameter {name!r} is positional-only in {where}: a call by name fails'))
        elif name not in props and props and parameters.get('additionalProperties', False) is False:
            found.append((at, f'parameter {name!r} is in parameters.required but not in parameters.properties: '
                          'every call is refused'))
    for name, param in params.items():
        if param.default is not param.empty or param.kind == param.POSITIONAL_ONLY:
            continue  # a positional-only one is reported above when declared; else no call passes it anyway
        if name not in props and name not in required:
            found.append((at_properties, f'{where} requires {name!r}, which parameters does not declare: every call '
                          'fails'))
        elif name not in required:
            found.append((at_required, f'{where} requires {name!r}, which is not in parameters.required: a call '
                          'without it fails'))
    return found


def tool_from_callable(fn: Callable[..., Any], name: Optional[str] = None, **meta: Any) -> Tool:
    """A :class:`Tool` for ``fn``; description and parameters default to what its signature and
    docstring say."""
    description, parameters = schema_from_callable(fn)
    meta = {k: v for k, v in meta.items() if v is not None}
    meta.setdefault('description', description)
    meta.setdefault('parameters', parameters)
    return Tool(name=name or fn.__name__, fn=fn, **meta)
