"""The tools YAML can name with ``builtin:`` (or by ``name`` alone): the built-ins (``calculator``,
``python``), those added with :func:`register_tool`, and those installed packages declare as
``mtflow.tools`` entry points.

What is registered is a factory: ``factory(options) -> tool callable``, so that a built-in such as
``python`` receives its YAML ``options``; a plain tool function is wrapped in a factory that takes
no options. A tool named by ``impl: module:function`` is no built-in: the scheduler resolves it.

Every built-in's options are checked option by option before it is built (:func:`check_builtin_options`):
``python`` with its own checks, a tool registered with an options model against that model, a
tool that takes no options (``calculator``, a plain function, an entry point) against none, so
``mtflow validate`` reports a bad option at its own file, line and key, an unknown one with the
closest known name.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from pydantic import ValidationError

from mtflow.core.keys import unknown_key_message
from mtflow.core.registry import Registry
from mtflow.tools.calculator import calculator
from mtflow.tools.sandbox import make_python_tool, python_option_problems
from mtflow.tools.tool import Tool, schema_from_callable, tool_from_callable

__all__ = ['TOOLS', 'Tool', 'register_tool', 'builtin_names', 'check_builtin_options', 'make_builtin',
           'schema_from_callable', 'tool_from_callable']

ToolFactory = Callable[[Dict[str, Any]], Callable[..., Any]]
#: ``check(options) -> [(loc below options, message)]``: the problems of a built-in's options
OptionsCheck = Callable[[Dict[str, Any]], List[Tuple[Tuple[Any, ...], str]]]


def _takes_no_options(fn: Callable[..., Any]) -> ToolFactory:
    """The factory of a tool that takes no options (a plain function, an entry point's): it is
    built with none (:func:`check_builtin_options` reports any option given)."""
    def factory(options: Dict[str, Any], _fn: Callable[..., Any] = fn) -> Callable[..., Any]:
        if options:
            raise ValueError(f'this tool takes no options, got {sorted(map(str, options))}')
        return _fn

    factory.takes_no_options = True  # type: ignore[attr-defined]
    return factory


#: name -> factory(options: dict) -> tool callable
TOOLS = Registry('mtflow.tools', 'unknown built-in tool {name} (known: {known})', references=False,
                 from_entry_point=_takes_no_options)

#: name -> the check of the built-in's ``options`` (:data:`OptionsCheck`; from a pydantic model or its own)
_OPTIONS_CHECKS: Dict[str, OptionsCheck] = {}


def _model_check(model: Any) -> OptionsCheck:
    """:data:`OptionsCheck` of a pydantic model of the options: each error at its key, an unknown
    key with the closest field name."""
    def check(options: Dict[str, Any]) -> List[Tuple[Tuple[Any, ...], str]]:
        try:
            model.model_validate(options)
        except ValidationError as exc:
            found = []
            for err in exc.errors(include_url=False):
                loc, msg = tuple(err['loc']), err['msg']
                if err['type'] == 'extra_forbidden':
                    msg = (unknown_key_message(str(loc[-1]), model.model_fields) if len(loc) == 1 else
                           f'unknown key {loc[-1]!r}')
                elif not isinstance(err.get('input'), (dict, list)):
                    msg += f' (got {err["input"]!r})'
                found.append((loc, msg))
            return found
        return []

    return check


def register_tool(name: Optional[str] = None, *, factory: bool = False,
                  options: Any = None) -> Callable[[Callable[..., Any]], Any]:
    """Decorator: make a tool available by name in YAML (``builtin: <name>``).

    With ``factory=True`` the decorated function takes the YAML ``options`` dict and returns the
    tool callable (how ``python`` receives its limits); ``options`` may name a pydantic model of
    those options, or a check (``check(options) -> [(loc below options, message)]``), so that
    validation reports each bad option at its own line before any run. Without ``factory`` the
    tool takes no options, and any option given is reported."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        key = name or fn.__name__
        TOOLS.register(key, fn if factory else _takes_no_options(fn))
        _OPTIONS_CHECKS.pop(key, None)
        if options is not None:
            _OPTIONS_CHECKS[key] = _model_check(options) if isinstance(options, type) else options
        return fn

    return deco


def builtin_names() -> List[str]:
    """Registered built-in tools, and the tools installed packages declare (``mtflow.tools``
    entry points, not imported until a config names one)."""
    return TOOLS.names()


def check_builtin_options(name: str, options: Optional[Dict[str, Any]]) -> List[tuple]:
    """Problems with a built-in's ``options`` as ``(loc below options, message)``, each at its
    option's key; ``[]`` when they are fine, or when the built-in is a factory that declares no
    check (it then checks them itself when it is built)."""
    factory = TOOLS.get(name)
    options = dict(options or {})
    if getattr(factory, 'takes_no_options', False):
        return [((key, ), f'{name} tool: unknown key {str(key)!r}: this tool takes no options') for key in options]
    check = _OPTIONS_CHECKS.get(name)
    return [(loc, f'{name} tool: {msg}') for loc, msg in check(options)] if check is not None else []


def make_builtin(name: str, options: Optional[Dict[str, Any]] = None) -> Callable[..., Any]:
    """The callable of built-in tool ``name`` configured with ``options`` (``ValueError`` listing
    every bad option)."""
    factory = TOOLS.get(name)
    problems = check_builtin_options(name, options)
    if problems:
        raise ValueError('; '.join(f'{".".join(map(str, loc))}: {msg}' for loc, msg in problems))
    return factory(dict(options or {}))


# ---- the built-ins ------------------------------------------------------------------------------
TOOLS.register('calculator', _takes_no_options(calculator))
TOOLS.register('python', make_python_tool)
_OPTIONS_CHECKS['python'] = python_option_problems
