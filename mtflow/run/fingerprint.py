"""What a run rolls out, as a small dict: ``--resume`` refuses to continue a run with another one.

The fingerprint holds every config key that changes what a request's trajectory is (the
scheduler and its arguments, the backend, its model and options, ``max_turns``, ``seed``,
``limit``, the sampling parameters, ``num_generations``, a generated dataset's spec) and the
content hashes of the files behind them (the dataset, a scheduler file, a model file or the
small files of a model directory). It leaves out what only changes how the run goes: ``out``,
``batch_size``, progress and durability settings, so an interrupted run may be resumed with a
smaller batch after an out-of-memory error.

Its ``code`` holds the content hash of the code and files the config names (:func:`code_files`):
the file of every Python module a scheduler YAML names (reward, tools, environment, parser,
predicates, plugins, ...), of a ``module:Class`` backend, and every file a string of
``scheduler_args`` or ``backend_options`` names. A resume after one of them changed would mix two
versions of the code in one run; it is refused unless ``--accept-changed`` says to go on
(:data:`ACCEPTABLE`, recorded in ``run.json``).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from importlib import metadata
from typing import Any, Dict, List, Optional, Tuple, Union

from mtflow.core.registry import module_file
from mtflow.core.safe_yaml import YamlLoadError, load_yaml_file
from mtflow.declarative.loader import imports_of
from mtflow.run.config import RunConfig

__all__ = ['ACCEPTABLE', 'run_fingerprint', 'file_digest', 'code_files']

#: the fingerprint's parts a resume may go on past with ``--accept-changed``: the code and files
#: the config names, and the scheduler file; never the config's values, the dataset or the model
ACCEPTABLE = ('code', 'files.scheduler')

#: files up to this size are hashed; larger ones (model weights) are identified by name and size
HASH_LIMIT = 64 << 20
#: at most this many files of a model directory are listed
MAX_DIR_FILES = 200


def file_digest(path: Union[str, Path]) -> str:
    """``sha256:<hex>`` of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
            h.update(chunk)
    return f'sha256:{h.hexdigest()}'


def _file_identity(path: Path) -> str:
    size = path.stat().st_size
    return file_digest(path) if size <= HASH_LIMIT else f'{size} bytes'


def _dir_identity(path: Path) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            if len(out) >= MAX_DIR_FILES:
                return out
            p = Path(root) / name
            try:
                size = p.stat().st_size
                out[str(p.relative_to(path))] = file_digest(p) if size <= (1 << 20) else f'{size} bytes'
            except OSError:
                continue
    return out


def _scheduler_file(cfg: RunConfig) -> Optional[Path]:
    if cfg.scheduler is None:  # an agent: run or a gateway (docs/gateway.md)
        return None
    if cfg.scheduler_is_yaml():
        path = cfg.scheduler_path()
        return path if path.is_file() else None
    return _module_file(cfg.scheduler, cfg.base_dir)


def _module_file(ref: str, base_dir: Optional[Union[str, Path]]) -> Optional[Path]:
    """The source file of the module ``ref`` (``module:attr``) names, found as the run imports it
    (:func:`mtflow.core.registry.module_file`: an installed module first, then next to the YAML)."""
    try:
        file = module_file(ref.partition(':')[0].strip(), str(base_dir) if base_dir else None)
    except Exception:  # a name that is no module name at all
        return None
    return Path(file) if file else None


def _named_files(value: Any, field: str, cfg: RunConfig) -> List[Tuple[str, Path]]:
    """``(field, path)`` of every string under ``value`` that names an existing file (resolved as
    the config resolves paths: next to the config file, then in the current directory)."""
    if isinstance(value, dict):
        return [hit for k, v in value.items() for hit in _named_files(v, f'{field}.{k}', cfg)]
    if isinstance(value, list):
        return [hit for i, v in enumerate(value) for hit in _named_files(v, f'{field}[{i}]', cfg)]
    if not isinstance(value, str) or not value or '\n' in value or len(value) > 1024:
        return []
    try:
        path = cfg.resolve(value)
        return [(field, path)] if path.is_file() else []
    except OSError:  # a string that cannot be a path (too long a name)
        return []


