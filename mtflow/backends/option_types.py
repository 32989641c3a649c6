"""The types of a backend's options, read from its constructor's annotations and checked before
the backend is built.

A run config's ``backend_options`` (and ``-o KEY=VALUE``, ``--set backend_options.KEY=VALUE``)
reach the backend's constructor as keyword arguments. A value of the wrong type would pass
silently (``-o cycle=maybe`` is a truthy string where a bool is declared) or fail only after the
model loaded. So each value is checked against its parameter's annotation, strictly, as the run
config's own keys are (``true`` is not 1, ``"8"`` is not 8, ``"no"`` is not a bool); a string is
accepted where a path is declared. An option without an annotation, annotated ``Any``, or whose
annotation cannot be read (a name imported only for type checkers) is not checked.
"""
from __future__ import annotations

import inspect
import os
import typing
from pathlib import PurePath
from typing import Any, Dict, Optional, Tuple

from pydantic import ConfigDict, TypeAdapter, ValidationError

__all__ = ['option_annotations', 'option_type_problem']


def option_annotations(cls: Any) -> Dict[str, Tuple[Any, str]]:
    """``{option: (type, as written)}`` for the annotated keyword parameters of a backend class's
    constructor (or a factory function's); the ones that cannot be evaluated are left out."""
    target = cls.__init__ if isinstance(cls, type) else cls
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return {}
    namespace = getattr(inspect.unwrap(target), '__globals__', {})
    found: Dict[str, Tuple[Any, str]] = {}
    for name, param in params.items():
        annotation = param.annotation
        if name == 'self' or annotation is inspect.Parameter.empty or param.kind in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        written = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
        if isinstance(annotation, str):
            try:
                annotation = eval(annotation, dict(namespace), {})  # noqa: S307 - the class's own annotation
            except Exception:  # a name only type checkers see: not checked
                continue
        if annotation is not Any:
            found[name] = (annotation, written)
    return found


def _paths_as_text(hint: Any) -> Any:
    """``hint`` with every path type (``Path``, ``os.PathLike``) also taking a ``str``."""
    if isinstance(hint, type) and (issubclass(hint, PurePath) or hint is os.PathLike):
        return typing.Union[str, hint]
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if not args or origin is None or origin is typing.Literal:
        return hint
    mapped = tuple(_paths_as_text(a) for a in args)
    if mapped == args:
        return hint
    if origin is typing.Union:
        return typing.Union[mapped]
    try:
        return hint.copy_with(mapped)
    except AttributeError:  # a builtin generic (list[Path]): rebuilt from its origin
        return origin[mapped]


def option_type_problem(hint: Any, written: str, value: Any) -> Optional[str]:
    """Why ``value`` is not of type ``hint`` (``bool, not 'maybe' (a str)``; ``written``: the
    annotation as the source spells it), or ``None`` when it is, or when the type cannot be
    checked."""
    try:
        adapter = TypeAdapter(_paths_as_text(hint), config=ConfigDict(strict=True, arbitrary_types_allowed=True))
    except Exception:  # a type pydantic cannot build a check for: not checked
        return None
    try:
        adapter.validate_python(value)
    except ValidationError:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + '...'
        kind = type(value).__name__
        return f'{written}, not {shown} ({"an" if kind[0] in "aeiou" else "a"} {kind})'
    except Exception:  # a validator that itself failed: not this check's business
        return None
    return None
