"""The ``rollout_fn`` of an episode run: each role's turns go to its own policy, with its own
sampling options.

A role names a policy id (:class:`~mtflow.roles.role.Role`); the run maps each id to a backend:
two servers, two adapters of one server (two backends that name different models), or one
backend for every seat (self-play). :class:`PolicyRouter` is the one ``rollout_fn`` the executor
calls: it reads each request's role (its ``data_dict['episode']``), sends the requests of one
policy together in one call (a lockstep turn batches every role of every episode that plays
that policy), with the run's request config updated by the role's ``sampling``, and puts the
outputs back in order. A request of no known role, or of a policy the router does not serve, is
an error naming it (the scheduler refuses unknown policy ids when it is built, before this).
"""
from __future__ import annotations

import asyncio
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from mtflow.core.calls import is_async_callable, wrapped_methods
from mtflow.core.errors import RolloutFnError
from mtflow.roles.role import Role, RoleError, check_roles, seat_of

__all__ = ['PolicyRouter', 'AsyncPolicyRouter', 'with_sampling']


def with_sampling(request_config: Any, sampling: Mapping[str, Any]) -> Any:
    """``request_config`` with the fields of ``sampling`` set (a copy; the run's is never changed):
    a :class:`mtflow.RequestConfig` (pydantic) or a dict."""
    if not sampling:
        return request_config
    if request_config is None:
        return dict(sampling)
    if isinstance(request_config, Mapping):
        return {**request_config, **sampling}
    copy = getattr(request_config, 'model_copy', None)
    if copy is not None:
        return copy(update=dict(sampling))
    raise RoleError(f'cannot set a role\'s sampling options on a request config of type '
                    f'{type(request_config).__name__}; use mtflow.RequestConfig or a dict')


class PolicyRouter:
    """See the module docstring. ``policies``: policy id -> backend (any ``rollout_fn``);
    ``roles``: the episode's roles (their policy ids must be among ``policies``)."""

    def __init__(self, policies: Mapping[str, Any], roles: Sequence[Role]) -> None:
        if not policies:
            raise RoleError('a policy router needs at least one policy')
        self.policies: Dict[str, Any] = dict(policies)
        self.roles = check_roles(roles, list(self.policies))
        self._async: Optional[Dict[str, Any]] = None

    # ---- which policy ----------------------------------------------------------------------------
    def role_of(self, request: Any) -> Role:
        seat = seat_of(request)
        role = self.roles.get(seat.role) if seat is not None else None
        if role is None:
            raise RolloutFnError(f'no role of this run ({", ".join(self.roles)}) in its data_dict["episode"]',
                                 uuid=getattr(request, 'uuid', None), field='data_dict.episode')
        return role

    def _calls(self, requests: Sequence[Any]) -> List[Tuple[Role, List[int]]]:
        """The calls that serve ``requests``: one per role (its policy, its sampling), in the order
        of their first request; the positions of each call's requests."""
        calls: Dict[str, Tuple[Role, List[int]]] = {}
        for k, request in enumerate(requests):
            role = self.role_of(request)
            calls.setdefault(role.name, (role, []))[1].append(k)
        return list(calls.values())

    # ---- the rollout_fn --------------------------------------------------------------------------
    def __call__(self, requests: List[Any], request_config: Any = None) -> List[Any]:
        if not requests:
            return []
        outputs: List[Any] = [None] * len(requests)
        for role, positions in self._calls(requests):
            answers = self.policies[role.policy]([requests[k] for k in positions],
                                                 with_sampling(request_config, role.sampling))
            if hasattr(answers, '__await__'):
                raise RolloutFnError(f'policy {role.policy!r} is async: use the router\'s async_rollout_fn() '
                                     f'(async mode and streams)', field='rollout_fn')
            _place(outputs, positions, answers, role)
        return outputs

    def async_rollout_fn(self) -> 'AsyncPolicyRouter':
        """The router for async mode and streams: each policy's own async ``rollout_fn`` (its
        ``async_rollout_fn()``: an engine's concurrent path, or a dynamic batcher over its batch
        calls), made once."""
        if self._async is None:
            self._async = AsyncPolicyRouter(
                {pid: (fn.async_rollout_fn() if callable(getattr(fn, 'async_rollout_fn', None)) else fn)
                 for pid, fn in self.policies.items()}, list(self.roles.values()))
        return self._async

    # ---- what a run reads of its backend --------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The ``default`` policy's tokenizer (else the first policy's that has one)."""
        ordered = sorted(self.policies.items(), key=lambda item: item[0] != 'default')
        return next((t for _, fn in ordered if (t := getattr(fn, 'tokenizer', None)) is not None), None)

    @property
    def tokenizers(self) -> Dict[str, Any]:
        """Each policy's tokenizer (a role's own scheduler counts with its policy's)."""
        return {pid: getattr(fn, 'tokenizer', None) for pid, fn in self.policies.items()}

    @property
    def stats(self) -> Any:
        """The policies' counters added up (``None`` when none keeps any)."""
        found = [st for fn in self.policies.values() if (st := getattr(fn, 'stats', None)) is not None]
        return _Summed(found) if found else None

    def describe(self) -> str:
        parts = []
        for pid, fn in self.policies.items():
            describe = getattr(fn, 'describe', None)
            parts.append(f'{pid}: {(describe() if callable(describe) else None) or type(fn).__name__}')
        return 'policies ' + '; '.join(parts)

    # ---- what a backend keeps per request --------------------------------------------------------
    def forget(self, uuid: str) -> None:
        """Request ``uuid`` is final: every policy that keeps per-request state forgets it."""
        for fn in self.policies.values():
            for forget in wrapped_methods(fn, 'forget'):
                forget(uuid)

    def close(self) -> None:
        """Close every policy's backend (and the async router's batchers)."""
        for fn in list(self.policies.values()) + (list(self._async.policies.values()) if self._async else []):
            close = getattr(fn, 'close', None)
            if callable(close):
                close()


