"""A conversation between an assistant and a simulated user (tau-bench's setting): message passing.

The user simulator is a role like any other, played by its own policy with a persona (its
``system`` prompt): it gets the task as its opening observation and speaks first; each of its
replies is the assistant's next user message, and each of the assistant's replies (after any
tool calls of its own scheduler) is the user's next one. The user ends the conversation by
saying ``stop`` (default ``###STOP###``), or it ends after ``max_exchanges`` user replies. The
simulator's own request is recorded like every role's, so what it said, how it said it and when it
stopped can be audited and measured (its ``train`` flag is usually false).

The rewards come from ``reward(episode_info, transcript) -> {seat: number}`` at the end (sync or
async; ``transcript`` the list of ``(seat, text)`` in order), from a judge (:func:`mtflow.roles.judge.judged`
around this environment), or both.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from mtflow.roles.env import EpisodeEnv, EpisodeEnvError, EpisodeInfo, EpisodeStep

__all__ = ['Conversation', 'conversation', 'DEFAULT_USER_OPENING', 'STOP']

STOP = '###STOP###'
DEFAULT_USER_OPENING = ('Your goal: {task}\nYou are talking to a customer-service assistant. Write your first '
                        'message to it. When your goal is met (or cannot be), say {stop}.')

RewardFn = Callable[[EpisodeInfo, List[Tuple[Any, str]]], Any]


class Conversation(EpisodeEnv):
    """See the module docstring. Seats: ``assistant`` and ``user`` (or the names given)."""

    def __init__(self, assistant: str = 'assistant', user: str = 'user', stop: str = STOP, max_exchanges: int = 8,
                 opening: str = DEFAULT_USER_OPENING, reward: Optional[RewardFn] = None) -> None:
        if assistant == user:
            raise EpisodeEnvError('conversation: the assistant and the user need seats of their own')
        if isinstance(max_exchanges, bool) or not isinstance(max_exchanges, int) or max_exchanges < 1:
            raise EpisodeEnvError(f'conversation: max_exchanges must be an int >= 1, got {max_exchanges!r}')
        self.assistant, self.user, self.stop, self.max_exchanges = assistant, user, stop, max_exchanges
        self.opening, self.reward = opening, reward
        self.roles = (assistant, user)
        self.next = user
        self.exchanges = 0
        self.transcript: List[Tuple[Any, str]] = []
        self.info: Optional[EpisodeInfo] = None

    def reset(self, episode: EpisodeInfo) -> Dict[str, str]:
        self.info = episode
        return {self.user: self.opening.format(task=episode.task_text, stop=self.stop)}

    def acting(self) -> Sequence[str]:
        return [self.next]

    async def step(self, actions: Mapping[Any, str]) -> EpisodeStep:
        [(seat, text)] = actions.items()
        self.transcript.append((seat, text))
        if seat == self.assistant:
            self.next = self.user
            return EpisodeStep({self.user: text})
        self.exchanges += 1
        said = text.replace(self.stop, '').strip()
        ended = self.stop in text or self.exchanges >= self.max_exchanges
        if not ended:
            self.next = self.assistant
            return EpisodeStep({self.assistant: said or text})
        rewards = None
        if self.reward is not None:
            rewards = self.reward(self.info, list(self.transcript))
            if inspect.isawaitable(rewards):
                rewards = await rewards
        info = {'exchanges': self.exchanges, 'stopped_by': 'user' if self.stop in text else 'max_exchanges'}
        return EpisodeStep(done=True, rewards=rewards, info=info)


def conversation(**options: Any) -> Callable[[EpisodeInfo], Conversation]:
    """A factory of :class:`Conversation` episodes with ``options`` (checked now)."""
    Conversation(**options)
    return lambda info: Conversation(**options)
