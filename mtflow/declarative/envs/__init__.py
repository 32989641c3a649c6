"""Environments from other libraries, adapted to the YAML scheduler's environment protocol
(``reset(infer_request) -> opening text or None``, ``step(action) -> StepOutcome-like``,
``close()``; each may be ``async``):

- :mod:`.gymnasium_env`: any Gymnasium-style object (``reset() -> (obs, info)``,
  ``step(a) -> (obs, reward, terminated, truncated, info)``);
- :mod:`.openenv_env`: an OpenEnv server through ``openenv-core``'s WebSocket client;
- :mod:`.textarena_env`: a single-player textarena game.

:func:`make_env_factory` turns an ``EnvConfig`` into a zero-argument callable making one
environment per request; :func:`normalize_step` reads what any ``step`` returned. The libraries
are imported only when an environment of their kind is built.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

from mtflow.declarative.envs.config import ENV_KINDS, OpenEnvConfig, TextArenaConfig, env_kind

__all__ = ['StepOutcome', 'normalize_step', 'make_env_factory', 'request_seed', 'ENV_KINDS', 'OpenEnvConfig',
           'TextArenaConfig', 'env_kind', 'MissingExtra']


class MissingExtra(ImportError):
    """An environment kind whose library is not installed; names the pip extra."""

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(f"{module!r} is not installed: pip install 'mtflow[{extra}]'")


def require(module: str, extra: str) -> Any:
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(module, extra) from None


@dataclass
class StepOutcome:
    """One environment step. ``terminated``: the episode reached an end state (its reward is
    final: ``stop_rule:env_done``); ``truncated``: it was cut short, e.g. by a step limit
    (``stop_rule:env_truncated``)."""
    observation: str
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: Dict[str, Any] = field(default_factory=dict)


def normalize_step(out: Any) -> StepOutcome:
    """A :class:`StepOutcome` from what ``step`` returned: a StepOutcome, mtflow's 4-tuple
    ``(observation, reward, done, info)`` (done counts as terminated) or Gymnasium's 5-tuple."""
    if isinstance(out, StepOutcome):
        return out
    if isinstance(out, tuple) and len(out) == 5:
        obs, reward, terminated, truncated, info = out
    elif isinstance(out, tuple) and len(out) == 4:
        obs, reward, terminated, info = out
        truncated = False
    else:
        raise TypeError('env.step must return (observation, reward, done, info), (observation, reward, terminated, '
                        f'truncated, info) or a StepOutcome, not {type(out).__name__}'
                        + (f' of length {len(out)}' if isinstance(out, tuple) else ''))
    return StepOutcome('' if obs is None else str(obs), float(reward or 0.0), bool(terminated), bool(truncated),
                       dict(info) if isinstance(info, dict) else {'info': info})


def request_seed(infer_request: Any, seed: int = 0) -> int:
    """``data_dict['seed']`` when given, else a stable 31-bit number from ``seed`` and the uuid (the
    same request gets the same episode on every run)."""
    data = getattr(infer_request, 'data_dict', None) or {}
    if isinstance(data.get('seed'), int):
        return data['seed']
    key = f'{seed}:{getattr(infer_request, "uuid", None) or ""}'
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def make_env_factory(env: Any, base_dir: Optional[str] = None) -> Callable[[], Any]:
    """A zero-argument callable making a fresh environment per request, from an ``EnvConfig``.
    Cheap: it checks what can be checked without starting anything (no server is launched, no
    connection opened). A factory may have ``close()`` (the scheduler calls it when it closes)."""
    kind = env_kind(env)
    if kind == 'impl':
        from mtflow.declarative.gym import make_env_factory as make_impl
        return make_impl(env.impl, env.kwargs, base_dir)
    if kind == 'gym':
        from mtflow.declarative.envs.gymnasium_env import gym_factory
        return gym_factory(env.gym, env.kwargs, base_dir)
    if kind == 'openenv':
        from mtflow.declarative.envs.openenv_env import OpenEnvPool
        return OpenEnvPool(env.openenv, base_dir)
    from mtflow.declarative.envs.textarena_env import textarena_factory
    return textarena_factory(env.textarena)
