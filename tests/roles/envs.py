"""Small episode environments for the tests: turn-based, simultaneous, message passing, and broken
ones."""
from __future__ import annotations

import asyncio
from typing import Any, Dict, List

from mtflow.roles import EpisodeEnv, EpisodeStep


class TakeTurns(EpisodeEnv):
    """Two seats say a word in turn; after ``moves`` moves the one who spoke last wins (+1, -1)."""
    roles = ('a', 'b')

    def __init__(self, moves: int = 4) -> None:
        self.moves, self.said, self.turn = moves, [], 'a'

    def reset(self, episode):
        return {'a': f'task: {episode.task_text or "play"} (you start)'}

    def acting(self):
        return [] if len(self.said) >= self.moves else [self.turn]

    def step(self, actions):
        [(seat, text)] = actions.items()
        self.said.append((seat, text))
        other = 'b' if seat == 'a' else 'a'
        self.turn = other
        if len(self.said) >= self.moves:
            return EpisodeStep({other: f'{seat} said {text}; game over'}, done=True, rewards={seat: 1.0, other: -1.0},
                               info={'said': len(self.said)})
        return EpisodeStep({other: f'{seat} said: {text}'})


class BothAtOnce(EpisodeEnv):
    """Simultaneous moves: both seats act each round; +1 each when they said the same parity of
    words, 0 otherwise; ``rounds`` rounds (a cooperative game)."""
    roles = ('a', 'b')

    def __init__(self, rounds: int = 2) -> None:
        self.rounds, self.round = rounds, 0

    async def reset(self, episode):
        await asyncio.sleep(0)
        return {'a': 'round 1: say something', 'b': 'round 1: say something'}

    def acting(self):
        return ['a', 'b']

    async def step(self, actions):
        await asyncio.sleep(0)  # really suspends: the last role's step runs as a task
        self.round += 1
        same = len(actions['a'].split()) % 2 == len(actions['b'].split()) % 2
        rewards = {'a': 1.0 if same else 0.0, 'b': 1.0 if same else 0.0}
        if self.round >= self.rounds:
            return {'done': True, 'rewards': rewards}
        obs = {s: f'round {self.round + 1}: the other said {actions["b" if s == "a" else "a"]!r}' for s in actions}
        return {'observations': obs, 'rewards': rewards}


class Relay(EpisodeEnv):
    """Message passing: the user speaks first; each message goes to the other side; the user ends
    the conversation with STOP (or after ``exchanges`` user turns)."""
    roles = ('assistant', 'user')

    def __init__(self, exchanges: int = 3) -> None:
        self.exchanges, self.user_turns, self.next = exchanges, 0, 'user'

    def reset(self, episode):
        return {'user': f'You are a customer. Your task: {episode.task_text}. Begin.'}

    def acting(self):
        return [self.next]

    def step(self, actions):
        [(seat, text)] = actions.items()
        if seat == 'user':
            self.user_turns += 1
            if 'STOP' in text or self.user_turns >= self.exchanges:
                return EpisodeStep(done=True, rewards={'assistant': float('thanks' in text.lower())})
            self.next = 'assistant'
            return EpisodeStep({'assistant': text})
        self.next = 'user'
        return EpisodeStep({'user': text})


class NamesNobody(TakeTurns):
    """Names no one after the first move: a deadlock."""

    def acting(self):
        return [] if self.said else ['a']


class StepFails(TakeTurns):
    def step(self, actions):
        raise RuntimeError('the board caught fire')


class NoStep:
    def reset(self, episode):
        return {}

    def acting(self):
        return []
