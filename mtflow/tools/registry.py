"""Tools: a name, a description, JSON-schema parameters, and a sync or async implementation.

A :class:`Tool` is what the YAML scheduler runs. Tools come from three places: the built-ins
(``calculator``, ``python``), :func:`register_tool` (a decorator, for tools shipped in Python
packages), and ``module:function`` references in YAML (:func:`tool_from_callable` derives the
parameters from the signature and the description from the docstring).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Literal, Optional

from mtflow.core.registry import import_module, resolve_reference as resolve_ref  # noqa: F401  (re-exported)

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
    max_observation: Optional[int] = None
    truncate_side: TruncateSide = 'right'

    @property
    def is_async(self) -> bool:
        fn = self.fn
        while isinstance(fn, functools.partial):
            fn = fn.func
        return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, '__call__', None))

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


def tool_from_callable(fn: Callable[..., Any], name: Optional[str] = None, **meta: Any) -> Tool:
    """A :class:`Tool` for ``fn``; description and parameters default to what its signature and
    docstring say."""
    description, parameters = schema_from_callable(fn)
    meta = {k: v for k, v in meta.items() if v is not None}
    meta.setdefault('description', description)
    meta.setdefault('parameters', parameters)
    return Tool(name=name or fn.__name__, fn=fn, **meta)


# ---- the registry -------------------------------------------------------------------------------
#: name -> factory(options: dict) -> callable
_REGISTRY: Dict[str, Callable[[Dict[str, Any]], Callable[..., Any]]] = {}
#: name -> pydantic model of the built-in's ``options`` (checked by ``mtflow validate``, field by field)
_OPTIONS: Dict[str, Any] = {}


def register_tool(name: Optional[str] = None, *, factory: bool = False,
                  options: Any = None) -> Callable[[Callable[..., Any]], Any]:
    """Decorator: make a tool available by name in YAML (``builtin: <name>``).

    With ``factory=True`` the decorated function takes the YAML ``options`` dict and returns the
    tool callable (how ``python`` receives its limits); ``options`` may name a pydantic model of
    those options, so that validation reports each bad option at its own line before any run."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        key = name or fn.__name__
        _REGISTRY[key] = fn if factory else (lambda options, _fn=fn: _fn)
        if options is not None:
            _OPTIONS[key] = options
        return fn

    return deco


def builtin_names() -> List[str]:
    """Registered built-in tools, and the tools installed packages declare (``mtflow.tools``
    entry points, not imported until a config names one)."""
    from mtflow.plugins import entry_point_names
    return sorted(set(_REGISTRY) | set(entry_point_names('mtflow.tools')))


def _lookup(name: str) -> Callable[[Dict[str, Any]], Callable[..., Any]]:
    if name not in _REGISTRY:
        from mtflow.plugins import load_entry_point
        load_entry_point('mtflow.tools', name)
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f'unknown built-in tool {name!r} (known: {", ".join(builtin_names())})') from None


def check_builtin_options(name: str, options: Optional[Dict[str, Any]]) -> List[tuple]:
    """Problems with a built-in's ``options`` as ``(loc below options, message)``; ``[]`` when
    they are fine or the built-in declares no options model (its factory then checks them)."""
    _lookup(name)
    model = _OPTIONS.get(name)
    if model is None:
        return []
    from pydantic import ValidationError
    try:
        model.model_validate(dict(options or {}))
    except ValidationError as exc:
        found = []
        for err in exc.errors(include_url=False):
            msg = err['msg']
            if err['type'] == 'extra_forbidden':
                msg = f'unknown option (allowed: {", ".join(model.model_fields)})'
            elif not isinstance(err.get('input'), (dict, list)):
                msg += f' (got {err["input"]!r})'
            found.append((tuple(err['loc']), f'{name} tool: {msg}'))
        return found
    return []


def make_builtin(name: str, options: Optional[Dict[str, Any]] = None) -> Callable[..., Any]:
    """The callable of built-in tool ``name`` configured with ``options`` (``ValueError`` listing
    every bad option)."""
    factory = _lookup(name)
    problems = check_builtin_options(name, options)
    if problems:
        raise ValueError('; '.join(f'{".".join(map(str, loc))}: {msg}' for loc, msg in problems))
    return factory(dict(options or {}))


# ---- the built-ins ------------------------------------------------------------------------------
def _calculator_factory(options: Dict[str, Any]) -> Callable[..., Any]:
    from mtflow.tools.calculator import calculator
    if options:
        raise ValueError(f'calculator takes no options, got {sorted(options)}')
    return calculator


def _python_factory(options: Dict[str, Any]) -> Callable[..., Any]:
    from mtflow.tools.sandbox import make_python_tool
    return make_python_tool(options)


_REGISTRY['calculator'] = _calculator_factory
_REGISTRY['python'] = _python_factory
