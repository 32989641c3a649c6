"""Episodes in YAML: a scheduler file with a ``roles:`` section is an episode file.

::

    name: tictactoe_self_play
    roles:                                # each role one request of each episode
      - {name: player, seats: 2}          # self-play: player_0, player_1 on seats 0, 1, one policy
      # - {name: player_1, seat: 1, policy: b, sampling: {temperature: 0.7}, train: true}
      # - {name: assistant, scheduler: assistant_tools.yaml}   # its own scheduler (tools), next to this file
      # - {name: user, policy: sim, train: false, system: "You are Bob, ..."}
    env:                                  # the episode environment: one of
      textarena: {id: TicTacToe-v0-raw}   #   a textarena game of several players (num_players, kwargs)
      # conversation: {max_exchanges: 6}  #   an assistant and a simulated user (stop, opening, reward)
      # impl: my_envs:Game                #   your own (class or factory), kwargs: {...}
    judge: {role: judge, judges: [assistant]}   # optional: a judge role scores the episode at its end
    max_steps: 20                         # environment steps before an episode is cut (max_turns)
    turn_prompt: Your turn.               # what a role named to act with nothing new gets

A run config names the file as its ``scheduler:``; its ``policies:`` map policy ids to backends
(the run's own ``backend:``/``model:`` is the policy ``default``), and its ``roles:`` may change a
role's ``policy``, ``sampling`` or ``train`` by name. Every problem is reported with its file,
line and field, before anything runs; an unknown policy id is refused there.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from pydantic import Field, ValidationError, model_validator

from mtflow.core.keys import StrictModel
from mtflow.core.registry import resolve_reference
from mtflow.core.safe_yaml import YamlLoadError, load_yaml_file
from mtflow.declarative import inspect_file, load_scheduler
from mtflow.declarative.loader import ConfigError, Problem, format_path, line_of, read_yaml, validation_problems
from mtflow.roles.conversation import conversation
from mtflow.roles.judge import DEFAULT_JUDGE_TEMPLATE, DEFAULT_SCORE_PATTERN, judged
from mtflow.roles.role import DEFAULT_POLICY, Role, RoleError
from mtflow.roles.scheduler import EpisodeScheduler
from mtflow.roles.textarena import textarena_episode

__all__ = ['EpisodeConfig', 'RoleConfig', 'RoleOverride', 'is_episode_file', 'load_episode_scheduler',
           'episode_file_problems', 'episode_imports', 'episode_roles', 'read_episode_file']


class RoleConfig(StrictModel):
    """One ``roles:`` entry."""
    name: str = Field(description='The role\'s name (unique; with seats: the prefix of each seat\'s name).')
    seat: Optional[Union[int, str]] = Field(None, description='What the environment calls it (textarena: 0, 1, '
                                            '...); default: its name.')
    seats: Optional[int] = Field(None, ge=1, description='Self-play: this role in this many seats, named '
                                 '<name>_0 .. on seats 0 ..; one policy plays them all.')
    policy: str = Field(DEFAULT_POLICY, description="The policy id that plays it (the run config's policies:; "
                        "'default': the run's own backend).")
    sampling: Dict[str, Any] = Field(default_factory=dict, description='request_config fields for its turns only.')
    train: bool = Field(True, description='Whether its trajectory is trained (a judge or a user simulator: false).')
    scheduler: Optional[str] = Field(None, description="Its own scheduler (tools, parsers) within an action: a "
                                     "scheduler YAML file (next to this file) or 'module:Class'.")
    system: Optional[str] = Field(None, description='A system prompt that opens its conversation (a persona).')

    @model_validator(mode='after')
    def _seat_or_seats(self) -> 'RoleConfig':
        if self.seats is not None and self.seat is not None:
            raise ValueError('give seat (one seat) or seats (self-play in several), not both')
        return self


class TextArenaEpisodeConfig(StrictModel):
    id: str = Field(description='A textarena game id (use the -raw ids: TicTacToe-v0-raw).')
    num_players: int = Field(2, ge=2, description='Players (seats 0 .. num_players-1).')
    kwargs: Dict[str, Any] = Field(default_factory=dict, description='textarena.make keyword arguments.')


class ConversationConfig(StrictModel):
    assistant: str = Field('assistant', description="The assistant's seat.")
    user: str = Field('user', description="The simulated user's seat.")
    stop: str = Field('###STOP###', description='What the user says to end the conversation.')
    max_exchanges: int = Field(8, ge=1, description='User replies before the conversation ends.')
    opening: Optional[str] = Field(None, description="The user's opening observation ({task}, {stop}).")
    reward: Optional[str] = Field(None, description="'module:function(episode, transcript) -> {seat: reward}'.")


class EpisodeEnvConfig(StrictModel):
    """``env:``: exactly one kind."""
    textarena: Optional[TextArenaEpisodeConfig] = None
    conversation: Optional[ConversationConfig] = None
    impl: Optional[str] = Field(None, description="Your episode environment: 'module:Class' (or a factory).")
    kwargs: Dict[str, Any] = Field(default_factory=dict, description='impl: its keyword arguments.')

    @model_validator(mode='after')
    def _one_kind(self) -> 'EpisodeEnvConfig':
        kinds = [k for k in ('textarena', 'conversation', 'impl') if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError('give exactly one of textarena, conversation, impl'
                             + (f' (got {", ".join(kinds)})' if kinds else ''))
        if self.kwargs and self.impl is None:
            raise ValueError('kwargs go with impl only')
        return self


class JudgeConfig(StrictModel):
    role: str = Field('judge', description='The judge role (one of roles:).')
    judges: List[str] = Field(default_factory=list, description='The roles it scores (default: every other).')
    template: str = Field(DEFAULT_JUDGE_TEMPLATE, description='Its observation ({task}, {transcript}, {judged}, '
                          '{scale}).')
    pattern: str = Field(DEFAULT_SCORE_PATTERN, description='The score in its reply (first group).')
    scale: float = Field(10.0, gt=0, description='The score is divided by this.')


class EpisodeConfig(StrictModel):
    """An episode file (see the module docstring)."""
    name: Optional[str] = None
    description: Optional[str] = None
    roles: List[RoleConfig] = Field(min_length=1)
    env: EpisodeEnvConfig
    judge: Optional[JudgeConfig] = None
    max_steps: Optional[int] = Field(None, ge=1, description='Environment steps before an episode is cut.')
    turn_prompt: str = Field('Your turn.', description='What a role named to act with nothing new gets.')


class RoleOverride(StrictModel):
    """A run config's ``roles: {<name>: {...}}`` entry: what it changes of that role."""
    policy: Optional[str] = None
    sampling: Optional[Dict[str, Any]] = None
    train: Optional[bool] = None


