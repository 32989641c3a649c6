"""Everything a run config needs checked before anything runs (``mtflow validate`` and the start
of ``mtflow run``, before the slow backend load): the scheduler, the dataset, the Python code
they import.

- a scheduler YAML: every problem of the file (:func:`mtflow.declarative.inspect_file`), its
  ``plugins:`` imported first;
- a Python scheduler (``module:Class`` or ``file.py:Class``): it must import, without raising, and
  be a scheduler (a subclass of :class:`mtflow.Scheduler` or of ms-swift's ``MultiTurnScheduler``,
  a class defining ``step``/``check_finished``/``on_turn_end``, or a factory function);
  and each hook it defines must take the arguments the executor passes (``inspect.signature``);
- the hooks a scheduler YAML names (``reward``, ``turn_reward``, predicates, ``answer.compare``)
  take the arguments mtflow passes (the schema checks them, :mod:`mtflow.core.signatures`);
- the dataset: it must read (every line valid JSON with messages; a generated dataset's spec),
  and a YAML scheduler's ``answer.field`` must be a key of its first lines' ``data_dict``;
- ``backend_options``: every key one the backend takes; the backend's own cheap checks
  (:meth:`mtflow.backends.Backend.preflight`: an OpenAI server answers ``GET /models`` and lists
  the model), so a wrong ``base_url`` fails before the run directory is written;
- an OpenEnv environment of a YAML scheduler: ``batch_size`` must fit the sessions its servers
  allow (``max_sessions`` per server; a request holds its session for its whole life), and, at the
  start of ``mtflow run`` only, each ``url`` server must open a session (:func:`check_env_servers`)
  and its ``/schema`` must have the ``action_field``, ``observation_field`` and ``image_fields``
  the scheduler names;
- ``backend_options.chat_template``: a file that is there, Jinja text or a bundled name; and, for
  ``mtflow validate`` only, the chat template's probe and the context, with the tokenizer and
  ``config.json`` read from disk (:mod:`mtflow.run.chat_check`; ``mtflow run`` checks the loaded
  backend's, before the first turn).

Each problem is one ``file[:line]: field: message`` line; ``imports`` lists every Python module or
callable the run will import (that code runs with your rights: read the list)."""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Tuple

from mtflow.backends import BackendError, backend_options, is_backend_reference, resolve_backend
from mtflow.backends.base import PreflightProblem
from mtflow.backends.chat_templates import resolve_chat_template
from mtflow.backends.option_types import option_annotations, option_type_problem
from mtflow.core.errors import MtflowError, RunSetupError
from mtflow.core.keys import closest_key, unknown_key_message
from mtflow.core.safe_yaml import YamlLoadError, load_yaml_file
from mtflow.core.scheduler import HOOK_ARGS, Scheduler, is_default_hook, scheduler_keywords
from mtflow.core.signatures import method_call_problem
from mtflow.data import DatasetError
from mtflow.data.sources import count_requests, first_requests
from mtflow.declarative import inspect_file
from mtflow.declarative.loader import read_yaml
from mtflow.declarative.schema import AnswerConfig
from mtflow.declarative.envs.config import OpenEnvConfig
from mtflow.declarative.envs.openenv_env import OpenEnvPool
from mtflow.run.assembly import load_python_scheduler, scheduler_factory
from mtflow.run.chat_check import check_offline
from mtflow.run.config import RunConfig
from mtflow.roles.config import episode_imports
from mtflow.run.episodes import episode_file, episode_problems

__all__ = ['Preflight', 'HOOKS', 'is_scheduler_class', 'check_python_scheduler', 'check_run_config',
           'check_before_load', 'check_env_servers', 'check_backend_reference', 'check_backend_options',
           'check_backend_servers', 'check_answer_field', 'sampling_warnings', 'hook_problems', 'scheduler_arg_names',
           'check_scheduler_args', 'check_template_option']


