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

__all__ = ['torch_gather', 'accelerate_gather', 'GatherError', 'ray_run', 'RayRunResult']

_LAZY = {
    'torch_gather': ('.gather', 'torch_gather'),
    'accelerate_gather': ('.gather', 'accelerate_gather'),
    'GatherError': ('.gather', 'GatherError'),
    'ray_run': ('.ray_fanout', 'ray_run'),
    'RayRunResult': ('.ray_fanout', 'RayRunResult'),
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
