"""The one message for a key that is not known, used by every config of mtflow (scheduler YAML,
run configs, ``scheduler_args``, ``request_config``): the key, the closest known key, and every
known key, so a typo is fixed from the message alone; and :class:`StrictModel`, the base of the
config blocks whose unknown keys are errors."""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Iterable, List, Mapping, Optional, Type, TypeVar

from pydantic import BaseModel, ConfigDict

__all__ = ['closest_key', 'unknown_key_message', 'StrictModel', 'coerce_fields']

R = TypeVar('R')


class StrictModel(BaseModel):
    """A block a user writes in a config file (the scheduler YAML's sections, the run config and
    its ``admission:`` and ``context:`` blocks, a ``finish_policy`` action): an unknown key is an
    error (the loaders report it with :func:`unknown_key_message`, at its file, line and field),
    and types are strict: ``true`` is not 1, ``"3"`` is not 3."""
    model_config = ConfigDict(extra='forbid', strict=True)


def closest_key(key: str, known: Iterable[str]) -> Optional[str]:
    """The known key ``key`` most likely misspells (``max_turn`` -> ``max_turns``, ``gymnasium``
    -> ``gym``), or ``None``."""
    names: List[str] = [str(k) for k in known]
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    if close:
        return close[0]
    lowered = str(key).lower()
    prefixed = [k for k in names if len(k) >= 3 and (lowered.startswith(k.lower()) or k.lower().startswith(lowered))]
    if prefixed:
        return max(prefixed, key=len)
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
    return close[0] if close else None


def unknown_key_message(key: str, known: Iterable[str], what: str = '') -> str:
    """``unknown key 'max_session'[ for <what>]; did you mean 'max_sessions'? (known: ...)``."""
    names = [str(k) for k in known]
    close = closest_key(key, names)
    return (f'unknown key {str(key)!r}' + (f' for {what}' if what else '')
            + (f'; did you mean {close!r}?' if close else '') + f' (known: {", ".join(names)})')


def coerce_fields(cls: Type[R], value: Any, what: str) -> Optional[R]:
    """``value`` as a ``cls`` (a dataclass of options, such as ``Until`` or ``Branching``):
    ``None``, an instance, or a mapping of its fields (``{'groups': 8}``); an unknown key names the
    closest field (:func:`unknown_key_message`), and ``what`` names the option."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        for key in value:
            if key not in names:
                raise ValueError(f'{what}: {unknown_key_message(key, names)}')
        return cls(**value)
    raise TypeError(f'{what} must be None, a {cls.__name__}(...) or a dict of its fields, not {type(value).__name__}')
