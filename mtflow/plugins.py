"""Plugins the ecosystem's way: tools, parsers and environments from installed packages.

A package declares them as entry points (``pyproject.toml``)::

    [project.entry-points."mtflow.tools"]
    weather = "my_pkg.tools:weather"          # a tool callable, used as ``builtin: weather``
    [project.entry-points."mtflow.parsers"]
    my_format = "my_pkg.parsing:MyParser"     # a ToolCallParser factory, ``parser: my_format``
    [project.entry-points."mtflow.envs"]
    maze = "my_pkg.envs:MazeEnv"              # an environment class, ``env: {impl: maze}``

An entry point whose value is a bare module (``"my_pkg.register"``) is imported for its
``register_tool`` / ``register_parser`` / ``register_env`` calls. Nothing is imported until a
config names the entry point: a broken plugin that no config uses costs nothing, and the names
are still listed in "unknown tool" messages. A YAML file's ``plugins: [module, ...]`` key imports
modules (next to the YAML too) before the rest of the file is checked, so the ``register_*``
decorators of a user's module work from the CLI.
"""
from __future__ import annotations

import sys
from importlib import metadata
from typing import Any, Dict, List, Optional, Tuple

__all__ = ['GROUPS', 'entry_point_names', 'load_entry_point', 'loaded_entry_points', 'import_plugins',
           'refresh_entry_points']

GROUPS = ('mtflow.tools', 'mtflow.parsers', 'mtflow.envs')

#: ``(group, name) -> 'value (distribution)'`` of every entry point loaded in this process
_LOADED: Dict[Tuple[str, str], str] = {}


#: ``(group, sys.path) -> entry points``: scanning every installed distribution costs tens of ms,
#: and names are looked up several times per file; a change of ``sys.path`` rescans
_CACHE: Dict[Tuple[str, Tuple[str, ...]], List[Any]] = {}


def _entry_points(group: str) -> List[Any]:
    key = (group, tuple(sys.path))
    if key not in _CACHE:
        try:
            _CACHE[key] = list(metadata.entry_points(group=group))
        except Exception:  # a broken installed distribution must not break every config
            _CACHE[key] = []
    return _CACHE[key]


def refresh_entry_points() -> None:
    """Forget the scanned entry points (after installing a package into a running process)."""
    _CACHE.clear()


def entry_point_names(group: str) -> List[str]:
    """Names declared in ``group`` by installed packages (nothing is imported)."""
    return sorted({ep.name for ep in _entry_points(group)})


def _register(group: str, name: str, obj: Any) -> None:
    if group == 'mtflow.tools':
        from mtflow.tools.registry import _REGISTRY, register_tool
        if name not in _REGISTRY:
            register_tool(name)(obj)
    elif group == 'mtflow.parsers':
        from mtflow.declarative.parsers import _PARSERS, register_parser
        if name not in _PARSERS:
            register_parser(name, obj)
    elif group == 'mtflow.envs':
        from mtflow.declarative.gym import _ENVS, register_env
        if name not in _ENVS:
            register_env(name, obj)


def load_entry_point(group: str, name: str) -> bool:
    """Import entry point ``name`` of ``group`` and register what it names; ``False`` when no
    installed package declares it. An entry point that fails to import raises ``ImportError``
    naming the entry point and its package."""
    if group not in GROUPS:
        raise ValueError(f'unknown entry-point group {group!r} (known: {", ".join(GROUPS)})')
    for ep in _entry_points(group):
        if ep.name != name:
            continue
        dist = getattr(getattr(ep, 'dist', None), 'name', None) or '?'
        try:
            obj = ep.load()
        except Exception as exc:
            raise ImportError(f'entry point {group}:{name} = {ep.value!r} (package {dist}) failed to load: '
                              f'{type(exc).__name__}: {exc}') from None
        if ':' in ep.value:  # a bare module registered itself while importing
            _register(group, name, obj)
        _LOADED[(group, name)] = f'{ep.value} ({dist})'
        return True
    return False


def loaded_entry_points() -> Dict[Tuple[str, str], str]:
    """Entry points loaded so far in this process (for the "imports" list of ``mtflow validate``)."""
    return dict(_LOADED)


def import_plugins(modules: List[str], base_dir: Optional[str] = None) -> List[Tuple[int, str]]:
    """Import each plugin module (``plugins:`` of a YAML file); ``[(index, problem)]`` for those
    that cannot be imported or raise while importing."""
    from mtflow.tools.registry import import_module
    problems = []
    for i, module in enumerate(modules):
        try:
            import_module(module, base_dir)
        except ImportError as exc:
            problems.append((i, str(exc)))
        except Exception as exc:
            problems.append((i, f'importing plugin {module!r} failed: {type(exc).__name__}: {exc}'))
    return problems
