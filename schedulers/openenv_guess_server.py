"""Guess-the-number as an OpenEnv server: mtflow's :class:`GuessNumberEnv` behind openenv's
own ``create_app`` (the WebSocket protocol every OpenEnv client speaks). ``openenv_guess.yaml``
launches it on 127.0.0.1; run it yourself with
``python -m uvicorn schedulers.openenv_guess_server:app --port 8000`` and point ``url:`` at it.

The target comes from the reset ``seed`` (mtflow sends ``data_dict['seed']``, else a number
derived from the request uuid), or from ``target`` in the reset keywords (``data_dict:
{reset_kwargs: {target: 42}}``). ``OPENENV_GUESS_MAX_SESSIONS`` sets the server's capacity
(default 64)."""
from __future__ import annotations

import os
from typing import Any, Optional

from openenv.core.env_server import Action, Environment, Observation, State, create_app

from mtflow.declarative.gym import GuessNumberEnv


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    text: str


class _Request:
    """What GuessNumberEnv.reset reads from a request."""

    def __init__(self, target: int) -> None:
        self.data_dict = {'target': target}


class GuessNumberEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one GuessNumberEnv per session, no shared state

    def __init__(self) -> None:
        super().__init__()
        self.game = GuessNumberEnv(low=1, high=100, max_guesses=6)
        self._state = State()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, target: Optional[int] = None,
              **kwargs: Any) -> GuessObservation:
        target = target if target is not None else (seed or 0) % 100 + 1
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(text=self.game.reset(_Request(target)), done=False, reward=None)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        obs, reward, done, info = self.game.step(action.message)
        return GuessObservation(text=obs, done=done, reward=reward, metadata=info)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessNumberEnvironment, GuessAction, GuessObservation,
                 max_concurrent_envs=int(os.environ.get('OPENENV_GUESS_MAX_SESSIONS', '64')))
