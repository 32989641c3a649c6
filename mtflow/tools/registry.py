"""The tools YAML can name with ``builtin:`` (or by ``name`` alone): the built-ins (``calculator``,
``python``), those added with :func:`register_tool`, and those installed packages declare as
``mtflow.tools`` entry points.

What is registered is a factory: ``factory(options) -> tool callable``, so that a built-in such as
``python`` receives its YAML ``options``; a plain tool function is wrapped in a factory that takes
no options. A tool named by ``impl: module:function`` is no built-in: the scheduler resolves it.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from pydantic import ValidationError

from mtflow.core.registry import Registry
from mtflow.tools.calculator import calculator
from mtflow.tools.sandbox import make_python_tool
from mtflow.tools.tool import Tool, schema_from_callable, tool_from_callable

__all__ = ['TOOLS', 'Tool', 'register_tool', 'builtin_names', 'check_builtin_options', 'make_builtin',
           'schema_from_callable', 'tool_from_callable']

ToolFactory = Callable[[Dict[str, Any]], Callable[..., Any]]


def _takes_no_options(fn: Callable[..., Any]) -> ToolFactory:
    return lambda options, _fn=fn: _fn


#: name -> factory(options: dict) -> tool callable
TOOLS = Registry('mtflow.tools', 'unknown built-in tool {name} (known: {known})', references=False,
                 from_entry_point=_takes_no_options)

#: name -> pydantic model of the built-in's ``options`` (checked by ``mtflow validate``, field by field)
_OPTIONS_MODELS: Dict[str, Any] = {}


def register_tool(name: Optional[str] = None, *, factory: bool = False,
                  options: Any = None) -> Callable[[Callable[..., Any]], Any]:
    """Decorator: make a tool available by name in YAML (``builtin: <name>``).

    With ``factory=True`` the decorated function takes the YAML ``options`` dict and returns the
    tool callable (how ``python`` receives its limits); ``options`` may name a pydantic model of
    those options, so that validation reports each bad option at its own line before any run."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        key = name or fn.__name__
        TOOLS.register(key, fn if factory else _takes_no_options(fn))
        if options is not None:
            _OPTIONS_MODELS[key] = options
        return fn

    return deco


def builtin_names() -> List[str]:
    """Registered built-in tools, and the tools installed packages declare (``mtflow.tools``
    entry points, not imported until a config names one)."""
    return TOOLS.names()


def check_builtin_options(name: str, options: Optional[Dict[str, Any]]) -> List[tuple]:
    """Problems with a built-in's ``options`` as ``(loc below options, message)``; ``[]`` when
    they are fine or the built-in declares no options model (its factory then checks them)."""
    TOOLS.get(name)
    model = _OPTIONS_MODELS.get(name)
    if model is None:
        return []
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
    factory = TOOLS.get(name)
    problems = check_builtin_options(name, options)
    if problems:
        raise ValueError('; '.join(f'{".".join(map(str, loc))}: {msg}' for loc, msg in problems))
    return factory(dict(options or {}))


# ---- the built-ins ------------------------------------------------------------------------------
@TOOLS.register('calculator')
def _calculator_factory(options: Dict[str, Any]) -> Callable[..., Any]:
    if options:
        raise ValueError(f'calculator takes no options, got {sorted(options)}')
    return calculator


TOOLS.register('python', make_python_tool)