class AsyncPolicyRouter(PolicyRouter):
    """:class:`PolicyRouter` over async ``rollout_fn`` s (or sync ones, run in a thread): the calls
    of one turn's policies run at once."""

    async def __call__(self, requests: List[Any], request_config: Any = None) -> List[Any]:  # type: ignore[override]
        if not requests:
            return []
        calls = self._calls(requests)

        async def one(role: Role, positions: List[int]) -> Any:
            fn = self.policies[role.policy]
            args = ([requests[k] for k in positions], with_sampling(request_config, role.sampling))
            result = fn(*args) if is_async_callable(fn) else await asyncio.to_thread(fn, *args)
            return await result if hasattr(result, '__await__') else result

        outputs: List[Any] = [None] * len(requests)
        for (role, positions), answers in zip(calls, await asyncio.gather(*(one(r, p) for r, p in calls))):
            _place(outputs, positions, answers, role)
        return outputs

    def async_rollout_fn(self) -> 'AsyncPolicyRouter':
        return self


class _Summed:
    """Several backends' counters read as one (each attribute the sum of theirs)."""

    def __init__(self, parts: List[Any]) -> None:
        self._parts = parts

    def __getattr__(self, name: str) -> Any:
        values = [getattr(p, name) for p in self._parts if isinstance(getattr(p, name, None), (int, float))]
        if not values:
            raise AttributeError(name)
        return sum(values)


def _place(outputs: List[Any], positions: List[int], answers: Any, role: Role) -> None:
    answers = list(answers)
    if len(answers) != len(positions):
        raise RolloutFnError(f'policy {role.policy!r} returned {len(answers)} output(s) for {len(positions)} '
                             f'request(s) of role {role.name!r}', field='outputs')
    for k, answer in zip(positions, answers):
        outputs[k] = answer
