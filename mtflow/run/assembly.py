"""The pieces of one run, built from its :class:`~mtflow.run.config.RunConfig`: the backend, the
scheduler and the seeds (the progress bar lives in ``mtflow/run/progress.py``).

``mtflow run`` builds them in its own process; with ``--ray`` every actor builds its own backend
and scheduler from the same config (:func:`actor_setup`, :func:`backend_from_config`,
:func:`scheduler_from_config` travel to the actors by reference), so a local run and a fan-out
start the same way. Every problem is a :class:`~mtflow.core.errors.RunSetupError` with a
one-line message, raised before the slow model load where it can be.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import random
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from mtflow import backends
from mtflow.backends.base import reports_of
from mtflow.core.errors import RunSetupError, UserError
from mtflow.core.keys import unknown_key_message
from mtflow.core.registry import import_module
from mtflow.core.scheduler import UnknownSchedulerArgument
from mtflow.declarative import load_config, load_scheduler
from mtflow.roles.router import PolicyRouter
from mtflow.run.chat_check import prepare_loaded
from mtflow.run.config import RunConfig
from mtflow.run.episodes import build_policies, episode_file, make_episode_scheduler

__all__ = ['SchedulerFactory', 'seed_everything', 'build_backend', 'tokenizer_of', 'load_python_scheduler', 'scheduler_factory',
           'actor_setup', 'backend_from_config', 'scheduler_from_config', 'actor_prepare']

#: ``make(tokenizer) -> scheduler``: the scheduler is built once the backend (and its tokenizer) is
SchedulerFactory = Callable[[Any], Any]


def seed_everything(seed: Optional[int]) -> None:
    """Seed Python's RNG, and torch's when the backend imported torch (called once the backend is
    built: importing torch only to seed it would cost a scripted or server run ~200 MB and
    seconds)."""
    if seed is None:
        return
    random.seed(seed)
    torch = sys.modules.get('torch')
    if torch is not None and hasattr(torch, 'manual_seed'):
        torch.manual_seed(seed)


def build_backend(cfg: RunConfig) -> Any:
    """The config's backend, seeded with the run's seed when it takes one (``docs/cli.md``); for
    an episode file, every policy's backend behind one router (``mtflow/run/episodes.py``)."""
    if episode_file(cfg) is not None:
        return build_policies(cfg, _one_backend)
    return _one_backend(cfg)


def tokenizer_of(backend: Any) -> Any:
    """What a scheduler factory gets: the backend's tokenizer, or an episode run's per-policy ones."""
    tokenizers = backend.tokenizers if isinstance(backend, PolicyRouter) else None
    return tokenizers if tokenizers else reports_of(backend).tokenizer


def _one_backend(cfg: RunConfig) -> Any:
    options = cfg.resolved_backend_options()
    try:
        if cfg.seed is not None and 'seed' not in options and 'seed' in backends.backend_options(
                cfg.backend, cfg.base_dir)[0]:
            options['seed'] = cfg.seed
        return backends.make_backend(cfg.backend, model=cfg.resolved_model(), base_dir=cfg.base_dir, **options)
    except backends.BackendError as exc:
        blamed = _option_named(cfg, str(exc))
        raise RunSetupError(f'{blamed}: {exc}' if blamed else f'{cfg.where("backend")}: {exc}'
                            if backends.is_backend_reference(cfg.backend) else str(exc)) from None
    except ImportError as exc:  # an engine's package (ms-swift, vLLM, ...) is not installed
        missing = getattr(exc, 'name', None) or str(exc)
        raise RunSetupError(f'backend {cfg.backend!r} needs the package {missing!r}, which is not installed '
                            f'({type(exc).__name__}: {exc}); see docs/backends.md') from None
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        first_line = (str(exc).strip().splitlines() or [''])[0]
        blamed = _option_named(cfg, first_line)
        raise RunSetupError((f'{blamed}: ' if blamed else '')
                            + f'backend {cfg.backend!r} cannot start: {type(exc).__name__}: {first_line}') from None


def _option_named(cfg: RunConfig, message: str) -> Optional[str]:
    """Where the backend option a constructor's error names was given (``file:line: key``, or the
    ``-o``/``--set`` flag), so the user sees what to change; ``None`` when it names none of them."""
    named = [(m.start(), key) for key in cfg.backend_options
             if (m := re.search(rf'(?<![\w.]){re.escape(str(key))}(?![\w])', message)) is not None]
    if named:
        return cfg.where(f'backend_options.{min(named)[1]}')
    model = str(cfg.model) if cfg.model else ''  # a model (a scripted file, a path) the backend could not open
    return cfg.where('model') if model and re.search(rf'(?<![\w./-]){re.escape(model)}(?![\w])', message) else None