@dataclass
class Preflight:
    """The problems of a run config (one line each), the Python code it makes mtflow import, and
    warnings: what does not stop ``mtflow validate`` (a server that does not answer now, which
    ``mtflow run`` checks again and stops on) or a run (greedy copies of a prompt)."""
    problems: List[str] = field(default_factory=list)
    imports: List[Tuple[str, str]] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    #: what was checked beyond the files (the chat template, the context), for ``mtflow validate``
    notes: List[str] = field(default_factory=list)


#: the hooks a duck-typed scheduler class defines (at least one; see mtflow/core/scheduler.py)
HOOKS = ('step', 'check_finished', 'on_turn_end')


def is_scheduler_class(obj: Any) -> bool:
    """An mtflow scheduler class, one that derives from ms-swift's scheduler classes (checked by
    name, without importing ms-swift), or a duck-typed class defining a scheduler hook."""
    if not isinstance(obj, type):
        return False
    if issubclass(obj, Scheduler):
        return True
    if any(c.__name__ in ('MultiTurnScheduler', 'RolloutScheduler') and c.__module__.startswith('swift')
           for c in obj.__mro__):
        return True
    return any(callable(getattr(obj, hook, None)) for hook in HOOKS)


def check_python_scheduler(ref: str, base_dir: Optional[Path], where: str) -> List[str]:
    """Problems of a ``module:Class`` scheduler: import, exceptions while importing, kind."""
    try:
        obj = load_python_scheduler(ref, base_dir)
    except RunSetupError as exc:
        return [f'{where}: scheduler: {exc}']
    except Exception as exc:  # the module raised while importing
        return [f'{where}: scheduler: importing {ref!r} failed: {type(exc).__name__}: {exc}']
    if isinstance(obj, type):
        if not is_scheduler_class(obj):
            return [f'{where}: scheduler: {ref} is not a scheduler (class {obj.__module__}.{obj.__qualname__} '
                    'derives from neither mtflow.Scheduler nor ms-swift MultiTurnScheduler, and defines none of '
                    f'{", ".join(HOOKS)})']
        return [f'{where}: scheduler: {ref}: {problem}' for problem in hook_problems(obj)]
    elif not (inspect.isfunction(obj) or inspect.ismethod(obj)):
        return [f'{where}: scheduler: {ref} is not a scheduler class or factory function (got {type(obj).__name__})']
    return []


def hook_problems(cls: type) -> List[str]:
    """The hooks of a scheduler class that cannot be called as the executor calls them
    (:data:`mtflow.core.scheduler.HOOK_ARGS`, checked by ``inspect.signature``); the base
    classes' own hooks are not checked."""
    out = []
    for name, args in HOOK_ARGS.items():
        fn = getattr(cls, name, None)
        if fn is None or is_default_hook(fn, name):
            continue
        problem = method_call_problem(cls, name, args)
        if problem:
            out.append(problem)
    return out


def scheduler_arg_names(obj: Any) -> Optional[List[str]]:
    """The keyword arguments a scheduler class or factory takes, or ``None`` when it takes any
    (``**kwargs`` of its own, not only the catch-all of :class:`mtflow.Scheduler` or ms-swift's
    base: mtflow's refuses what it does not know, :data:`~mtflow.core.scheduler.SWIFT_KEYWORDS`
    aside, and ms-swift's would swallow a typo)."""
    def is_base(cls: type) -> bool:
        return cls is Scheduler or (cls.__module__.startswith('swift') and
                                    cls.__name__ in ('MultiTurnScheduler', 'RolloutScheduler'))

    if not isinstance(obj, type):
        try:
            params = list(inspect.signature(obj).parameters.values())
        except (TypeError, ValueError):
            return None
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return None
        return [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                     inspect.Parameter.KEYWORD_ONLY)]
    for cls in obj.__mro__:
        init = cls.__dict__.get('__init__')
        if init is None or cls is object or is_base(cls):
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            return None
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return None
    return scheduler_keywords(obj)


def check_scheduler_args(obj: Any, cfg: RunConfig) -> List[str]:
    """A ``scheduler_args`` key the scheduler does not take (a typo: ``max_turn``), with the
    keys it takes and the closest one."""
    known = scheduler_arg_names(obj)
    if known is None:
        return []
    return [f'{cfg.where(f"scheduler_args.{key}")}: {unknown_key_message(str(key), known, cfg.scheduler)}'
            for key in cfg.scheduler_args if key not in known]


