"""The episode environment: the one interface an environment of several roles implements, declared
once (:data:`EPISODE_ENV_METHODS`) and checked when the episode scheduler is built.

An episode environment decides who acts and what each role sees; mtflow runs the roles' turns.
Its methods (each may be ``def`` or ``async def``)::

    class MyGame(EpisodeEnv):
        roles = ('player_0', 'player_1')             # optional: the seats it knows (checked)

        def reset(self, episode):                     # episode: EpisodeInfo (id, seed, data, task, seats)
            return {'player_0': 'You move first.'}     # opening observations, by seat (any may be absent)

        def acting(self):                              # the seats that act now: one (turn-based), several
            return [...]                               # (simultaneous moves); [] only when the episode is over

        def step(self, actions):                       # {seat: its Action (the text its turn produced)}, every acting seat
            return EpisodeStep(observations={...},     # what each seat sees next (by seat; any may be absent)
                               done=False,             # the episode is over
                               rewards={...},          # this step's rewards, by seat (summed over the episode)
                               info={...})             # anything, kept in the episode record

        def close(self):                               # optional: release what it holds
            ...

Each action is an :class:`Action`: the text of the role's turn (a ``str``), with the ids the model
sampled for it (``action.token_ids``, when the backend gives them) and the role's turn.
Turn-based games name one seat at a time, simultaneous games every seat (the episode steps the
environment once all of them have acted), message passing the seat a message goes to. An
observation is a text (a user message), a message dict, or a list of message dicts.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from mtflow.core.signatures import call_problem, method_call_problem
from mtflow.roles.role import RoleError

__all__ = ['Action', 'EpisodeEnv', 'EpisodeInfo', 'EpisodeStep', 'EPISODE_ENV_METHODS', 'EpisodeEnvError', 'check_episode_env',
           'as_messages', 'as_step']


class EpisodeEnvError(RoleError):
    """An episode environment that does not implement the interface (a missing method, one that
    cannot take its arguments), refused at load; or one that answered outside it during a run
    (the message names the environment, the episode, the step and the field)."""


#: every method of the interface: ``(name, arguments mtflow passes, required)``
EPISODE_ENV_METHODS: Tuple[Tuple[str, Tuple[str, ...], bool], ...] = (
    ('reset', ('episode', ), True),
    ('acting', (), True),
    ('step', ('actions', ), True),
    ('close', (), False),
)


class Action(str):
    """A role's action: the text its turn produced (a ``str``, so an environment that reads text
    reads it as it is), with ``token_ids`` (the ids the model sampled for it, ``None`` when the
    backend gives none), ``turn`` (the role's turn that produced it) and ``messages`` (what the
    role added to its conversation since it was last named to act: with its own scheduler, its
    tool calls and their results, then this reply)."""
    token_ids: Optional[List[int]]
    turn: int
    messages: List[Dict[str, Any]]

    def __new__(cls, text: str, token_ids: Optional[Sequence[int]] = None, turn: int = 0,
                messages: Optional[Sequence[Dict[str, Any]]] = None) -> 'Action':
        action = super().__new__(cls, text)
        action.token_ids = list(token_ids) if token_ids is not None else None
        action.turn = turn
        action.messages = [dict(m) for m in messages or ()]
        return action


@dataclass(frozen=True)
class EpisodeInfo:
    """What an environment's ``reset`` gets: the episode's id, its seed (the prompt's
    ``data_dict['seed']``, else a stable number from the id), the prompt's ``data_dict`` and its
    messages (the task), and the seats of its roles (role name -> seat)."""
    id: str
    seed: int
    data: Mapping[str, Any]
    task: Sequence[Mapping[str, Any]]
    seats: Mapping[str, Any]

    @property
    def task_text(self) -> str:
        """The prompt's last user message (the task in words), or ``''``."""
        for message in reversed(list(self.task)):
            if isinstance(message, Mapping) and message.get('role') == 'user':
                return str(message.get('content') or '')
        return ''


