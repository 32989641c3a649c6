"""Running the executor on several processes: ``gather_fn`` for real process groups, and a Ray
fan-out of one run over many workers (``docs/distributed.md``).

- :func:`torch_gather` / :func:`accelerate_gather`: the ``gather_fn`` of each rank of a training
  job (torchrun, accelerate, ms-swift), so every rank calls ``rollout_fn`` the same number of times.
- :func:`ray_run`: one driver shards a dataset over Ray actors, each with its own executor and
  backend, and receives every finished trajectory as it finishes.

Nothing heavy is imported here: torch, accelerate and ray load when these functions are called.
"""
from __future__ import annotations

from typing import Any

__all__ = ['torch_gather', 'accelerate_gather', 'GatherError', 'destroy_process_group_at_exit', 'ray_run',
           'RayRunResult', 'RayRecord', 'RayRunError', 'WorkerSpec', 'ShardWorker']

_LAZY = {
    'torch_gather': ('.gather', 'torch_gather'),
    'accelerate_gather': ('.gather', 'accelerate_gather'),
    'GatherError': ('.gather', 'GatherError'),
    'destroy_process_group_at_exit': ('.teardown', 'destroy_process_group_at_exit'),
    'ray_run': ('.ray_fanout', 'ray_run'),
    'RayRunResult': ('.ray_fanout', 'RayRunResult'),
    'RayRecord': ('.ray_fanout', 'RayRecord'),
    'RayRunError': ('.ray_fanout', 'RayRunError'),
    'WorkerSpec': ('.ray_fanout', 'WorkerSpec'),
    'ShardWorker': ('.ray_fanout', 'ShardWorker'),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    import importlib

    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module, __name__), attr)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(list(globals()) + list(_LAZY))
