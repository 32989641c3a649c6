"""``mtflow run`` of an episode file (a scheduler YAML with ``roles:``, ``docs/multi-agent.md``).

What a run of episodes needs beside any run: the policies (the run's own backend is the policy
``default``, each ``policies:`` entry another backend) behind one
:class:`~mtflow.roles.router.PolicyRouter`, the episode scheduler built with them (an unknown
policy id refused before anything loads), and the prompts turned into episodes: each prompt (each
of its ``num_generations`` copies) one episode, one request per role, kept together in one batch
(and one stream group per prompt). Every check here is one line naming the file, the line and the
field.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

from mtflow.core.errors import RunSetupError, UserError
from mtflow.declarative.loader import ConfigError
from mtflow.roles.config import (EpisodeConfig, episode_file_problems, episode_roles, is_episode_file,
                                 load_episode_scheduler, read_episode_file)
from mtflow.roles.requests import iter_episode_requests
from mtflow.roles.role import Role, RoleError
from mtflow.roles.router import PolicyRouter, with_sampling
from mtflow.backends.base import SamplingError, sampling_options
from mtflow.run.config import RunConfig

__all__ = ['episode_file', 'episode_problems', 'episode_run_roles', 'episode_size', 'build_policies', 'make_episode_scheduler',
           'as_episodes']


def episode_file(cfg: RunConfig) -> Optional[Path]:
    """The run's scheduler file when it is an episode file, else ``None``."""
    if not cfg.scheduler_is_yaml():
        return None
    path = cfg.scheduler_path()
    return path if path.is_file() and is_episode_file(path) else None


def episode_problems(cfg: RunConfig) -> List[str]:
    """Every problem of the run config's ``policies:``/``roles:`` and of its episode file (one line
    each): those keys without an episode file, a role the file does not have, an unknown policy id
    (the run config's at its line, the file's at its own)."""
    path = episode_file(cfg)
    if path is None:
        return [f'{cfg.where(key)}: {key} applies to an episode file (a scheduler with roles:, docs/multi-agent.md); '
                f'{cfg.scheduler} has no roles' for key in ('policies', 'roles') if getattr(cfg, key)]
    config, _, problems = read_episode_file(str(path))
    if problems or config is None:
        return [str(p) for p in problems]
    names = {r.name for r in config.roles} | {f'{r.name}_{k}' for r in config.roles for k in range(r.seats or 0)}
    out = []
    for name, change in cfg.roles.items():
        if name not in names:
            out.append(f'{cfg.where(f"roles.{name}")}: {path} has no role {name!r} (its roles: '
                       f'{", ".join(sorted(names))})')
        elif change.policy is not None and change.policy not in cfg.policy_ids():
            out.append(f'{cfg.where(f"roles.{name}")}.policy: unknown policy id {change.policy!r}; the run serves: '
                       f'{", ".join(map(repr, cfg.policy_ids()))}')
        elif change.sampling:  # checked here, at the run config's line (the file's roles have none of it)
            try:
                Role(name, sampling=change.sampling)
            except RoleError as exc:
                out.append(f'{cfg.where(f"roles.{name}")}: {exc}')
    if out:
        return out
    problems = [str(p) for p in episode_file_problems(path, cfg.policy_ids(), cfg.roles)]
    if not problems:  # a policy no role plays would never be built: the run would go on without it
        played = {role.name: role.policy for role in episode_roles(config, cfg.roles)}
        problems = [f'{cfg.where(f"policies.{policy}")}: no role plays policy {policy!r} (the roles play: '
                    f'{", ".join(f"{name}: {p}" for name, p in played.items())}); name it as a role\'s policy '
                    f'(roles: {{<role>: {{policy: {policy}}}}}) or remove it'
                    for policy in cfg.policies if policy not in played.values()]
    if not problems:  # each role's sampling options within the engines' bounds, merged as the router merges them
        for role in episode_roles(config, cfg.roles):
            try:
                sampling_options(with_sampling(cfg.make_request_config(), role.sampling), default_max_tokens=1)
            except SamplingError as exc:
                change = cfg.roles.get(role.name)
                where = (cfg.where(f'roles.{role.name}') if change is not None and change.sampling
                         else f'{path}: roles: {role.name}')
                problems.append(f'{where}: sampling.{exc.field} {exc.why}')
    return problems


def _config(cfg: RunConfig) -> EpisodeConfig:
    config, _, problems = read_episode_file(str(episode_file(cfg)))
    if problems or config is None:
        raise RunSetupError('\n'.join(map(str, problems)))
    return config


def episode_run_roles(cfg: RunConfig) -> List[Role]:
    """The roles of the run's episode file with the run config's changes (their own schedulers
    not built: what the router and the expansion of prompts need)."""
    return episode_roles(_config(cfg), cfg.roles)


def episode_size(cfg: RunConfig) -> int:
    """Requests per prompt copy: the episode file's roles (a run of no episodes: 1)."""
    return len(episode_run_roles(cfg)) if episode_file(cfg) is not None else 1


def build_policies(cfg: RunConfig, build: Callable[[RunConfig], Any]) -> PolicyRouter:
    """A backend for each policy a role plays (``build(config)``: the run's backend builder, on
    the run config with that policy's backend in place), behind one router."""
    roles = episode_run_roles(cfg)
    used = list(dict.fromkeys(r.policy for r in roles))
    policies: Dict[str, Any] = {}
    try:
        for policy in used:
            policies[policy] = build(cfg.for_policy(policy))
    except BaseException:
        for backend in policies.values():
            close = getattr(backend, 'close', None)
            if callable(close):
                close()
        raise
    return PolicyRouter(policies, roles)


def make_episode_scheduler(cfg: RunConfig, tokenizer: Any) -> Any:
    """The episode scheduler of the run (``tokenizer``: a tokenizer, or one per policy: each role's
    own YAML scheduler counts with its policy's)."""
    try:
        return load_episode_scheduler(episode_file(cfg), policies=cfg.policy_ids(), overrides=cfg.roles,
                                      tokenizer=tokenizer)
    except ConfigError as exc:
        raise RunSetupError('\n'.join(map(str, exc.problems))) from None
    except (RoleError, UserError) as exc:
        raise RunSetupError(f'{cfg.where("scheduler")}: {exc}') from None


def as_episodes(prompts: Iterable[Any], roles: List[Role]) -> Iterator[List[Any]]:
    """Each prompt (each ``num_generations`` copy already a prompt of its own) as one episode: its
    role requests, together."""
    return iter_episode_requests(prompts, roles, copies=1)
