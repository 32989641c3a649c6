"""The requests of episodes: one per role, made from a prompt (the task).

Each prompt becomes ``copies`` episodes (the GRPO copies of one task) and each episode one request
per role, next to each other: ``<prompt uuid>#<k>/<role>``, its messages empty (the episode gives
them, :class:`~mtflow.roles.scheduler.EpisodeScheduler`), its ``data_dict`` the prompt's plus:

* ``episode``: its place (:class:`~mtflow.roles.role.Seat`: the episode id, the role, its seat,
  its policy id, whether it is trained);
* ``group``: the prompt's group, shared by every role of every copy (a stream hands a prompt's
  episodes out together; a trainer groups advantages by ``(group, role)``);
* ``task``: the prompt's messages, which the environment's ``reset`` gets as the task.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, List, Sequence

from mtflow.core.protocol import RolloutInferRequest
from mtflow.data.sources import group_of
from mtflow.roles.role import EPISODE_KEY, Role, RoleError, Seat

__all__ = ['episode_requests', 'iter_episode_requests', 'role_uuid']


def role_uuid(episode: str, role: str) -> str:
    """The uuid of ``role``'s request in episode ``episode``."""
    return f'{episode}/{role}'


def _of(prompt: Any, k: int, copies: int, roles: Sequence[Role]) -> List[RolloutInferRequest]:
    uuid = str(getattr(prompt, 'uuid', None) or '')
    if not uuid:
        raise RoleError('every prompt of an episode needs a uuid (it names the episode and its role requests)')
    data = dict(getattr(prompt, 'data_dict', None) or {})
    group = group_of(uuid, data)
    episode = f'{uuid}#{k}' if copies > 1 else uuid
    task = [dict(m) for m in (getattr(prompt, 'messages', None) or [])]
    out = []
    for role in roles:
        seat = Seat(episode, role.name, role.seat, role.policy, role.train)
        out.append(RolloutInferRequest(messages=[], uuid=role_uuid(episode, role.name),
                                       data_dict={**data, 'group': group, 'task': task, EPISODE_KEY: seat.to_dict()}))
    return out


def iter_episode_requests(prompts: Iterable[Any], roles: Sequence[Role], copies: int = 1) -> Iterator[List[Any]]:
    """For each prompt, its episodes' role requests as one list (a stream's group: every copy of
    the prompt, each with all its roles)."""
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise RoleError(f'copies must be an int >= 1, got {copies!r}')
    for prompt in prompts:
        if getattr(getattr(prompt, 'data_dict', None), 'get', lambda _k: None)(EPISODE_KEY) is not None:
            raise RoleError(f'prompt {getattr(prompt, "uuid", None)} is a role request already (it has '
                            f'data_dict["episode"]); give the prompts, not their role requests')
        yield [request for k in range(copies) for request in _of(prompt, k, copies, roles)]


def episode_requests(prompts: Iterable[Any], roles: Sequence[Role], copies: int = 1) -> List[Any]:
    """Every role request of ``copies`` episodes of each prompt, flat, in order (for
    :meth:`mtflow.Executor.run`)."""
    return [request for group in iter_episode_requests(prompts, roles, copies) for request in group]
