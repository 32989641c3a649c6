"""Environments from other libraries, adapted to the YAML scheduler's environment protocol
(``reset(infer_request) -> opening text or None``, ``step(action) -> StepOutcome-like``,
``close()``; each may be ``async``):

- :mod:`.gymnasium_env`: any Gymnasium-style object (``reset() -> (obs, info)``,
  ``step(a) -> (obs, reward, terminated, truncated, info)``);
- :mod:`.openenv_env`: an OpenEnv server through ``openenv``'s WebSocket client;
- :mod:`.textarena_env`: a single-player textarena game;
- :mod:`.skyrl_gym_env`: a SkyRL text environment (``skyrl-gym``), made per request from its row;
- :mod:`.gem_env`: a GEM environment (``gem-llm``);
- :mod:`.nemo_gym_env`: a NeMo Gym resources server (its tools and ``/verify``), over HTTP;
- :mod:`.verifiers_env`: a verifiers 0.4 environment in-process (its ``Env.run`` and rewards).

:func:`make_env_factory` turns an ``EnvConfig`` into a zero-argument callable making one
environment per request; :func:`normalize_step` reads what any ``step`` returned. The libraries
are imported only when an environment of their kind is built.
"""
from mtflow.declarative.envs.base import EnvFailure, MissingExtra, StepOutcome, normalize_step, request_seed, require
from mtflow.declarative.envs.config import (ENV_KINDS, GemConfig, NemoGymConfig, OpenEnvConfig, SkyRLGymConfig,
                                            TextArenaConfig, VerifiersConfig, env_kind)
from mtflow.declarative.envs.factory import make_env_factory

__all__ = ['StepOutcome', 'normalize_step', 'make_env_factory', 'request_seed', 'ENV_KINDS', 'OpenEnvConfig',
           'TextArenaConfig', 'SkyRLGymConfig', 'GemConfig', 'NemoGymConfig', 'VerifiersConfig', 'env_kind', 'MissingExtra',
           'require', 'EnvFailure']