def check_run_config(cfg: RunConfig, check_dataset: bool = True, servers_must_answer: bool = False,
                     with_backend: bool = True) -> Preflight:
    """Check a loaded :class:`mtflow.run.config.RunConfig` (the file already parsed).
    ``servers_must_answer``: a backend server that does not answer is a problem (the start of
    ``mtflow run``), not a warning (``mtflow validate``: it may be started later);
    ``with_backend=False``: the config's backend is not built (``mtflow replay``), so its
    options and servers are not checked."""
    where = cfg.source or '<run config>'
    out = Preflight()
    out.problems += episode_problems(cfg) if episode_file(cfg) is not None or cfg.policies or cfg.roles else []
    if cfg.scheduler_is_yaml():
        path = cfg.scheduler_path()
        if not Path(path).is_file():
            out.problems.append(f'{where}: scheduler: no such scheduler file: {cfg.scheduler}')
        elif episode_file(cfg) is not None:  # its problems: episode_problems, above
            out.imports += [(f'{path}: {f}', ref) for f, ref in episode_imports(path)]
        else:
            report = inspect_file(str(path))
            out.problems += [str(p) for p in report.problems]
            out.imports += [(f'{path}: {f}', ref) for f, ref in report.imports]
            out.problems += _session_problems(cfg, path)
        if cfg.scheduler_args:
            out.problems.append(f'{cfg.where("scheduler_args")}: scheduler_args applies to a Python scheduler '
                                f"('module:Class'); {cfg.scheduler} is a YAML scheduler: set its keys in that file")
    elif cfg.scheduler is not None:  # none: a gateway's config, or an agent: run's (no scheduler of mtflow's)
        at = cfg.where('scheduler').rsplit(': scheduler', 1)[0]
        found = check_python_scheduler(cfg.scheduler, cfg.base_dir, at)
        out.problems += found
        out.imports.append((f'{where}: scheduler', cfg.scheduler))
        if not found:
            out.problems += check_scheduler_args(load_python_scheduler(cfg.scheduler, cfg.base_dir), cfg)
    out.problems += check_backend_reference(cfg)
    options_problems = check_backend_options(cfg) if with_backend else []
    out.problems += options_problems
    if with_backend and not options_problems:
        for problem in check_backend_servers(cfg):
            if problem.unreachable and not servers_must_answer:
                out.warnings.append(f'{problem.message} (mtflow run stops on it)')
            else:
                out.problems.append(problem.message)
    out.warnings += sampling_warnings(cfg)
    out.problems += check_template_option(cfg) if with_backend else []
    if check_dataset:
        try:
            count_requests(cfg.dataset, cfg.dataset_path(), cfg.limit, cfg.num_generations)
        except DatasetError as exc:
            out.problems.append(f'{where}: dataset: {exc}')
            return out
    out.problems += check_answer_field(cfg)
    if check_dataset and with_backend and not out.problems:  # mtflow validate: the checks of the run's first turn
        found, out.notes = check_offline(cfg, scheduler_factory(cfg) if cfg.scheduler_is_yaml() else None)
        out.problems += found
    return out


def check_template_option(cfg: RunConfig) -> List[str]:
    """``backend_options.chat_template``: a file that is there, a bundled name or Jinja text
    (a path given where text is expected would render every prompt as the path)."""
    value = cfg.resolved_backend_options().get('chat_template')
    if value is None:
        return []
    try:
        resolve_chat_template(value, where=cfg.where('backend_options.chat_template'))
    except BackendError as exc:
        return [str(exc)]
    return []


