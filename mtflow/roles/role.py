"""A role of a multi-agent episode, and where a request says which role of which episode it plays.

A role is declared once (:class:`Role`): its name, the seat the environment knows it by, the
policy that plays it (a policy id the run maps to a backend: two servers, two adapters, or one
model for every seat in self-play), its own sampling options, whether its trajectory is trained,
its own scheduler (tools, parsers: its turns inside one action) or none, and a system prompt
(a user simulator's persona). Each role instance of an episode is one request; its
``data_dict['episode']`` (:class:`Seat`) links it to its episode and is what the router, the
records and the trainer read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

from pydantic import ValidationError

from mtflow.core.errors import UserError
from mtflow.core.keys import unknown_key_message
from mtflow.core.protocol import RequestConfig

__all__ = ['Role', 'Seat', 'RoleError', 'self_play', 'seat_of', 'EPISODE_KEY', 'DEFAULT_POLICY', 'check_roles']

#: the ``data_dict`` key (and the ``rollout_infos`` key) of a role request's place in its episode
EPISODE_KEY = 'episode'
#: the policy of a role that names none: the run's own backend
DEFAULT_POLICY = 'default'


class RoleError(UserError):
    """Roles declared wrong (a duplicate name, an unknown policy id, a seat twice), or a request
    that is no role of an episode: refused when the episode scheduler is built, naming the role."""


@dataclass(frozen=True)
class Role:
    """One role of an episode (see the module docstring).

    Args:
        name: unique within the episode; the environment's key for it.
        seat: what the environment calls it, when not ``name`` (textarena's player ids 0, 1, ...).
        policy: the policy id that plays it (default: the run's backend, ``'default'``).
        sampling: request-config fields for its turns only (``temperature``, ``max_tokens``, ...).
        train: whether its trajectory is trained (a judge's and a user simulator's are not).
        scheduler: its own scheduler (tools, parsers, stop rules: its turns within one action),
            or ``None``: each of its turns is an action and the environment gives its observations.
        system: a system prompt opening its conversation (a persona).
    """
    name: str
    seat: Any = None
    policy: str = DEFAULT_POLICY
    sampling: Mapping[str, Any] = field(default_factory=dict)
    train: bool = True
    scheduler: Any = None
    system: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or '/' in self.name:
            raise RoleError(f'a role name must be a non-empty string without "/", got {self.name!r}')
        if not isinstance(self.policy, str) or not self.policy:
            raise RoleError(f'role {self.name!r}: policy must be a non-empty string (a policy id), got {self.policy!r}')
        if not isinstance(self.sampling, Mapping):
            raise RoleError(f'role {self.name!r}: sampling must be a mapping of request-config fields, '
                            f'got {type(self.sampling).__name__}')
        _check_sampling(self.name, self.sampling)
        if not isinstance(self.train, bool):
            raise RoleError(f'role {self.name!r}: train must be true or false, got {self.train!r}')

    @property
    def env_seat(self) -> Any:
        """The environment's name for this role: its ``seat``, else its name."""
        return self.name if self.seat is None else self.seat


def _check_sampling(role: str, sampling: Mapping[str, Any]) -> None:
    """A role's sampling options are request-config fields of the right types (an unknown key
    would be dropped without a word when the options are merged into a call's config)."""
    unknown = [k for k in sampling if k not in RequestConfig.model_fields]
    if unknown:
        raise RoleError(f'role {role!r}: sampling: ' + '; '.join(unknown_key_message(str(k), RequestConfig.model_fields)
                                                               for k in unknown))
    try:
        RequestConfig(**dict(sampling))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise RoleError(f'role {role!r}: sampling.{".".join(map(str, first["loc"]))}: {first["msg"]} '
                        f'(got {first.get("input")!r})') from None


def check_roles(roles: Sequence[Role], policies: Optional[Sequence[str]] = None) -> Dict[str, Role]:
    """``roles`` by name, checked: at least one, names and seats unique, every policy id among
    ``policies`` when given (an unknown one refused here, at load, never at the first turn)."""
    if not roles:
        raise RoleError('an episode needs at least one role')
    by_name: Dict[str, Role] = {}
    seats: Dict[Any, str] = {}
    for role in roles:
        if not isinstance(role, Role):
            raise RoleError(f'roles must be Role objects, got {type(role).__name__}')
        if role.name in by_name:
            raise RoleError(f'role {role.name!r} is declared twice')
        if role.env_seat in seats:
            raise RoleError(f'roles {seats[role.env_seat]!r} and {role.name!r} have the same seat {role.env_seat!r}')
        by_name[role.name] = role
        seats[role.env_seat] = role.name
    if policies is not None:
        known = list(policies)
        for role in roles:
            if role.policy not in known:
                raise RoleError(f'role {role.name!r}: unknown policy id {role.policy!r}; the policies are: '
                                f'{", ".join(map(repr, known)) or "(none)"}')
    return by_name


def self_play(policy: str = DEFAULT_POLICY, seats: int = 2, name: str = 'player', **options: Any) -> List[Role]:
    """One policy in every seat (self-play): roles ``player_0 .. player_{n-1}`` on seats ``0 ..
    n-1``, each its own trajectory; ``options`` (``sampling``, ``train``, ``scheduler``, ``system``)
    for every one of them."""
    if not isinstance(seats, int) or isinstance(seats, bool) or seats < 1:
        raise RoleError(f'self_play: seats must be an int >= 1, got {seats!r}')
    return [Role(f'{name}_{k}', seat=k, policy=policy, **options) for k in range(seats)]


@dataclass(frozen=True)
class Seat:
    """A role request's place in its episode (its ``data_dict['episode']``): the episode id, the
    role, the environment's seat, the policy id, whether it is trained, and which copy of its
    prompt the episode is."""
    episode: str
    role: str
    seat: Any
    policy: str
    train: bool = True

    def to_dict(self) -> Dict[str, Any]:
        return {'id': self.episode, 'role': self.role, 'seat': self.seat, 'policy': self.policy, 'train': self.train}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> 'Seat':
        return cls(str(data['id']), str(data['role']), data.get('seat'), str(data.get('policy', DEFAULT_POLICY)),
                   bool(data.get('train', True)))


def seat_of(request: Any) -> Optional[Seat]:
    """The episode place a request carries in ``data_dict['episode']``, or ``None`` (no role)."""
    data = getattr(request, 'data_dict', None)
    place = data.get(EPISODE_KEY) if isinstance(data, dict) else None
    if not isinstance(place, Mapping) or 'id' not in place or 'role' not in place:
        return None
    return Seat.from_dict(place)
