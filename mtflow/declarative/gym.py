"""Gym-style environments for the YAML scheduler, and the built-in ``guess_number``.

An environment is any object with ``reset(infer_request) -> Optional[str]``,
``step(action: str) -> (observation, reward, done, info)`` and ``close()``; each may be ``async``.
The scheduler makes one per request, steps it with every completion (in ``on_turn_end``, so that
``done`` decides the stop), shows the observation as the next message, and closes it from
``on_request_finished`` — which the executor calls on every finish path, errors and ``max_turns``
included, so no environment outlives its request.
"""
from __future__ import annotations

import copy
import hashlib
import random
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

from mtflow.core.registry import Registry
from mtflow.engine.branching import branch_root

StepOut = Tuple[str, float, bool, Dict[str, Any]]


class Env:
    """Base class (optional: any object with these methods works)."""

    def reset(self, infer_request: Any) -> Optional[str]:
        """Start an episode for this request; may return an opening observation."""
        return None

    def step(self, action: str) -> StepOut:
        raise NotImplementedError

    def close(self) -> None:
        return None


_INT = re.compile(r'-?\d+')


class GuessNumberEnv(Env):
    """Guess a hidden integer in ``[low, high]`` with higher/lower feedback.

    Several turns happen whatever the model writes: the last integer in the reply is the guess;
    a reply without one gets "please answer with a number"; a wrong guess gets "higher"/"lower";
    the episode ends on a correct guess (reward 1.0) or after ``max_guesses`` replies (reward 0).
    The target is ``data_dict['target']`` when given, else derived from the request uuid and
    ``seed`` (deterministic across runs; a branch of a request, uuid ``<uuid>~<k>``, plays its
    root's episode). A fork of the request copies it (:meth:`fork`); it also replays exactly.
    """
    #: reset with the same request and stepped with the same replies, it gives the same observations
    replayable = True

    def __init__(self, low: int = 1, high: int = 100, max_guesses: int = 8, seed: int = 0) -> None:
        if low >= high:
            raise ValueError(f'low ({low}) must be below high ({high})')
        self.low, self.high, self.max_guesses, self.seed = low, high, max_guesses, seed
        self.target: Optional[int] = None
        self.guesses: List[int] = []
        self.replies = 0
        self.closed = False

    def reset(self, infer_request: Any) -> Optional[str]:
        data = getattr(infer_request, 'data_dict', None) or {}
        if 'target' in data:
            self.target = int(data['target'])
        else:
            key = f'{self.seed}:{branch_root(getattr(infer_request, "uuid", None) or "")}'
            rng = random.Random(int(hashlib.sha256(key.encode()).hexdigest()[:16], 16))
            self.target = rng.randint(self.low, self.high)
        self.guesses, self.replies = [], 0
        return f'I am thinking of a number between {self.low} and {self.high}. Guess it!'

    def step(self, action: str) -> StepOut:
        if self.target is None:
            raise RuntimeError('step() before reset()')
        self.replies += 1
        numbers = _INT.findall(action or '')
        info: Dict[str, Any] = {'target': self.target, 'solved': False}
        last_chance = self.replies >= self.max_guesses
        if not numbers:
            obs = f'Please answer with a number between {self.low} and {self.high}.'
            info['valid'] = False
            return obs, 0.0, last_chance, info
        guess = int(numbers[-1])
        self.guesses.append(guess)
        info.update(valid=True, guess=guess, distance=abs(guess - self.target))
        if guess == self.target:
            info['solved'] = True
            return f'Correct! The number was {self.target}.', 1.0, True, info
        if guess < self.low or guess > self.high:
            obs = f'{guess} is out of range. Guess a number between {self.low} and {self.high}.'
        else:
            obs = f'{guess} is too {"low" if guess < self.target else "high"}. Guess {"higher" if guess < self.target else "lower"}.'
        return obs, 0.0, last_chance, info

    def fork(self) -> 'GuessNumberEnv':
        """An independent copy in the same state (a forked request's environment)."""
        return copy.deepcopy(self)

    def close(self) -> None:
        self.closed = True


#: name -> environment class (or factory), made with the YAML ``kwargs``
ENVS = Registry('mtflow.envs', 'unknown environment {name} (built-in: {known}, or module:Class)',
                builtins={'guess_number': GuessNumberEnv})


def register_env(name: str, factory: Callable[..., Any]) -> None:
    """Make an environment available by name in YAML (``env: {impl: <name>}``)."""
    ENVS.register(name, factory)


def make_env_factory(impl: str, kwargs: Dict[str, Any], base_dir: Optional[str] = None) -> Callable[[], Any]:
    """A zero-argument callable making a fresh environment per request."""
    cls = ENVS.get(impl, base_dir)
    kwargs = dict(kwargs)
    cls(**kwargs)  # fail at load time, not at the first turn, on bad kwargs
    return lambda: cls(**kwargs)
