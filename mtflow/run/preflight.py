"""Everything a run config needs checked before anything runs (``mtflow validate`` and the start
of ``mtflow run``, before the slow backend load): the scheduler, the dataset, the Python code
they import.

- a scheduler YAML: every problem of the file (:func:`mtflow.declarative.inspect_file`), its
  ``plugins:`` imported first;
- a Python scheduler (``module:Class`` or ``file.py:Class``): it must import, without raising, and
  be a scheduler (a subclass of :class:`mtflow.Scheduler` or of ms-swift's ``MultiTurnScheduler``,
  a class defining ``step``/``check_finished``/``on_turn_end``, or a factory function);
- the dataset: it must read (every line valid JSON with messages; a generated dataset's spec).

Each problem is one ``file[:line]: field: message`` line; ``imports`` lists every Python module or
callable the run will import (that code runs with your rights: read the list)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Tuple


@dataclass
class Preflight:
    problems: List[str] = field(default_factory=list)
    imports: List[Tuple[str, str]] = field(default_factory=list)


#: the hooks a duck-typed scheduler class defines (at least one; see mtflow/core/scheduler.py)
HOOKS = ('step', 'check_finished', 'on_turn_end')


def is_scheduler_class(obj: Any) -> bool:
    """An mtflow scheduler class, one that derives from ms-swift's scheduler classes (checked by
    name, without importing ms-swift), or a duck-typed class defining a scheduler hook."""
    from mtflow.core.scheduler import Scheduler
    if not isinstance(obj, type):
        return False
    if issubclass(obj, Scheduler):
        return True
    if any(c.__name__ in ('MultiTurnScheduler', 'RolloutScheduler') and c.__module__.startswith('swift')
           for c in obj.__mro__):
        return True
    return any(callable(getattr(obj, hook, None)) for hook in HOOKS)


def check_python_scheduler(ref: str, base_dir: Any, where: str) -> List[str]:
    """Problems of a ``module:Class`` scheduler: import, exceptions while importing, kind."""
    from mtflow.cli import CLIError
    from mtflow.commands.run import _import_ref
    try:
        obj = _import_ref(ref, base_dir)
    except CLIError as exc:
        return [f'{where}: scheduler: {exc}']
    except Exception as exc:  # the module raised while importing
        return [f'{where}: scheduler: importing {ref!r} failed: {type(exc).__name__}: {exc}']
    if isinstance(obj, type):
        if not is_scheduler_class(obj):
            return [f'{where}: scheduler: {ref} is not a scheduler (class {obj.__module__}.{obj.__qualname__} '
                    'derives from neither mtflow.Scheduler nor ms-swift MultiTurnScheduler, and defines none of '
                    f'{", ".join(HOOKS)})']
    elif not (inspect.isfunction(obj) or inspect.ismethod(obj)):
        return [f'{where}: scheduler: {ref} is not a scheduler class or factory function (got {type(obj).__name__})']
    return []


def check_run_config(cfg: Any, check_dataset: bool = True) -> Preflight:
    """Check a loaded :class:`mtflow.run.config.RunConfig` (the file already parsed)."""
    from mtflow.data import DatasetError
    from mtflow.data.sources import count_requests

    where = cfg.source or '<run config>'
    out = Preflight()
    if cfg.scheduler_is_yaml():
        path = cfg.scheduler_path()
        if not Path(path).is_file():
            out.problems.append(f'{where}: scheduler: no such scheduler file: {cfg.scheduler}')
        else:
            from mtflow.declarative import inspect_file
            report = inspect_file(str(path))
            out.problems += [str(p) for p in report.problems]
            out.imports += [(f'{path}: {f}', ref) for f, ref in report.imports]
    else:
        out.problems += check_python_scheduler(cfg.scheduler, cfg.base_dir, where)
        out.imports.append((f'{where}: scheduler', cfg.scheduler))
    if check_dataset:
        try:
            count_requests(cfg.dataset, cfg.dataset_path(), cfg.limit, cfg.num_generations)
        except DatasetError as exc:
            out.problems.append(f'{where}: dataset: {exc}')
    return out
