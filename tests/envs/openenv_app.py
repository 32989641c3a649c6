"""A small OpenEnv environment served with openenv's own server code (``create_app``), for
the OpenEnv tests: guess a digit 1..9 (target from the reset seed), reward 1.0 on the right guess.

``/stats`` (added to openenv's FastAPI app) reports how many sessions this server process reset
and closed and how many are open, so tests check that every session was closed. The server's
capacity is ``OPENENV_TEST_MAX_SESSIONS`` (default 8)."""
from __future__ import annotations

import os
import re
import threading
import time
from typing import Any, Optional

from openenv.core.env_server import Action, Environment, Observation, State, create_app


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str


STATS = {'resets': 0, 'closes': 0, 'steps': 0, 'episodes': []}
_LOCK = threading.Lock()


class GuessDigitEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.target = 5
        self.tries = 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        self.target = (seed or 0) % 9 + 1
        self.tries = 0
        self._state = State(episode_id=episode_id, step_count=0)
        with _LOCK:
            STATS['resets'] += 1
            STATS['episodes'].append(episode_id)
        return GuessObservation(prompt='Guess my digit (1-9).', done=False, reward=None)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        delay = float(os.environ.get('OPENENV_TEST_STEP_DELAY_S', '0'))
        if delay:
            time.sleep(delay)
        with _LOCK:
            STATS['steps'] += 1
        if action.message.strip() == 'crash':
            raise ValueError('the environment crashed on purpose')
        self.tries += 1
        self._state.step_count += 1
        digits = re.findall(r'\d', action.message)
        if digits and int(digits[-1]) == self.target:
            return GuessObservation(prompt='Correct!', done=True, reward=1.0)
        if self.tries >= 4:
            return GuessObservation(prompt=f'Out of tries; it was {self.target}.', done=True, reward=0.0)
        hint = 'no digit' if not digits else ('higher' if int(digits[-1]) < self.target else 'lower')
        return GuessObservation(prompt=f'Wrong ({hint}). Guess again.', done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        with _LOCK:
            STATS['closes'] += 1


app = create_app(GuessDigitEnvironment, GuessAction, GuessObservation,
                 max_concurrent_envs=int(os.environ.get('OPENENV_TEST_MAX_SESSIONS', '8')))


@app.get('/stats')
def stats() -> dict:
    with _LOCK:
        return {**STATS, 'open': STATS['resets'] - STATS['closes']}