def is_episode_file(path: Union[str, os.PathLike]) -> bool:
    """Whether a YAML file is an episode file (it has a top-level ``roles:``)."""
    try:
        data, _, _ = load_yaml_file(os.fspath(path))
    except (OSError, YamlLoadError):
        return False
    return isinstance(data, dict) and 'roles' in data


def episode_roles(config: EpisodeConfig, overrides: Optional[Mapping[str, RoleOverride]] = None,
                  make_scheduler: Any = None) -> List[Role]:
    """The roles of an episode file, seats expanded and the run config's overrides applied
    (``make_scheduler(reference, policy) -> scheduler``: each role's own scheduler)."""
    roles: List[Role] = []
    for entry in config.roles:
        names = [(f'{entry.name}_{k}', k) for k in range(entry.seats)] if entry.seats else [(entry.name, entry.seat)]
        for name, seat in names:
            change = (overrides or {}).get(name) or (overrides or {}).get(entry.name)
            policy = change.policy if change is not None and change.policy else entry.policy
            own = make_scheduler(entry.scheduler, policy) if (entry.scheduler and make_scheduler is not None) else None
            roles.append(Role(name, seat=seat, policy=policy,
                              sampling={**entry.sampling, **((change.sampling or {}) if change is not None else {})},
                              train=change.train if change is not None and change.train is not None else entry.train,
                              scheduler=own, system=entry.system))
    return roles


def _env_factory(env: EpisodeEnvConfig, base_dir: Optional[str]) -> Any:
    if env.textarena is not None:
        return textarena_episode(env.textarena.id, env.textarena.num_players, env.textarena.kwargs)
    if env.conversation is not None:
        options = env.conversation.model_dump(exclude_none=True)
        if 'reward' in options:
            options['reward'] = resolve_reference(options['reward'], base_dir)
        return conversation(**options)
    target = resolve_reference(env.impl, base_dir)
    if not env.kwargs:
        return target
    return lambda info: target(**env.kwargs)


def _with_judge(factory: Any, judge: Optional[JudgeConfig], roles: Sequence[Role]) -> Any:
    if judge is None:
        return factory
    by_name = {r.name: r for r in roles}
    if judge.role not in by_name:
        raise RoleError(f'judge.role: {judge.role!r} is not one of the roles ({", ".join(by_name)})')
    unknown = [n for n in judge.judges if n not in by_name or n == judge.role]
    if unknown:
        raise RoleError(f'judge.judges: {unknown} are not roles the judge can score (the roles but the judge '
                        f'itself: {", ".join(n for n in by_name if n != judge.role)})')
    seats = [by_name[n].env_seat for n in judge.judges]
    return judged(factory, by_name[judge.role].env_seat, seats, judge.template, judge.pattern, judge.scale)


def read_episode_file(path: str) -> Tuple[Optional[EpisodeConfig], Dict[Any, int], List[Problem]]:
    """``(config, line map, problems)`` of an episode file: its schema checked (``config`` is
    ``None`` when there are problems)."""
    data, lines, problems, fatal = read_yaml(path)
    if fatal:
        return None, lines, problems
    if not isinstance(data, dict):
        return None, lines, problems + [Problem(path, 1, '', 'an episode file must be a mapping')]
    try:
        return EpisodeConfig.model_validate(data), lines, problems
    except ValidationError as exc:
        return None, lines, problems + validation_problems(exc, path, lines, EpisodeConfig)


