"""GEM's environments (``gem-llm``: games, reasoning-gym tasks, QA and math with their own
graders) as YAML environments, through GEM's own Gymnasium-style API: ``gem.make(id, **kwargs)``,
``reset(seed) -> (observation, info)``, ``step(action) -> (observation, reward, terminated,
truncated, info)``. The request's seed (:func:`request_seed`) resets the episode, so a request
replays the same game; GEM's reward is each step's reward. A failure of ``make``, ``reset`` or
``step`` fails that request with :class:`EnvFailure`, naming the environment and the step.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from mtflow.declarative.envs.base import EnvFailure, StepOutcome, require
from mtflow.declarative.envs.config import GemConfig
from mtflow.declarative.envs.gymnasium_env import GymnasiumEnv

__all__ = ['GemEnv', 'gem_factory']

KIND = 'GEM'


class GemEnv(GymnasiumEnv):
    """One request's GEM environment (made at reset: GEM's games draw their board there)."""

    def __init__(self, config: GemConfig, gem: Any) -> None:
        super().__init__(None)
        self.config, self.gem, self.steps = config, gem, 0

    def reset(self, infer_request: Any) -> Optional[str]:
        try:
            self.env = self.gem.make(self.config.id, **self.config.kwargs)
            return super().reset(infer_request)
        except Exception as exc:
            raise EnvFailure(KIND, self.config.id, 'at reset', exc) from exc

    def step(self, action: str) -> StepOutcome:
        self.steps += 1
        try:
            return super().step(action)
        except Exception as exc:
            raise EnvFailure(KIND, self.config.id, f'at step {self.steps}', exc) from exc


def gem_factory(config: GemConfig) -> Callable[[], GemEnv]:
    """Check the id and kwargs now (one environment made and closed): a typo is a config error."""
    gem = require('gem', 'gem')
    probe = gem.make(config.id, **config.kwargs)
    close = getattr(probe, 'close', None)
    if callable(close):
        close()
    return lambda: GemEnv(config, gem)
