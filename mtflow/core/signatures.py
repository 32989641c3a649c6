"""Whether user code can be called the way mtflow will call it, checked by ``inspect.signature``
before anything runs: a reward ``reward(infer_request, rollout_infos)`` written with one
parameter is found by ``mtflow validate`` (naming the function, its file and line, what it takes
and what mtflow passes), not by a ``TypeError`` on every request after the model has loaded.

Only arity is checked (the arguments bound by position, as every hook is called); what a hook
returns is checked when it returns (:mod:`mtflow.core.validate`). A callable whose signature
cannot be read (a C function, some builtins) passes.
"""
from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence

__all__ = ['describe_callable', 'call_problem', 'method_call_problem']


def describe_callable(fn: Any) -> str:
    """``name() in path/file.py:12`` (as much of it as Python knows)."""
    target = inspect.unwrap(getattr(fn, '__func__', fn))
    if not (inspect.isfunction(target) or inspect.isclass(target) or inspect.ismethod(target)):
        target = getattr(type(target), '__call__', target)  # a callable object: its __call__
    name = getattr(target, '__qualname__', None) or getattr(target, '__name__', None) or type(fn).__name__
    try:
        file = inspect.getsourcefile(target)
        line = inspect.getsourcelines(target)[1]
    except (TypeError, OSError):
        return f'{name}()'
    return f'{name}() in {file}:{line}'


def _shown(sig: inspect.Signature) -> str:
    params = [p for p in sig.parameters.values()]
    return '(' + ', '.join(str(p.replace(annotation=inspect.Parameter.empty)) for p in params) + ')'


def call_problem(fn: Any, args: Sequence[str], what: str = '', *, bound: Sequence[str] = ()) -> Optional[str]:
    """Why ``fn(*bound, *args)`` (``args`` named as mtflow names them) cannot be called, or
    ``None``: ``wrong_reward() in rewards.py:3 takes (x); mtflow calls it as
    reward(infer_request, rollout_infos)``. ``what`` names the hook (``reward``); ``bound``: the
    arguments Python passes itself (``self``), not shown."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*bound, *args)
    except TypeError:
        return (f'{describe_callable(fn)} takes {_shown(sig)}; mtflow calls it as '
                f'{what or getattr(fn, "__name__", "fn")}({", ".join(args)})')
    return None


def method_call_problem(cls: type, name: str, args: Sequence[str]) -> Optional[str]:
    """:func:`call_problem` for method ``name`` of class ``cls`` called on an instance (``self``
    bound; a staticmethod or classmethod as Python binds it). ``None`` when ``cls`` has no such
    method."""
    try:
        raw = inspect.getattr_static(cls, name)
    except AttributeError:
        return None
    fn = getattr(cls, name)
    if not callable(fn):
        return None
    plain = inspect.isfunction(raw) and not isinstance(raw, (staticmethod, classmethod))
    return call_problem(fn, args, name, bound=('self', ) if plain else ())
