"""Single-player textarena games (``textarena.make(id)``) as YAML environments.

Each turn the completion is the player's move (``env.step``); what the game says back (its new
observations since the last move, the player's own echoed move left out, however the game tags
it: as the player, as a ``PLAYER_ACTION``, or as the game itself) is the next message.
When the game is over, ``env.close()`` gives textarena's reward for the player (many games shape
it: Mastermind's pegs, GuessTheNumber's closeness), which becomes this step's reward; the episode
stops with ``stop_rule:env_done``.

Use the ``-raw`` game ids (e.g. ``Mastermind-v0-raw``): they return observations as
``(sender, text, type)`` entries, so each turn shows only what is new. The wrapped ids return the
whole game history as one string each turn; that works too, but repeats itself in a chat.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from mtflow.declarative.envs.base import StepOutcome, request_seed, require
from mtflow.declarative.envs.config import TextArenaConfig


class TextArenaEnv:
    """One game for one request."""

    def __init__(self, config: TextArenaConfig) -> None:
        ta = require('textarena', 'textarena')
        self.config = config
        self.env = ta.make(config.id, **config.kwargs)
        self.player_id = 0
        self.done = False
        self.result: Optional[tuple] = None
        self.last_action: Optional[str] = None

    def reset(self, infer_request: Any) -> Optional[str]:
        self.env.reset(num_players=1, seed=request_seed(infer_request))
        return self._observation()

    def _observation(self) -> str:
        self.player_id, obs = self.env.get_observation()
        if isinstance(obs, str):
            return obs
        parts: List[str] = []
        for entry in obs or []:
            if isinstance(entry, (tuple, list)) and len(entry) >= 2:
                if self._own_move(entry):
                    continue  # the player's own move, echoed back (whatever sender the game tags it with)
                parts.append(str(entry[1]))
            else:
                parts.append(str(entry))
        return '\n'.join(parts)

    def _own_move(self, entry: Any) -> bool:
        """The player's move echoed back: sent as the player, typed ``PLAYER_ACTION`` (TowerOfHanoi
        sends it as the game, ``-1``), or the very text just played."""
        if entry[0] == self.player_id:
            return True
        kind = entry[2] if len(entry) >= 3 else None
        if getattr(kind, 'name', kind) == 'PLAYER_ACTION':
            return True
        return self.last_action is not None and str(entry[1]).strip() == self.last_action.strip()

    def step(self, action: str) -> StepOutcome:
        self.last_action = action
        done, step_info = self.env.step(action)
        if not done:
            return StepOutcome(self._observation(), 0.0, False, False, dict(step_info or {}))
        self.done = True
        rewards, game_info = self.env.close()
        self.result = (rewards, game_info)
        info: Dict[str, Any] = dict((game_info or {}).get(self.player_id, {}))
        reward = (rewards or {}).get(self.player_id, 0.0)
        if not isinstance(reward, (int, float)):  # some games report a message instead of a number
            info['reward_text'] = str(reward)
            reward = 0.0
        if info.get('invalid_move') and self.config.invalid_move_reward is not None:
            reward = self.config.invalid_move_reward
        return StepOutcome(str(info.get('reason', 'Game over.')), float(reward), True, False, info)

    def close(self) -> None:
        if not self.done:
            self.done = True
            close_game(self.env)


def close_game(env: Any) -> None:
    """Close a textarena game that did not end (it may fail to score itself: that is not an error)."""
    try:
        env.close()
    except Exception:
        pass


def textarena_factory(config: TextArenaConfig) -> Callable[[], TextArenaEnv]:
    """Check the game id now (``textarena.make`` raises on an unknown one)."""
    TextArenaEnv(config)
    return lambda: TextArenaEnv(config)