def _module_from_file(path: Path) -> Any:
    """Execute a scheduler's ``.py`` file as a module of its own (it need not be on ``sys.path``)."""
    spec = importlib.util.spec_from_file_location(f'_mtflow_user_{path.stem}', path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_python_scheduler(ref: str, base_dir: Optional[Path]) -> Any:
    """The class or factory named by ``'package.module:Name'`` (imported as
    :func:`mtflow.core.registry.import_module` imports every reference of a config) or by
    ``'path/to/file.py:Name'`` (a file next to the config, or in the current directory).
    An exception the module raises while it is imported propagates."""
    target, sep, name = ref.rpartition(':')
    if not sep or not target or not name:
        raise RunSetupError(f"scheduler {ref!r}: expected a YAML file or 'module:Class'")
    if target.endswith('.py'):
        path = Path(target)
        if not path.is_absolute() and base_dir is not None and (base_dir / path).is_file():
            path = base_dir / path
        if not path.is_file():
            raise RunSetupError(f'scheduler file not found: {target}')
        module = _module_from_file(path)
    else:
        try:
            module = import_module(target, str(base_dir) if base_dir is not None else None)
        except ImportError as exc:
            reason = str(exc).removeprefix(f'cannot import module {target!r}: ')  # the message names it already
            raise RunSetupError(f'scheduler {ref!r}: cannot import {target!r}: {reason}') from None
    obj = getattr(module, name, None)
    if obj is None:
        raise RunSetupError(f'scheduler {ref!r}: {target!r} has no {name!r}')
    return obj


def _yaml_scheduler_factory(cfg: RunConfig) -> SchedulerFactory:
    path = cfg.scheduler_path()
    if not path.is_file():
        raise RunSetupError(f'scheduler file not found: {cfg.scheduler}')

    def make_yaml(tokenizer: Any) -> Any:
        try:
            return load_scheduler(str(path), tokenizer=tokenizer)
        except UserError:
            raise
        except Exception as exc:  # the loader's errors already name file, line and field
            raise RunSetupError(' '.join(str(exc).split()) or f'{path}: {type(exc).__name__}') from None

    return make_yaml


def takes_tokenizer(factory: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return 'tokenizer' in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def scheduler_factory(cfg: RunConfig) -> SchedulerFactory:
    """Check the scheduler before the (slow) model loads; return ``make(tokenizer)``.

    A YAML file goes through :func:`mtflow.declarative.load_scheduler` (an episode file, with
    ``roles:``, through :func:`mtflow.run.episodes.make_episode_scheduler`); ``module:Class`` (or
    ``file.py:Class``) is called with ``scheduler_args`` and, when it accepts one, the backend's
    tokenizer."""
    if episode_file(cfg) is not None:
        return lambda tokenizer: make_episode_scheduler(cfg, tokenizer)
    if cfg.scheduler_is_yaml():
        return _yaml_scheduler_factory(cfg)
    factory = load_python_scheduler(cfg.scheduler, cfg.base_dir)
    if not callable(factory):
        raise RunSetupError(f'scheduler {cfg.scheduler!r} is not a class or factory')
    accepts_tokenizer = takes_tokenizer(factory)

    def make_python(tokenizer: Any) -> Any:
        kwargs = dict(cfg.scheduler_args)
        if accepts_tokenizer and 'tokenizer' not in kwargs and tokenizer is not None:
            kwargs['tokenizer'] = tokenizer
        try:
            return factory(**kwargs)
        except UnknownSchedulerArgument as exc:
            if exc.keyword not in cfg.scheduler_args:  # the scheduler's own code passed it
                raise RunSetupError(f'{cfg.where("scheduler")}: building {cfg.scheduler} raised {exc}') from None
            raise RunSetupError(f'{cfg.where(f"scheduler_args.{exc.keyword}")}: '  # named at its own key
                                f'{unknown_key_message(exc.keyword, exc.known, cfg.scheduler)}') from None
        except TypeError as exc:
            raise RunSetupError(f'{cfg.where("scheduler_args")}: bad scheduler_args for {cfg.scheduler}: {exc}') from None
        except Exception as exc:  # the scheduler's own __init__ raised: one line, naming where it came from
            raise RunSetupError(f'{cfg.where("scheduler")}: building {cfg.scheduler} raised '
                                f'{type(exc).__name__}: {exc}') from exc

    return make_python


def leaf_budget(cfg: RunConfig) -> Optional[int]:
    """The leaf budget of each prompt's tree (``branch.leaves``, ``docs/branching.md``) of a YAML
    scheduler, read from its file without building it (a Ray driver counts its leaves); ``None``
    without one, or for a Python scheduler whose class declares none."""
    if cfg.scheduler_is_yaml():
        try:
            config, _ = load_config(str(cfg.scheduler_path()))
        except Exception:  # checked before the model loads (check_before_load) with every problem named
            return None
        return config.branch.leaves if config.branch is not None else None
    branch = getattr(load_python_scheduler(cfg.scheduler, cfg.base_dir), 'branch', None)
    return getattr(branch, 'leaves', None)


# ---- what a Ray actor calls (mtflow/distributed/ray_cli.py ships these by reference) ----------------
def actor_setup(cwd: str, seed: Optional[int]) -> None:
    """First thing in each actor: the driver's directory (relative paths in the config resolve
    as they did on the driver) and the config's seed."""
    if os.path.isdir(cwd):
        os.chdir(cwd)
    seed_everything(seed)


def backend_from_config(cfg: RunConfig) -> Any:
    return build_backend(cfg)


def scheduler_from_config(cfg: RunConfig, tokenizer: Any) -> Any:
    """An actor's scheduler (``tokenizer``: :func:`tokenizer_of` its backend)."""
    return scheduler_factory(cfg)(tokenizer)


def actor_prepare(cfg: RunConfig, backend: Any, scheduler: Any) -> None:
    """In each actor, once its backend and scheduler are built, before its first turn: what a
    local run does there (special tokens kept, calls carried as the template takes them, the chat
    template and the context checked); a problem stops the run with its one line."""
    prepare_loaded(cfg, backend, scheduler)
