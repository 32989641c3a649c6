"""textarena's games of several players as episode environments.

``textarena.make(id)`` reset with ``num_players`` and the episode's seed; the seats are textarena's
player ids (``0``, ``1``, ...; :func:`mtflow.roles.self_play` names them ``player_0``, ...).
textarena says whose turn it is (``get_observation()``: the player, and what it has not seen
since it last acted); that player is the one acting role, and its observations are the game's
messages and the other players' moves (``Player 1: [4]``), its own echoed move left out. When
the game is over, ``env.close()`` gives textarena's rewards by player (a win +1, a loss -1, a draw
0 in most two-player games) and the reasons, which go into the episode record (``info``). An
invalid move is textarena's to judge: its error message is the next observation, or the game ends
with it, as textarena's rules for that game say. Use the ``-raw`` ids (each turn shows only what
is new).
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

from mtflow.declarative.envs.base import require
from mtflow.declarative.envs.textarena_env import close_game
from mtflow.roles.env import EpisodeEnv, EpisodeEnvError, EpisodeInfo, EpisodeStep

__all__ = ['TextArenaEpisode', 'textarena_episode']


class TextArenaEpisode(EpisodeEnv):
    """One textarena game of ``num_players`` players (see the module docstring)."""

    def __init__(self, game: str, num_players: int = 2, kwargs: Optional[Mapping[str, Any]] = None) -> None:
        ta = require('textarena', 'textarena')
        self.game = game
        self.num_players = num_players
        try:
            self.env = ta.make(game, **dict(kwargs or {}))
        except Exception as exc:
            raise EpisodeEnvError(f'textarena: cannot make {game!r}: {type(exc).__name__}: {exc}') from None
        self.roles = tuple(range(num_players))
        self.current: Optional[int] = None
        self.done = False

    def reset(self, episode: EpisodeInfo) -> Dict[int, str]:
        self.env.reset(num_players=self.num_players, seed=episode.seed)
        return self._turn()

    def _turn(self) -> Dict[int, str]:
        player, observation = self.env.get_observation()
        self.current = player
        return {player: self._render(player, observation)}

    @staticmethod
    def _render(player: int, observation: Any) -> str:
        if isinstance(observation, str):
            return observation
        parts: List[str] = []
        for entry in observation or []:
            if not (isinstance(entry, (tuple, list)) and len(entry) >= 2):
                parts.append(str(entry))
                continue
            sender, text = entry[0], str(entry[1])
            if sender == player:
                continue  # its own move, echoed back
            parts.append(f'Player {sender}: {text}' if isinstance(sender, int) and sender >= 0 else text)
        return '\n'.join(parts) or 'Your move.'

    def acting(self) -> Sequence[int]:
        return [] if self.done or self.current is None else [self.current]

    def step(self, actions: Mapping[Any, str]) -> EpisodeStep:
        [(player, move)] = actions.items()
        done, step_info = self.env.step(move)
        if not done:
            return EpisodeStep(self._turn(), info=dict(step_info or {}) or None)
        self.done = True
        rewards, game_info = self.env.close()
        scores: Dict[int, float] = {}
        texts: Dict[str, str] = {}
        for seat, value in (rewards or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                scores[seat] = float(value)
            else:  # some games report a message instead of a number
                texts[str(seat)] = str(value)
        info: Dict[str, Any] = {'game': self.game, 'rewards': {str(k): v for k, v in (rewards or {}).items()},
                                'result': {str(k): v for k, v in (game_info or {}).items()}}
        if texts:
            info['reward_text'] = texts
        return EpisodeStep(done=True, rewards=scores, info=info)

    def close(self) -> None:
        if not self.done:
            self.done = True
            close_game(self.env)


def textarena_episode(game: str, num_players: int = 2, kwargs: Optional[Mapping[str, Any]] = None) -> Any:
    """A factory of :class:`TextArenaEpisode` games of ``game`` (checked now: an unknown id is a
    load error, not a failure of every episode)."""
    TextArenaEpisode(game, num_players, kwargs).close()

    def make(info: EpisodeInfo) -> TextArenaEpisode:
        return TextArenaEpisode(game, num_players, kwargs)

    return make