def sampling_warnings(cfg: RunConfig) -> List[str]:
    """Valid settings that silently waste a run: ``num_generations`` copies of a prompt sampled
    greedily (``temperature: 0``, or ``top_k: 1``) are identical, so every GRPO group's rewards
    are equal and its advantage is zero: no signal."""
    n = cfg.num_generations
    sampling = cfg.request_config
    greedy = 'temperature 0' if sampling.get('temperature') == 0 else 'top_k 1' if sampling.get('top_k') == 1 else None
    if n <= 1 or greedy is None:
        return []
    key = 'request_config.temperature' if greedy.startswith('temperature') else 'request_config.top_k'
    return [f'{cfg.where(key)}: num_generations {n} at {greedy} (greedy decoding) makes the {n} copies of each '
            'prompt identical: every group has the same reward, zero GRPO signal; sample (temperature > 0) or '
            'set num_generations: 1']


#: how many of the dataset's first prompts ``answer.field`` is checked against
ANSWER_LINES = 8


def check_answer_field(cfg: RunConfig) -> List[str]:
    """``answer.field`` of a YAML scheduler against the dataset's first prompts: a key that is
    not in a line's ``data_dict`` would fail that request with a ``KeyError`` once the model has
    answered (``solution`` where the dataset says ``answer``). Names the scheduler's line, the
    dataset's line, the keys that line has and the closest one."""
    if not cfg.scheduler_is_yaml() or not cfg.scheduler_path().is_file():
        return []
    path = str(cfg.scheduler_path())
    data, lines, _, fatal = read_yaml(path)
    answer = data.get('answer') if isinstance(data, dict) and not fatal else None
    if not isinstance(answer, dict):
        return []
    field_name = answer.get('field', AnswerConfig.model_fields['field'].default)
    if not isinstance(field_name, str):
        return []  # the scheduler's own check reports the type
    line = lines.get(('answer', 'field')) or lines.get(('answer', ))
    at = f'{path}:{line}' if line else path
    try:
        sample = first_requests(cfg.dataset, cfg.dataset_path(), ANSWER_LINES)
    except DatasetError:
        return []  # reported as the dataset's own problem
    for origin, request in sample:
        keys = sorted(str(k) for k in (request.data_dict or {}))
        if field_name in keys:
            continue
        close = closest_key(field_name, keys)
        has = f'its keys: {", ".join(keys)}' if keys else 'it has no data_dict keys'
        default = f' (answer.field defaults to {field_name!r})' if 'field' not in answer else ''
        return [f'{at}: answer.field: {field_name!r} is not a key of {origin}{default}: {has}'
                + (f"; did you mean {close!r}?" if close else '')]
    return []


def check_backend_reference(cfg: RunConfig) -> List[str]:
    """A ``backend: module:Class`` that does not import, or names something that cannot build a
    backend (a registered name is checked when it loads: its engine may be a heavy import)."""
    if not is_backend_reference(cfg.backend):
        return []
    try:
        resolve_backend(cfg.backend, cfg.base_dir)
    except BackendError as exc:
        return [f'{cfg.where("backend")}: {exc}']
    except Exception as exc:  # the user's module raised while importing
        return [f'{cfg.where("backend")}: importing {cfg.backend!r} failed: {type(exc).__name__}: {exc}']
    return []


def check_backend_options(cfg: RunConfig) -> List[str]:
    """A ``backend_options`` key the backend does not take (``max_batchsize``), with the backend's
    options and the closest one, and a value not of the type its constructor declares
    (``cycle: maybe`` for a bool: :mod:`mtflow.backends.option_types`), each named at its file and
    line (or its ``-o``/``--set`` flag), before the backend loads. A backend that takes any option
    (``**kwargs``) has only its named ones checked; one that cannot be resolved is reported by
    :func:`check_backend_reference`."""
    if not cfg.backend_options:
        return []
    try:
        named, accepts_any = backend_options(cfg.backend, cfg.base_dir)
        types = option_annotations(resolve_backend(cfg.backend, cfg.base_dir))
    except Exception:  # an unknown or broken backend: reported where it is resolved
        return []
    problems = []
    for key, value in cfg.backend_options.items():
        where = cfg.where(f'backend_options.{key}')
        if key not in named and not accepts_any:
            problems.append(f'{where}: {unknown_key_message(str(key), named, f"backend {cfg.backend}")}')
        elif key in types:
            wrong = option_type_problem(*types[key], value)
            if wrong:
                problems.append(f'{where}: backend {cfg.backend} expects {wrong}')
    return problems


