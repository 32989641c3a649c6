"""Named things loaded on demand: registries of tools, parsers and environments, the entry points of
installed packages, and the one resolver of ``module:attribute`` references.

YAML names a tool, a parser or an environment by a registered name, an installed entry point or
a ``module:attribute`` reference. :class:`Registry` looks a name up in that order, once, for every
kind; each kind's registry is created by the module that owns the kind (``mtflow.tools.registry``,
``mtflow.declarative.parsers``, ``mtflow.declarative.gym``) and nothing else writes into it.

Entry points are scanned (names only, nothing imported) when a name is listed or looked up, and a
plugin is imported only when a config names it: a broken plugin that no config uses costs nothing.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from importlib import metadata
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ['Registry', 'import_module', 'module_file', 'resolve_reference', 'registry_for', 'entry_point_names',
           'load_entry_point', 'loaded_entry_points', 'refresh_entry_points', 'import_plugins']


def _local_file(module_name: str, base_dir: Optional[str]) -> Tuple[bool, str, Optional[str]]:
    """``(is a path, the relative file, the file found)`` of a module name, as
    :func:`import_module` looks for it next to ``base_dir`` and in the current directory."""
    is_path = '/' in module_name or module_name.endswith('.py')
    relative = (module_name if module_name.endswith('.py') else module_name + '.py') if is_path else \
        os.path.join(*module_name.split('.')) + '.py'
    candidates = [relative] if os.path.isabs(relative) else \
        [os.path.join(d, relative) for d in (base_dir, os.getcwd()) if d]
    return is_path, relative, next((os.path.abspath(c) for c in candidates if os.path.isfile(c)), None)


def module_file(module_name: str, base_dir: Optional[str] = None) -> Optional[str]:
    """The source file :func:`import_module` would run for ``module_name``, found without running
    it (an installed module's parent packages are imported to find it); ``None`` when there is
    none (a built-in module, a name that does not import)."""
    is_path, _, candidate = _local_file(module_name, base_dir)
    if is_path:
        return candidate
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        spec = None
    origin = getattr(spec, 'origin', None)
    if spec is not None:
        return origin if origin and os.path.isfile(origin) else None
    return candidate


def import_module(module_name: str, base_dir: Optional[str] = None) -> Any:
    """Import ``module_name``; if it is not importable, ``<base_dir>/<module path>.py`` is tried,
    so a YAML file can name a Python file next to it, then the same file in the current directory
    (a reference given on the command line: ``mtflow`` is a console script, whose ``sys.path``
    lacks the directory ``python -m`` would put there). A name that is a path (``../lib/rewards``,
    ``tools/mine.py``, absolute or not) is that file. ``ImportError`` names what was missing; an
    exception raised by the module itself propagates."""
    is_path, relative, candidate = _local_file(module_name, base_dir)
    if is_path:
        if candidate is None:
            raise ImportError(f'cannot import module {module_name!r}: no file {relative}'
                              + (f' next to {base_dir} or' if base_dir and not os.path.isabs(relative) else '')
                              + ('' if os.path.isabs(relative) else ' in the current directory'))
    else:
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if not (candidate and (exc.name or '') in module_name):
                raise ImportError(f'cannot import module {module_name!r}: {exc}') from None
    key = f'_mtflow_local_{abs(hash(os.path.abspath(candidate)))}_{re.sub(r"[^0-9A-Za-z_]", "_", module_name)}'
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


def import_plugins(modules: List[str], base_dir: Optional[str] = None) -> List[Tuple[int, str]]:
    """Import each plugin module (``plugins:`` of a YAML file, for its ``register_*`` calls);
    ``[(index, problem)]`` for those that cannot be imported or raise while importing."""
    problems = []
    for i, module in enumerate(modules):
        try:
            import_module(module, base_dir)
        except ImportError as exc:
            problems.append((i, str(exc)))
        except Exception as exc:
            problems.append((i, f'importing plugin {module!r} failed: {type(exc).__name__}: {exc}'))
    return problems


# ---- entry points of installed packages ---------------------------------------------------------
#: ``(group, sys.path) -> entry points``: scanning every installed distribution costs tens of ms,
#: and names are looked up several times per file; a change of ``sys.path`` rescans
_SCANNED: Dict[Tuple[str, Tuple[str, ...]], List[Any]] = {}
#: ``sys.path -> every entry point``: one scan serves every group (a config looks up several)
_ALL: Dict[Tuple[str, ...], Any] = {}

#: ``(group, name) -> 'value (distribution)'`` of every entry point loaded in this process, in the
#: order they were loaded (``mtflow validate`` lists them in that order)
_LOADED: Dict[Tuple[str, str], str] = {}


def _entry_points(group: str) -> List[Any]:
    path = tuple(sys.path)
    key = (group, path)
    if key not in _SCANNED:
        try:
            if path not in _ALL:
                _ALL[path] = metadata.entry_points()
            _SCANNED[key] = list(_ALL[path].select(group=group))
        except Exception:  # a broken installed distribution must not break every config
            _SCANNED[key] = []
    return _SCANNED[key]


def refresh_entry_points() -> None:
    """Forget the scanned entry points (after installing a package into a running process)."""
    _SCANNED.clear()
    _ALL.clear()


def entry_point_names(group: str) -> List[str]:
    """Names declared in ``group`` by installed packages (nothing is imported)."""
    return sorted({ep.name for ep in _entry_points(group)})


def loaded_entry_points() -> Dict[Tuple[str, str], str]:
    """Entry points loaded so far in this process, every group (the "imports" list of
    ``mtflow validate``)."""
    return dict(_LOADED)


# ---- registries -------------------------------------------------------------------------------
#: entry-point group -> its registry (each registers itself when it is created)
_REGISTRIES: Dict[str, 'Registry'] = {}


class Registry:
    """The objects of one kind that YAML can name, and the one way a name is looked up:
    registered here, else an entry point of ``group`` (imported now, registered under its name),
    else (with ``references``) a ``module:attribute`` reference.

    ``unknown`` is the message of an unknown name, formatted with ``name`` (its repr) and
    ``known`` (the names, comma-separated). ``from_entry_point`` turns what a ``module:attr``
    entry point names into what is registered (e.g. a tool function into a tool factory); an
    entry point naming a bare module registers its objects itself while it is imported.
    ``builtins``: the names registered from the start."""

    def __init__(self, group: str, unknown: str, *, references: bool = True,
                 from_entry_point: Optional[Callable[[Any], Any]] = None,
                 builtins: Optional[Dict[str, Any]] = None, aliases: Optional[Dict[str, str]] = None) -> None:
        """``aliases``: other names of registered names, looked up as those and never listed."""
        self.group = group
        self.references = references
        self._unknown = unknown
        self._from_entry_point = from_entry_point
        self._entries: Dict[str, Any] = dict(builtins or {})
        self.aliases: Dict[str, str] = dict(aliases or {})
        _REGISTRIES[group] = self

    def register(self, name: str, obj: Any = None) -> Any:
        """Make ``obj`` available as ``name`` (a later registration replaces an earlier one).
        Without ``obj``, a decorator registering what it decorates."""
        if obj is None:
            def decorate(target: Any) -> Any:
                self._entries[name] = target
                return target

            return decorate
        self._entries[name] = obj
        return obj

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self.aliases

    # a registry reads as the mapping of its registered names (``dict(registry)``, ``registry[name]``)
    def __getitem__(self, name: str) -> Any:
        return self._entries[self.aliases.get(name, name)]

    def __setitem__(self, name: str, obj: Any) -> None:
        self._entries[name] = obj

    def __iter__(self) -> Any:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> List[str]:
        return list(self._entries)

    def names(self) -> List[str]:
        """Registered names and the names installed packages declare (nothing is imported)."""
        return sorted(set(self._entries) | set(entry_point_names(self.group)))

    def unknown(self, name: str) -> str:
        """The message for a name that is not known."""
        return self._unknown.format(name=repr(name), known=', '.join(self.names()))

    def get(self, name: str, base_dir: Optional[str] = None) -> Any:
        """The object ``name`` stands for (see the class docstring). ``KeyError`` with
        :meth:`unknown` when nothing matches; ``ImportError`` when the entry point or the
        reference does not import."""
        name = self.aliases.get(name, name)
        is_reference = self.references and ':' in name
        if name not in self._entries and not is_reference:
            self.load_entry_point(name)
        if name in self._entries:
            return self._entries[name]
        if is_reference:
            return resolve_reference(name, base_dir)
        raise KeyError(self.unknown(name))

    def load_entry_point(self, name: str) -> bool:
        """Import entry point ``name`` of this group and register what it names (unless the name
        is registered already); ``False`` when no installed package declares it. An entry point
        that fails to import raises ``ImportError`` naming the entry point and its package."""
        for ep in _entry_points(self.group):
            if ep.name != name:
                continue
            dist = getattr(getattr(ep, 'dist', None), 'name', None) or '?'
            try:
                obj = ep.load()
            except Exception as exc:
                raise ImportError(f'entry point {self.group}:{name} = {ep.value!r} (package {dist}) failed to load: '
                                  f'{type(exc).__name__}: {exc}') from None
            if ':' in ep.value and name not in self._entries:  # a bare module registered itself while importing
                self._entries[name] = self._from_entry_point(obj) if self._from_entry_point else obj
            _LOADED[(self.group, name)] = f'{ep.value} ({dist})'
            return True
        return False

    def loaded_entry_points(self) -> Dict[str, str]:
        """``name -> 'value (distribution)'`` of this group's entry points loaded so far."""
        return {name: value for (group, name), value in _LOADED.items() if group == self.group}


def registry_for(group: str) -> Registry:
    """The registry of an entry-point group (``ValueError`` naming the known groups)."""
    try:
        return _REGISTRIES[group]
    except KeyError:
        raise ValueError(f'unknown entry-point group {group!r} (known: {", ".join(sorted(_REGISTRIES))})') from None


def load_entry_point(group: str, name: str) -> bool:
    """:meth:`Registry.load_entry_point` of the registry of ``group``."""
    return registry_for(group).load_entry_point(name)
