"""One factory per ``EnvConfig``, whatever its kind: ``impl`` (a registered name or ``module:Class``
in mtflow's own protocol), ``gym``, ``openenv``, ``textarena``, ``skyrl_gym``, ``gem``, ``nemo_gym``
or ``verifiers``."""
from __future__ import annotations

from typing import Any, Callable, Optional

from mtflow.declarative.envs.config import env_kind
from mtflow.declarative.envs.gem_env import gem_factory
from mtflow.declarative.envs.gymnasium_env import gym_factory
from mtflow.declarative.envs.nemo_gym_env import NemoGymPool
from mtflow.declarative.envs.openenv_env import OpenEnvPool
from mtflow.declarative.envs.skyrl_gym_env import skyrl_gym_factory
from mtflow.declarative.envs.textarena_env import textarena_factory
from mtflow.declarative.envs.verifiers_env import VerifiersPool
from mtflow.declarative.gym import make_env_factory as make_impl_factory

__all__ = ['make_env_factory']


def make_env_factory(env: Any, base_dir: Optional[str] = None) -> Callable[[], Any]:
    """A zero-argument callable making a fresh environment per request, from an ``EnvConfig``.
    Cheap: it checks what can be checked without starting anything (no server is launched, no
    connection opened). A factory may have ``close()`` (the scheduler calls it when it closes)."""
    kind = env_kind(env)
    if kind == 'impl':
        return make_impl_factory(env.impl, env.kwargs, base_dir)
    if kind == 'gym':
        return gym_factory(env.gym, env.kwargs, base_dir)
    if kind == 'openenv':
        return OpenEnvPool(env.openenv, base_dir)
    if kind == 'skyrl_gym':
        return skyrl_gym_factory(env.skyrl_gym, base_dir)
    if kind == 'gem':
        return gem_factory(env.gem)
    if kind == 'nemo_gym':
        return NemoGymPool(env.nemo_gym, base_dir)
    if kind == 'verifiers':
        return VerifiersPool(env.verifiers)
    return textarena_factory(env.textarena)