def code_files(cfg: RunConfig) -> Dict[str, str]:
    """``{'reward (rewards.py)': 'sha256:...'}``: the content of the code and files the config
    names, by the field that names each: every module a scheduler YAML names
    (:func:`mtflow.declarative.loader.imports_of`: reward, turn_reward, tools, environment, parser,
    predicates, answer.compare, image hooks, branch hook, scheduler_class, plugins), a
    ``module:Class`` backend, and the files strings of ``scheduler_args`` and ``backend_options``
    name. Only those files: a module they import is not followed; a module that does not import
    is left out (the checks before the run refuse it)."""
    named: List[Tuple[str, Optional[Path]]] = []
    if cfg.scheduler_is_yaml():
        path = cfg.scheduler_path()
        try:
            data = load_yaml_file(str(path))[0] if path.is_file() else None
        except YamlLoadError:
            data = None
        named += [(field, _module_file(ref, path.parent)) for field, ref in imports_of(data)]
    if ':' in (cfg.backend or ''):
        named.append(('backend', _module_file(cfg.backend, cfg.base_dir)))
    named += _named_files(cfg.scheduler_args, 'scheduler_args', cfg)
    named += _named_files(cfg.backend_options, 'backend_options', cfg)
    # keyed by the field and the file's name, not its path: a resume from another directory is the same run
    return {f'{field} ({file.name})': _file_identity(file) for field, file in named if file is not None}


def run_fingerprint(cfg: RunConfig, dataset_path: Optional[Path] = None) -> Dict[str, Any]:
    """The fingerprint of a run config (overrides applied) and
    its dataset (``dataset_path``: the file actually read, the bundled one when the config has
    none)."""
    files: Dict[str, Any] = {}
    if dataset_path is not None:
        files['dataset'] = file_digest(dataset_path)
    sched = _scheduler_file(cfg)
    if sched is not None:
        files['scheduler'] = file_digest(sched)
    model = cfg.resolved_model()
    if model:
        mp = Path(model)
        if mp.is_file():
            files['model'] = _file_identity(mp)
        elif mp.is_dir():
            files['model'] = _dir_identity(mp)
    config: Dict[str, Any] = {
        'scheduler': cfg.scheduler,
        'scheduler_args': cfg.scheduler_args,
        'backend': cfg.backend,
        'model': cfg.model,
        'backend_options': cfg.backend_options,
        'max_turns': cfg.max_turns or None,
        'seed': cfg.seed,
        'limit': cfg.limit,
        'request_config': cfg.request_config,
    }
    # a generated dataset has no file: its spec (and the generator's version) says what it holds;
    # both keys only when set, so the fingerprint of a plain run stays what it was
    if isinstance(cfg.dataset, dict):
        config['dataset'] = cfg.dataset
        config['dataset_generator'] = _generator_version(cfg.dataset)
    if cfg.num_generations != 1:
        config['num_generations'] = cfg.num_generations
    if cfg.agent is not None:  # only when set: a plain run's fingerprint stays what it was
        config['agent'] = cfg.agent.model_dump(mode='json')
    if cfg.gateway is not None:
        config['gateway'] = cfg.gateway.model_dump(mode='json', exclude={'host', 'port'})
    return {'config': config, 'files': files, 'code': code_files(cfg)}


def _generator_version(dataset: Dict[str, Any]) -> Optional[str]:
    """``reasoning-gym <version>`` for a ``{reasoning_gym: ...}`` dataset: another version may
    generate other tasks from the same seed."""
    for kind, dist in (('reasoning_gym', 'reasoning-gym'), ):
        if kind in dataset:
            try:
                return f'{dist} {metadata.version(dist)}'
            except metadata.PackageNotFoundError:
                return None
    return None