def check_backend_servers(cfg: RunConfig) -> List[PreflightProblem]:
    """The backend's own cheap checks before it is built (:meth:`mtflow.backends.Backend.preflight`):
    for ``openai``, each server answers ``GET /models`` and lists the model. Named at the config's
    ``base_url``/``urls`` line (else ``backend``)."""
    try:
        cls = resolve_backend(cfg.backend, cfg.base_dir)
    except Exception:  # reported by check_backend_reference, or when the backend is built
        return []
    check = getattr(cls, 'preflight', None)
    if not callable(check):
        return []
    options = cfg.resolved_backend_options()
    key = next((f'backend_options.{k}' for k in ('urls', 'base_url') if k in options), 'backend')
    return [dataclasses.replace(p, message=f'{cfg.where(p.key or key)}: {cfg.backend} backend: {p.message}')
            for p in check(cfg.resolved_model(), options)]


def _openenv_of(path: Path) -> Optional[OpenEnvConfig]:
    """The ``env.openenv`` section of a valid scheduler file, else ``None``."""
    try:
        data = load_yaml_file(str(path))[0]
    except (YamlLoadError, OSError):
        return None
    env = data.get('env') if isinstance(data, dict) else None
    section = env.get('openenv') if isinstance(env, dict) else None
    if not isinstance(section, dict):
        return None
    try:
        return OpenEnvConfig.model_validate(section)
    except ValueError:  # the scheduler's own problems report it
        return None


def _session_problems(cfg: RunConfig, path: Path) -> List[str]:
    """``batch_size`` larger than the OpenEnv sessions the scheduler may open: the requests past
    the limit would wait ``capacity_wait_s`` and fail, after the model generated their turn 1."""
    openenv = _openenv_of(path) if path.is_file() else None
    if openenv is None or openenv.max_sessions is None:
        return []
    servers = openenv.replicas if openenv.launch is not None else (
        1 if isinstance(openenv.url, str) else len(openenv.url or []))
    sessions = openenv.max_sessions * servers
    if cfg.batch_size <= sessions:
        return []
    return [f'{cfg.where("batch_size")}: {cfg.batch_size} requests per batch need {cfg.batch_size} OpenEnv sessions, '
            f'but {cfg.scheduler} allows {sessions} (env.openenv.max_sessions {openenv.max_sessions} x {servers} '
            f'server(s)); the others would wait capacity_wait_s and fail: lower batch_size to {sessions} or raise '
            'max_sessions']


def check_env_servers(cfg: RunConfig) -> None:
    """Open (and close) one session on each ``url`` OpenEnv server of a YAML scheduler, before the
    model loads: a server that cannot be reached fails the run now, in one line, instead of every
    request after its first generation. Launched servers are checked once they are up
    (:meth:`OpenEnvPool.preflight`, before the first generation)."""
    if not cfg.scheduler_is_yaml():
        return
    openenv = _openenv_of(cfg.scheduler_path())
    if openenv is None or openenv.url is None:
        return
    try:
        pool = OpenEnvPool(openenv)
    except ImportError:  # a missing extra: the scheduler's own check reports it
        return
    try:
        pool.preflight()
    except MtflowError as exc:
        raise RunSetupError(f'{cfg.scheduler}: env.openenv: {exc}') from None
    finally:
        pool.close()


def check_before_load(cfg: RunConfig, with_backend: bool = True) -> List[str]:
    """Raise one :class:`RunSetupError` listing every problem ``mtflow validate`` would report,
    the dataset aside (the caller has just read it): the start of ``mtflow run``, before the
    slow backend load. Returns the warnings (the run goes on; the caller prints them).
    ``with_backend=False``: see :func:`check_run_config`."""
    if cfg.scheduler_is_yaml() and not cfg.scheduler_path().is_file():
        return []  # scheduler_factory says so, in the message a missing file always gets
    found = check_run_config(cfg, check_dataset=False, servers_must_answer=True, with_backend=with_backend)
    if found.problems:
        raise RunSetupError('\n'.join(map(str, found.problems)))
    return found.warnings
