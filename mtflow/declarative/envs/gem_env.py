"""GEM's environments (``gem-llm``: games, reasoning-gym tasks, QA and math with their own
graders) as YAML environments, through GEM's own Gymnasium-style API: ``gem.make(id, **kwargs)``,
``reset(seed) -> (observation, info)``, ``step(action) -> (observation, reward, terminated,
truncated, info)``.

The request's seed (:func:`request_seed`) resets the episode, so a request replays the same game.
Each turn's message is the observation as GEM's own observation wrappers show it, with the info's
``prefix`` and ``suffix`` (a game's board and "Enter your guess.") around it; the conversation
itself holds the history. GEM's reward is each step's reward; ``terminated`` and ``truncated``
stay distinct. A failure of ``make``, ``reset`` or ``step`` fails that request with
:class:`EnvFailure`, naming the environment and the step.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from mtflow.core.keys import closest_key
from mtflow.declarative.envs.base import EnvFailure, StepOutcome, request_seed, require
from mtflow.declarative.envs.config import GemConfig

__all__ = ['GemEnv', 'gem_factory', 'gem_text']

KIND = 'GEM'


def gem_text(observation: Any, info: Dict[str, Any]) -> str:
    """One turn's text as GEM's observation wrappers join it: ``prefix``, the observation ended
    by a newline, ``suffix``."""
    text = '' if observation is None else str(observation)
    if text and not text.endswith('\n') and 'suffix' in info:
        text += '\n'
    return f"{info.get('prefix', '')}{text}{info.get('suffix', '')}"


class GemEnv:
    """One request's GEM environment (made at reset: GEM's games draw their board there)."""

    def __init__(self, config: GemConfig, gem: Any) -> None:
        self.config, self.gem = config, gem
        self.env: Any = None
        self.steps = 0

    def reset(self, infer_request: Any) -> Optional[str]:
        try:
            self.env = self.gem.make(self.config.id, **self.config.kwargs)
            observation, info = self.env.reset(seed=request_seed(infer_request))
        except Exception as exc:
            raise EnvFailure(KIND, self.config.id, 'at reset', exc) from exc
        return gem_text(observation, dict(info or {}))

    def step(self, action: str) -> StepOutcome:
        self.steps += 1
        try:
            observation, reward, terminated, truncated, info = self.env.step(action)
            reward = float(reward or 0.0)
        except Exception as exc:
            raise EnvFailure(KIND, self.config.id, f'at step {self.steps}', exc) from exc
        info = dict(info or {})
        return StepOutcome(gem_text(observation, info), reward, bool(terminated), bool(truncated), info)

    def close(self) -> None:
        env, self.env = self.env, None
        close = getattr(env, 'close', None)
        if callable(close):
            close()


def gem_factory(config: GemConfig) -> Callable[[], GemEnv]:
    """Check the id and kwargs now (one environment made and closed): a typo is a config error."""
    gem = require('gem', 'gem')
    known = list(getattr(getattr(gem.envs, 'registration', None), 'ENV_REGISTRY', None) or [])
    if known and config.id not in known:
        close = closest_key(config.id, known)
        raise ValueError(f'no GEM environment {config.id!r}' + (f'; did you mean {close!r}?' if close else
                                                                 f' ({len(known)} registered, e.g. {known[0]!r})'))
    probe = gem.make(config.id, **config.kwargs)
    close = getattr(probe, 'close', None)
    if callable(close):
        close()
    return lambda: GemEnv(config, gem)
