"""Gymnasium-style text environments for the tests: a real ``gymnasium.Env`` (text spaces),
made with gymnasium's own ``TimeLimit`` wrapper, and a plain class with the same methods."""
from __future__ import annotations

from typing import Any, Optional

import gymnasium
from gymnasium import spaces
from gymnasium.wrappers import TimeLimit


class SayTheWordEnv(gymnasium.Env):
    """Terminates (reward 1.0) when the action contains the secret word; the secret is
    ``words[seed % len(words)]``, so a test knows it from the request's seed."""
    metadata = {'render_modes': []}

    def __init__(self, words=('apple', 'river', 'stone')) -> None:
        self.words = list(words)
        self.observation_space = spaces.Text(max_length=200)
        self.action_space = spaces.Text(max_length=200)
        self.secret: Optional[str] = None
        self.closed = 0

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        super().reset(seed=seed)
        self.secret = self.words[(seed or 0) % len(self.words)]
        hint = (options or {}).get('hint', '')
        return f'Say the secret word.{(" Hint: " + hint) if hint else ""}', {'secret_length': len(self.secret)}

    def step(self, action: Any):
        if self.secret in str(action):
            return 'Yes!', 1.0, True, False, {'said': self.secret}
        return 'No, try again.', -0.1, False, False, {}

    def close(self) -> None:
        CLOSED.append(self.secret)


CLOSED: list = []


def make_timed(max_episode_steps: int = 3, **kwargs: Any) -> TimeLimit:
    """gymnasium's TimeLimit: ``truncated`` becomes true at the step limit."""
    return TimeLimit(SayTheWordEnv(**kwargs), max_episode_steps=max_episode_steps)


class PlainCounter:
    """No gymnasium at all: ``reset()`` without arguments, 5-tuple ``step``; truncates at 2 steps."""

    def __init__(self) -> None:
        self.n = 0

    def reset(self):
        self.n = 0
        return 'Count with me.', {}

    def step(self, action):
        self.n += 1
        return f'{self.n}', 0.5, False, self.n >= 2, {'n': self.n}


class NotAnEnv:
    def __init__(self, **kwargs: Any) -> None:
        pass
