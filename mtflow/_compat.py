"""Old import paths, kept for one release: ``import mtflow.executor`` still works and warns.

The redesign moved the top-level modules into layer packages (``mtflow.core``,
``mtflow.accounting``, ``mtflow.engine``, ``mtflow.run``). Users imported some of the old paths
(``mtflow.executor``, ``mtflow.machine``, ``mtflow.run_config``, ...), so a meta path finder maps
each old name to its new module, with a ``DeprecationWarning`` naming the new path. One table
here instead of a shim file per old module keeps the package's folder list the architecture.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Dict, Optional, Sequence

__all__ = ['MOVED', 'install']

#: old module path -> new module path (removed in mtflow 0.3)
MOVED: Dict[str, str] = {
    'mtflow.errors': 'mtflow.core.errors',
    'mtflow.protocol': 'mtflow.core.protocol',
    'mtflow.machine': 'mtflow.core.machine',
    'mtflow.records': 'mtflow.core.records',
    'mtflow.stop': 'mtflow.core.stop',
    'mtflow.trace': 'mtflow.core.trace',
    'mtflow.calls': 'mtflow.core.calls',
    'mtflow.validate': 'mtflow.core.validate',
    'mtflow.types': 'mtflow.core.types',
    'mtflow.scheduler': 'mtflow.core.scheduler',
    'mtflow.safe_yaml': 'mtflow.core.safe_yaml',
    'mtflow.segments': 'mtflow.accounting.segments',
    'mtflow.id_accounting': 'mtflow.accounting.swift46',
    'mtflow.token_record': 'mtflow.accounting.token_record',
    'mtflow.integrations.swift_accounting': 'mtflow.accounting.swift46',
    'mtflow.executor': 'mtflow.engine.executor',
    'mtflow.async_driver': 'mtflow.engine.async_driver',
    'mtflow.run_config': 'mtflow.run.config',
    'mtflow.run_store': 'mtflow.run.store',
    'mtflow.run_driver': 'mtflow.run.driver',
    'mtflow.run_signals': 'mtflow.run.signals',
    'mtflow.run_fingerprint': 'mtflow.run.fingerprint',
    'mtflow.run_tally': 'mtflow.run.tally',
    'mtflow.trajectories': 'mtflow.run.trajectories',
    'mtflow.commands.reward_spread': 'mtflow.run.reward_spread',
    'mtflow.commands.preflight': 'mtflow.run.preflight',
}


def _caller_stacklevel() -> int:
    """The stack level of the first frame outside the import machinery and this file, so that the
    warning points at the user's ``import`` line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith('<frozen importlib')
                                 or frame.f_code.co_filename == __file__):
        frame, level = frame.f_back, level + 1
    return level


class _MovedLoader(importlib.abc.Loader):
    """Answers an old path with the new module itself (one module object, so ``isinstance`` and
    monkeypatching see the same classes and globals through either name)."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self._spec = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f'{self.old} moved to {self.new}; the old path will be removed in mtflow 0.3',
                      DeprecationWarning, stacklevel=_caller_stacklevel())
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set __spec__ to the alias's spec; the module keeps its own
        module.__spec__ = self._spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedLoader(fullname, new))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
