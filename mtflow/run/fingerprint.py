"""What a run rolls out, as a small dict: ``--resume`` refuses to continue a run with another one.

The fingerprint holds every config key that changes what a request's trajectory is (the
scheduler and its arguments, the backend, its model and options, ``max_turns``, ``seed``,
``limit``, the sampling parameters, ``num_generations``, a generated dataset's spec) and the
content hashes of the files behind them (the dataset, a scheduler file, a model file or the
small files of a model directory). It leaves out what only changes how the run goes: ``out``,
``batch_size``, progress and durability settings, so an interrupted run may be resumed with a
smaller batch after an out-of-memory error.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from importlib import metadata
from typing import Any, Dict, Optional, Union

from mtflow.run.config import RunConfig

__all__ = ['run_fingerprint', 'file_digest']

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
    target = cfg.scheduler.rpartition(':')[0]
    if target.endswith('.py'):
        path = cfg.resolve(target)
        return path if path.is_file() else None
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, 'origin', None) if spec is not None else None
    return Path(origin) if origin and os.path.isfile(origin) else None


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
    return {'config': config, 'files': files}


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
