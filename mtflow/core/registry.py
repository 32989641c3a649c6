"""Named things loaded on demand: the one resolver of ``module:attribute`` references.

Tools, parsers, environments, schedulers and backends are all named in YAML by a registered name,
an installed entry point or a ``module:attribute`` reference; every layer resolves the last form
here, so a reference means the same thing in every field of a config.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any, Optional

__all__ = ['import_module', 'resolve_reference']


def import_module(module_name: str, base_dir: Optional[str] = None) -> Any:
    """Import ``module_name``; if it is not importable, ``<base_dir>/<module path>.py`` is tried,
    so a YAML file can name a Python file next to it. ``ImportError`` names what was missing; an
    exception raised by the module itself propagates."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        candidate = os.path.join(base_dir, *module_name.split('.')) + '.py' if base_dir else None
        if not (candidate and os.path.isfile(candidate) and (exc.name or '') in module_name):
            raise ImportError(f'cannot import module {module_name!r}: {exc}') from None
    key = f'_mtflow_local_{abs(hash(os.path.abspath(candidate)))}_{module_name.replace(".", "_")}'
    module = sys.modules.get(key)
    if module is None:
        spec = importlib.util.spec_from_file_location(key, candidate)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(key, None)
            raise
    return module


def resolve_reference(ref: str, base_dir: Optional[str] = None) -> Any:
    """The object named by ``'package.module:attr.sub'`` (the module found as :func:`import_module`
    finds it). Raises ``ImportError``/``AttributeError`` with a message naming what was missing."""
    if not isinstance(ref, str) or ':' not in ref:
        raise ImportError(f"reference {ref!r} must look like 'module:attribute'")
    module_name, _, attr = ref.partition(':')
    if not module_name or not attr:
        raise ImportError(f"reference {ref!r} must look like 'module:attribute'")
    module = import_module(module_name, base_dir)
    obj: Any = module
    for part in attr.split('.'):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(f'module {module_name!r} has no attribute {attr!r}') from None
    return obj
