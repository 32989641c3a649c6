"""The judge: a role that scores an episode with a model call over its transcript.

:func:`judged` wraps any episode environment: the wrapped episode runs as before, and when its
environment says it is over, the judge role is named to act once, with the task and the
transcript (every action, by role) as its observation; its reply's score is added to the rewards
of the roles it judges, and then the episode ends. The judge is an ordinary role: its own request
(so its verdicts are recorded, and can be audited like any trajectory), its own policy (a
backend of its own), not trained by default (``Role('judge', train=False)``).

The score is the first match of ``pattern`` (its first group; default ``Score: <number>``, else the
last number of the reply), divided by ``scale``. A reply without one adds nothing, and the
episode record's ``info.judge`` says so (``score: null``).
"""
from __future__ import annotations

import inspect
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from mtflow.roles.env import EpisodeEnv, EpisodeEnvError, EpisodeInfo, EpisodeStep, as_step, check_episode_env

__all__ = ['judged', 'JudgedEnv', 'DEFAULT_JUDGE_TEMPLATE', 'DEFAULT_SCORE_PATTERN', 'read_score']

DEFAULT_JUDGE_TEMPLATE = ('Task: {task}\n\nTranscript:\n{transcript}\n\nHow well did {judged} do? Answer with '
                          '"Score: N" for a whole number N from 0 to {scale}.')
DEFAULT_SCORE_PATTERN = r'[Ss]core\s*[:=]\s*(-?\d+(?:\.\d+)?)'
_LAST_NUMBER = re.compile(r'(-?\d+(?:\.\d+)?)(?!.*\d)', re.S)


def read_score(text: str, pattern: str = DEFAULT_SCORE_PATTERN, scale: float = 10.0) -> Optional[float]:
    """The judge's score in ``text`` (``pattern``'s first group, else the last number), over
    ``scale``; ``None`` when there is none."""
    match = re.search(pattern, text) or _LAST_NUMBER.search(text)
    if match is None:
        return None
    try:
        return float(match.group(1)) / scale
    except (ValueError, IndexError):
        return None


async def _value(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


class JudgedEnv(EpisodeEnv):
    """An episode environment with a judge at its end (see the module docstring)."""

    def __init__(self, inner: Any, judge: Any = 'judge', judges: Sequence[Any] = (), template: str = DEFAULT_JUDGE_TEMPLATE,
                 pattern: str = DEFAULT_SCORE_PATTERN, scale: float = 10.0) -> None:
        check_episode_env(inner, [])
        self.inner = inner
        self.judge = judge
        self.judges = list(judges)
        self.template = template
        self.pattern = pattern
        self.scale = scale
        inner_roles = getattr(inner, 'roles', None)
        self.roles = None if inner_roles is None else tuple(inner_roles) + (judge, )
        self.transcript: List[str] = []
        self.task = ''
        self.judging = False
        self.scored = False

    async def reset(self, episode: EpisodeInfo) -> Optional[Mapping[Any, Any]]:
        self.task = episode.task_text
        if not self.judges:
            self.judges = [seat for seat in episode.seats.values() if seat != self.judge]
        return await _value(self.inner.reset(episode))

    async def acting(self) -> Sequence[Any]:
        if self.judging:
            return [] if self.scored else [self.judge]
        return await _value(self.inner.acting())

    async def step(self, actions: Mapping[Any, str]) -> EpisodeStep:
        if self.judging:
            text = actions.get(self.judge, '')
            score = read_score(text, self.pattern, self.scale)
            self.scored = True
            rewards = {seat: score for seat in self.judges} if score is not None else None
            return EpisodeStep(done=True, rewards=rewards, info={'judge': {'score': score, 'judged': self.judges}})
        for seat, text in actions.items():
            self.transcript.append(f'{seat}: {text}')
        out = as_step(await _value(self.inner.step(actions)), f'environment {type(self.inner).__name__}')
        if not out.done:
            return out
        self.judging = True
        observations = dict(out.observations or {})
        if self.judge in observations:
            raise EpisodeEnvError(f'judged: the environment {type(self.inner).__name__} sends an observation to the '
                                  f'judge seat {self.judge!r}; give the judge a seat of its own')
        shown = ', '.join(str(s) for s in self.judges)
        observations[self.judge] = self.template.format(task=self.task, transcript='\n'.join(self.transcript),
                                                        judged=shown, scale=int(self.scale) if self.scale == int(
                                                            self.scale) else self.scale)
        return EpisodeStep(observations, done=False, rewards=out.rewards, info=out.info)

    async def close(self) -> None:
        close = getattr(self.inner, 'close', None)
        if callable(close):
            await _value(close())


def judged(env: Callable[..., Any], judge: Any = 'judge', judges: Sequence[Any] = (),
           template: str = DEFAULT_JUDGE_TEMPLATE, pattern: str = DEFAULT_SCORE_PATTERN,
           scale: float = 10.0) -> Callable[[EpisodeInfo], JudgedEnv]:
    """A factory of ``env``'s episodes with a judge at the end (``judge``: the judge role's seat;
    ``judges``: the seats it scores, default every other seat)."""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise EpisodeEnvError(f'judge: pattern {pattern!r} is not a regular expression: {exc}') from None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise EpisodeEnvError(f'judge: scale must be a number > 0, got {scale!r}')

    def make(info: EpisodeInfo) -> JudgedEnv:
        inner = env() if inspect.isclass(env) else _call(env, info)
        return JudgedEnv(inner, judge, judges, template, pattern, scale)

    return make


def _call(factory: Callable[..., Any], info: EpisodeInfo) -> Any:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return factory(info)
    return factory(info) if params else factory()
