"""Policy versions: which weights sampled each turn.

A fully-async trainer updates the weights while rollouts go on, so one request's turns may come
from different weights. To bound or correct that off-policyness the trainer needs the version of
every sampled segment: the executor keeps one :class:`PolicyClock` (``executor.set_policy_version``),
a backend may declare its own (an int attribute ``policy_version`` on the ``rollout_fn``, which
wins: it knows which weights it loaded), and the async drivers stamp each generated turn with the
version current when its generation was issued (the older weights: a generation kept across an
update is counted as stale as its oldest tokens).

The stamps go to ``rollout_infos['policy_versions']`` (one int per generated turn, in turn order)
and, when the backend keeps a token record, onto each :class:`~mtflow.accounting.token_record.TokenTurn`
(``version``). Plain runs stamp nothing unless a version was set or declared, so their outputs
stay as they were.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional

from mtflow.accounting.token_record import RECORD_ATTR
from mtflow.core.machine import RequestRecord

__all__ = ['PolicyClock', 'VERSIONS_KEY', 'declared_version', 'stamp', 'versions_of']

#: the ``rollout_infos`` key of the per-turn versions
VERSIONS_KEY = 'policy_versions'


def declared_version(rollout_fn: Any) -> Optional[int]:
    """The version a backend declares (``rollout_fn.policy_version``, an int), or ``None``."""
    value = getattr(rollout_fn, 'policy_version', None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class PolicyClock:
    """The trainer's weights version, set from any thread; listeners (the running streams) are
    told of every change so that they can interrupt stale work at once."""

    def __init__(self) -> None:
        self.value = 0
        self.explicit = False  # set_policy_version was called: plain runs stamp their turns too
        self._lock = threading.Lock()
        self._listeners: List[Callable[[int], None]] = []

    def set(self, version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f'policy version must be an int >= 0, not {version!r}')
        with self._lock:
            if version < self.value:
                raise ValueError(f'policy version {version} is older than the current one ({self.value}); '
                                 'versions only go forward')
            self.value = version
            self.explicit = True
            listeners = list(self._listeners)
        for listener in listeners:
            listener(version)

    def current(self, rollout_fn: Any) -> int:
        declared = declared_version(rollout_fn)
        return self.value if declared is None else declared

    def active(self, rollout_fn: Any) -> bool:
        """Whether turns are stamped: a version was set, or the backend declares one."""
        return self.explicit or declared_version(rollout_fn) is not None

    def listen(self, listener: Callable[[int], None]) -> Callable[[], None]:
        """Add ``listener``; returns the call that removes it."""
        with self._lock:
            self._listeners.append(listener)

        def remove() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return remove


def stamp(rec: RequestRecord, version: int) -> None:
    """Record that the turn just generated for ``rec`` was sampled by ``version``."""
    rec.infos.setdefault(VERSIONS_KEY, []).append(version)
    record = getattr(rec.request, RECORD_ATTR, None)
    turns = getattr(record, 'turns', None)
    if turns:
        turns[-1].version = version


def versions_of(rec: RequestRecord) -> List[int]:
    """The versions of ``rec``'s generated turns so far."""
    return list(rec.infos.get(VERSIONS_KEY) or [])