@dataclass
class EpisodeStep:
    """What one ``step`` of an episode environment returns (see the module docstring)."""
    observations: Mapping[Any, Any] = field(default_factory=dict)
    done: bool = False
    rewards: Optional[Mapping[Any, float]] = None
    info: Optional[Mapping[str, Any]] = None


class EpisodeEnv:
    """Base class of episode environments (optional: any object with these methods works; see the
    module docstring for the contract). ``close`` does nothing by default."""
    roles: Optional[Sequence[Any]] = None

    def reset(self, episode: EpisodeInfo) -> Optional[Mapping[Any, Any]]:  # pragma: no cover - the contract
        raise NotImplementedError

    def acting(self) -> Sequence[Any]:  # pragma: no cover - the contract
        raise NotImplementedError

    def step(self, actions: Mapping[Any, str]) -> EpisodeStep:  # pragma: no cover - the contract
        raise NotImplementedError

    def close(self) -> None:
        return None


def check_episode_env(env: Any, seats: Sequence[Any]) -> None:
    """``env`` (a class, or an instance) implements :data:`EPISODE_ENV_METHODS` with callable
    methods that take the arguments mtflow passes, and its declared ``roles`` (if any) hold every
    seat in ``seats``; else an :class:`EpisodeEnvError` naming the environment and what is wrong."""
    cls = env if inspect.isclass(env) else type(env)
    name = cls.__qualname__
    problems: List[str] = []
    for method, args, required in EPISODE_ENV_METHODS:
        fn = getattr(env, method, None)
        if fn is None or not callable(fn):
            if required:
                problems.append(f'it has no {method}({", ".join(args)}) method')
            continue
        problem = method_call_problem(cls, method, args) if inspect.isclass(env) else call_problem(fn, args, method)
        if problem:
            problems.append(problem)
    declared = getattr(env, 'roles', None)
    if declared is not None and not isinstance(declared, (str, bytes)):
        missing = [s for s in seats if s not in list(declared)]
        if missing:
            problems.append(f'its roles {list(declared)!r} do not include the seat(s) {missing!r} the episode declares')
    if problems:
        raise EpisodeEnvError(f'episode environment {name}: ' + '; '.join(problems)
                              + ' (the interface: docs/multi-agent.md, "The episode environment")')


def as_messages(observation: Any, where: str) -> List[Dict[str, Any]]:
    """An observation as messages: a text becomes one user message, a message dict itself, a list
    of them each; ``None`` none. Anything else is an :class:`EpisodeEnvError` naming ``where``."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{'role': 'user', 'content': observation}]
    if isinstance(observation, Mapping):
        observation = [observation]
    if isinstance(observation, (list, tuple)):
        out = []
        for item in observation:
            if isinstance(item, str):
                out.append({'role': 'user', 'content': item})
            elif isinstance(item, Mapping) and isinstance(item.get('role'), str) and 'content' in item:
                out.append(dict(item))
            else:
                raise EpisodeEnvError(f'{where}: an observation message must be a text or a {{role, content}} dict, '
                                      f'got {item!r:.80}')
        return out
    raise EpisodeEnvError(f'{where}: an observation must be a text, a message dict or a list of them, '
                          f'got {type(observation).__name__}')


def as_step(value: Any, where: str) -> EpisodeStep:
    """What ``step`` returned as an :class:`EpisodeStep`: one, or a dict of its fields."""
    if isinstance(value, EpisodeStep):
        return value
    if isinstance(value, Mapping):
        unknown = set(value) - {'observations', 'done', 'rewards', 'info'}
        if unknown:
            raise EpisodeEnvError(f'{where}: step returned unknown key(s) {sorted(unknown)}; '
                                  f'it returns observations, done, rewards, info')
        return EpisodeStep(value.get('observations') or {}, bool(value.get('done', False)), value.get('rewards'),
                           value.get('info'))
    raise EpisodeEnvError(f'{where}: step must return an EpisodeStep (or a dict of its fields), '
                          f'got {type(value).__name__}')
