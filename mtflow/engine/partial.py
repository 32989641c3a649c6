"""Partial rollouts (async mode): the budget that stops a run early, and the requests it hands back.

They live apart from the async driver because the executor reads them too: it rejects a budget,
or a resumed request, in lockstep mode, and recognises a resumed request by its class.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional, Tuple

from mtflow.core.keys import coerce_fields
from mtflow.core.machine import RequestRecord

__all__ = ['Budget', 'Until', 'UnfinishedRequest']


class Budget:
    """What stops a run (:class:`Until`) or a stream (``mtflow.StreamUntil``) early: any of its
    counts reached, or its ``seconds`` passed, whichever comes first. A subclass names its counts
    (``COUNTS``, fields of the same names) and checks its values; a driver reports what it has
    done under the same names."""
    COUNTS: ClassVar[Tuple[str, ...]] = ()
    seconds: Optional[float]

    def seconds_left(self, elapsed: float) -> Optional[float]:
        """Seconds until the time budget runs out (``None``: no time budget)."""
        return None if self.seconds is None else max(0.0, self.seconds - elapsed)

    def met(self, done: Mapping[str, int], elapsed: float) -> bool:
        """Whether ``done`` (each count's value so far) after ``elapsed`` seconds meets the budget."""
        for name in self.COUNTS:
            bound = getattr(self, name)
            if bound is not None and done[name] >= bound:
                return True
        return self.seconds is not None and elapsed >= self.seconds


@dataclass(frozen=True)
class Until(Budget):
    """The budget of a partial rollout: stop once ``finished`` requests have finished in this
    call, or ``seconds`` have passed, whichever comes first."""
    COUNTS: ClassVar[Tuple[str, ...]] = ('finished', )
    finished: Optional[int] = None
    seconds: Optional[float] = None

    def __post_init__(self) -> None:
        if self.finished is None and self.seconds is None:
            raise ValueError('Until needs finished= (a number of requests) or seconds=')
        if self.finished is not None and (isinstance(self.finished, bool) or not isinstance(self.finished, int)
                                          or self.finished < 1):
            raise ValueError(f'Until.finished must be an int >= 1, not {self.finished!r}')
        if self.seconds is not None and (isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float))
                                         or self.seconds <= 0):
            raise ValueError(f'Until.seconds must be a number > 0, not {self.seconds!r}')

    @classmethod
    def coerce(cls, value: Any) -> Optional['Until']:
        """``None``, an :class:`Until`, or a dict like ``{'finished': 48}`` / ``{'seconds': 30}``."""
        return coerce_fields(cls, value, 'until')


class UnfinishedRequest:
    """A request a partial rollout handed back, with its machine state: pass it (in a list, in
    any position, with new requests beside it) to ``Executor.run`` to resume it.

    ``state`` is ``'pending'`` (never started), ``'generating'``/``'continuing'`` (its next
    generation was not done yet), or ``'finished'`` (a stream's group is handed back whole: a
    member that finished while the others ran comes back with its output, and resuming the
    group returns that output unchanged); ``turn`` is the turn that generation belongs to; ``request``
    is what will be sent. The record keeps the token segments, loss masks, logprobs and infos
    collected so far."""
    __slots__ = ('record', 'started')

    def __init__(self, record: RequestRecord, started: bool) -> None:
        self.record = record
        self.started = started  # on_trajectory_start already ran for it

    @property
    def uuid(self) -> str:
        return self.record.uuid

    @property
    def state(self) -> str:
        return self.record.state

    @property
    def turn(self) -> int:
        return self.record.turns + 1

    @property
    def request(self) -> Any:
        return self.record.request

    @property
    def messages(self) -> Any:  # so the request-shaped checks of the executor find them
        return self.record.request.messages

    def __repr__(self) -> str:
        return f'<UnfinishedRequest {self.uuid} {self.state} turn {self.turn}>'
