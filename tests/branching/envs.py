"""Environments for the branching tests: a dice game in three kinds (copies itself, only replays,
neither), and one that does not replay the same although it says it does."""
from __future__ import annotations

import copy
import itertools
import zlib
from typing import Any

_counter = itertools.count()


class Dice:
    """Each reply rolls a die seeded by the episode (the request's root uuid) and the replies so
    far; the total is the observation; the episode ends after ``rolls`` replies with reward
    total / (6 * rolls). Neither copies nor replays: a fork is refused."""

    def __init__(self, rolls: int = 3) -> None:
        self.rolls = rolls
        self.key = ''
        self.history: list = []

    def reset(self, infer_request: Any) -> str:
        self.key = str(infer_request.uuid).split('~')[0]
        self.history = []
        return 'roll the dice'

    def _face(self) -> int:
        return 1 + zlib.crc32(f'{self.key}/{"|".join(self.history)}'.encode()) % 6

    def step(self, action: str) -> tuple:
        self.history.append(action)
        total = sum(1 + zlib.crc32(f'{self.key}/{"|".join(self.history[:k + 1])}'.encode()) % 6
                    for k in range(len(self.history)))
        done = len(self.history) >= self.rolls
        return f'total {total}', (total / (6 * self.rolls)) if done else 0.0, done, {}

    def close(self) -> None:
        pass


class CopyingDice(Dice):
    def fork(self) -> 'CopyingDice':
        return copy.deepcopy(self)


class ReplayingDice(Dice):
    replayable = True


class ForgetfulDice(Dice):
    """Says it replays, but each instance rolls its own way."""
    replayable = True

    def __init__(self, rolls: int = 3) -> None:
        super().__init__(rolls)
        self.salt = next(_counter)

    def step(self, action: str) -> tuple:
        obs, reward, done, info = super().step(action)
        return f'{obs} ({self.salt})', reward, done, info
