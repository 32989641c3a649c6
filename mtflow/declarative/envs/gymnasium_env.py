"""Gymnasium-style text environments: any object with ``reset(seed=..., options=...) ->
(observation, info)`` and ``step(action) -> (observation, reward, terminated, truncated, info)``
(a ``gymnasium.Env``, wrappers such as ``TimeLimit`` included, or a plain class with those
methods). The completion is the action; ``terminated`` and ``truncated`` stay distinct.

``reset`` gets only the keywords its signature accepts: ``seed`` (:func:`request_seed`) and
``options`` (``data_dict['env_options']`` when given), so envs without them work too.
"""
from __future__ import annotations

import inspect
import json
from typing import Any, Callable, Dict, Optional, Set, Tuple

from mtflow.core.registry import resolve_reference
from mtflow.declarative.envs.base import StepOutcome, request_seed
from mtflow.core.images import env_observation


class GymnasiumEnv:
    """Adapts one Gymnasium-style environment to the YAML scheduler's protocol."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.closed = False
        #: the wrapped environment declares that it replays exactly (a fork replays it, docs/branching.md)
        self.replayable = bool(getattr(env, 'replayable', False))

    def reset(self, infer_request: Any) -> Optional[str]:
        data = getattr(infer_request, 'data_dict', None) or {}
        kwargs: Dict[str, Any] = {'seed': request_seed(infer_request)}
        if isinstance(data.get('env_options'), dict):
            kwargs['options'] = data['env_options']
        out = self.env.reset(**_accepted(self.env.reset, kwargs))
        obs = out[0] if isinstance(out, tuple) and len(out) == 2 else out
        return env_observation(obs)

    def step(self, action: str) -> StepOutcome:
        out = self.env.step(action)
        if not (isinstance(out, tuple) and len(out) == 5):
            raise TypeError('a gym environment must return (observation, reward, terminated, truncated, info) '
                            f'from step, got {type(out).__name__}' + (f' of length {len(out)}' if isinstance(out, tuple)
                                                                      else ''))
        obs, reward, terminated, truncated, info = out
        return StepOutcome('' if obs is None else env_observation(obs), float(reward or 0.0), bool(terminated),
                           bool(truncated),
                           dict(info) if isinstance(info, dict) else {'info': info})

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            close = getattr(self.env, 'close', None)
            if callable(close):
                close()


def _accepted(fn: Callable[..., Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


#: ``(ref, base_dir, kwargs)`` of every environment checked in this process (``mtflow run`` checks
#: a config before the model loads, loads the scheduler, which checks it again, and builds its
#: factory): each is made once, by the first check, and that instance is the first environment
#: a factory hands out instead of a throwaway probe (at most one such instance per configuration
#: waits for a request; a process that only validates leaves it to the interpreter's exit)
_CHECKED: Set[Tuple[str, str, str]] = set()
_SPARE: Dict[Tuple[str, str, str], Any] = {}


class GymFactory:
    """Makes a :class:`GymnasiumEnv` per request; the first one is the instance the check made."""

    def __init__(self, make: Callable[..., Any], kwargs: Dict[str, Any], key: Tuple[str, str, str]) -> None:
        self.make, self.kwargs, self.key = make, kwargs, key

    def __call__(self) -> GymnasiumEnv:
        spare = _SPARE.pop(self.key, None)
        return GymnasiumEnv(spare if spare is not None else self.make(**self.kwargs))


def gym_factory(ref: str, kwargs: Dict[str, Any], base_dir: Optional[str] = None) -> GymFactory:
    """Resolve ``module:Class`` and check it by making one instance (bad kwargs fail at load time),
    once per process and configuration: the instance is kept for the first request."""
    make = resolve_reference(ref, base_dir)
    kwargs = dict(kwargs)
    key = (ref, str(base_dir), json.dumps(kwargs, sort_keys=True, default=repr))
    if key not in _CHECKED:
        probe = make(**kwargs)
        for method in ('reset', 'step'):
            if not callable(getattr(probe, method, None)):
                close = getattr(probe, 'close', None)
                if callable(close):
                    close()
                raise TypeError(f'{ref} has no {method}() method: not a Gymnasium-style environment')
        _CHECKED.add(key)
        _SPARE[key] = probe
    return GymFactory(make, kwargs, key)