def load_episode_scheduler(path: Union[str, os.PathLike], *, policies: Optional[Sequence[str]] = None,
                           overrides: Optional[Mapping[str, RoleOverride]] = None, tokenizer: Any = None,
                           max_turns: Optional[int] = None) -> EpisodeScheduler:
    """The :class:`~mtflow.roles.scheduler.EpisodeScheduler` an episode file describes.
    ``policies``: the policy ids the run serves (an unknown one is refused); ``overrides``: the run
    config's ``roles:``; ``tokenizer``: for the roles' own YAML schedulers. Raises
    :class:`~mtflow.declarative.loader.ConfigError` (every problem, file:line: field)."""
    path = os.fspath(path)
    config, lines, problems = read_episode_file(path)
    if problems or config is None:
        raise ConfigError(sorted(problems, key=lambda p: p.line or 0))
    base_dir = os.path.dirname(os.path.abspath(path))

    def at(loc: Tuple[Any, ...], message: str) -> ConfigError:
        return ConfigError([Problem(path, line_of(lines, loc), format_path(loc), message)])

    def own_scheduler(reference: str, policy: str) -> Any:
        target = os.path.join(base_dir, reference)
        if reference.endswith(('.yaml', '.yml')):
            own = tokenizer.get(policy) if isinstance(tokenizer, Mapping) else tokenizer
            return load_scheduler(target if os.path.isfile(target) else reference, tokenizer=own)
        made = resolve_reference(reference, base_dir)
        return made() if callable(made) else made

    unknown = sorted(set(overrides or {}) - {r.name for r in config.roles}
                     - {f'{r.name}_{k}' for r in config.roles for k in range(r.seats or 0)})
    if unknown:
        raise RoleError(f'roles: {unknown} are not roles of {path}')
    if policies is not None:  # an unknown policy id the file names is refused at its own line
        for k, entry in enumerate(config.roles):
            changed = any(o.policy for n, o in (overrides or {}).items() if n == entry.name or n.startswith(
                f'{entry.name}_'))
            if not changed and entry.policy not in policies:
                raise at(('roles', k, 'policy'), f'unknown policy id {entry.policy!r}; the run serves: '
                         f'{", ".join(map(repr, policies))} (a run config\'s policies: adds more)')
    try:
        roles = episode_roles(config, overrides, own_scheduler)
    except (RoleError, ImportError, AttributeError, ConfigError) as exc:
        raise at(('roles', ), str(exc)) from None
    try:
        factory = _env_factory(config.env, base_dir)
    except Exception as exc:  # an environment that cannot be made: one line, naming it
        raise at(('env', ), f'{type(exc).__name__}: {exc}') from None
    try:
        factory = _with_judge(factory, config.judge, roles)
    except RoleError as exc:
        raise at(('judge', ), str(exc)) from None
    try:
        return EpisodeScheduler(factory, roles, policies=policies, max_steps=config.max_steps,
                                turn_prompt=config.turn_prompt, max_turns=max_turns)
    except RoleError as exc:
        field = 'env' if 'environment' in str(exc) else 'roles'
        raise at((field, ), str(exc)) from None


def episode_imports(path: Union[str, os.PathLike]) -> List[Tuple[str, str]]:
    """``(field, reference)`` for every Python object an episode file makes mtflow import (its
    environment, a conversation's reward, the roles' own Python schedulers), and each role's own
    scheduler file."""
    config = read_episode_file(os.fspath(path))[0]
    if config is None:
        return []
    out: List[Tuple[str, str]] = []
    if config.env.impl:
        out.append(('env.impl', config.env.impl))
    if config.env.conversation is not None and config.env.conversation.reward:
        out.append(('env.conversation.reward', config.env.conversation.reward))
    base_dir = os.path.dirname(os.path.abspath(os.fspath(path)))
    for k, role in enumerate(config.roles):
        if not role.scheduler:
            continue
        if not role.scheduler.endswith(('.yaml', '.yml')):
            out.append((f'roles[{k}].scheduler', role.scheduler))
            continue
        own = os.path.join(base_dir, role.scheduler)  # a YAML scheduler: what it imports
        out += [(f'roles[{k}].scheduler ({role.scheduler}): {f}', ref)
                for f, ref in inspect_file(own if os.path.isfile(own) else role.scheduler).imports]
    return out


def episode_file_problems(path: Union[str, os.PathLike], policies: Optional[Sequence[str]] = None,
                          overrides: Optional[Mapping[str, RoleOverride]] = None) -> List[Problem]:
    """Every problem of an episode file (``mtflow validate``): the schema's, then what building
    finds (a role's scheduler, the environment against its interface, the judge, the policies)."""
    try:
        load_episode_scheduler(path, policies=policies, overrides=overrides)
    except ConfigError as exc:
        return exc.problems
    except RoleError as exc:
        return [Problem(os.fspath(path), None, 'roles', str(exc))]
    return []
