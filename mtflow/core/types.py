"""The shapes the executor works with, as ``typing.Protocol`` s (structural: nothing needs to
subclass them; ms-swift's own objects satisfy them as they are).

They name what each argument of the executor must offer, for the reader and the type checker;
the executor reads requests, choices and outputs by attribute, never by class, so duck-typed
objects (ms-swift's among them) pass through untouched.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Union, runtime_checkable

from mtflow.core.machine import RequestRecord

__all__ = ['InferRequestLike', 'ChoiceLike', 'OutputLike', 'RolloutFn', 'GatherFn', 'Accounting', 'SchedulerLike',
           'StepResult', 'TurnResult']

#: what ``step`` returns: ``infer_request`` plus optional ids, mask, logprobs, infos, trace_info
StepResult = Dict[str, Any]
#: what ``on_turn_end`` returns: optional ``done``, ``finish_reason``, ``rollout_infos``, ...
TurnResult = Mapping[str, Any]


class InferRequestLike(Protocol):
    """A request: at least a ``messages`` list (and, usually, a ``uuid``)."""
    messages: List[Dict[str, Any]]


class ChoiceLike(Protocol):
    """One sampled completion (``response.choices[0]``)."""
    message: Any
    finish_reason: Optional[str]
    token_ids: Optional[List[int]]
    logprobs: Optional[Dict[str, Any]]


class OutputLike(Protocol):
    """What ``rollout_fn`` returns per request: an object with ``.response.choices[0]``."""
    response: Any


class RolloutFn(Protocol):
    """``rollout_fn(requests, request_config) -> outputs`` (one per request, same order; may
    return an awaitable)."""

    def __call__(self, requests: List[Any], request_config: Any, /) -> Union[Sequence[Any], Awaitable[Sequence[Any]]]:
        ...


#: accelerate's ``gather_object`` convention: this rank's list in, every rank's concatenated out
GatherFn = Callable[[List[Any]], List[Any]]


@runtime_checkable
class Accounting(Protocol):
    """How a turn's messages, ids, mask and logprobs join a request's trajectory
    (:class:`mtflow.accounting.segments.ContractAccounting` is the contract's; the ms-swift integration
    passes ms-swift 4.6's). Optional: ``before_step(record, choice, turn)``."""
    name: str
    materializes: bool

    def materialize(self, records: List[RequestRecord]) -> Any:
        ...

    def restore(self, snapshots: Any) -> None:
        ...

    def append_completion(self, record: RequestRecord, completion: str) -> bool:
        ...

    def finalize(self, record: RequestRecord, choice: Any, turn_result: Mapping[str, Any]) -> None:
        ...

    def accumulate_step(self, record: RequestRecord, choice: Any, result: Any, turn: int) -> Any:
        ...


class SchedulerLike(Protocol):
    """Anything the executor can drive: ``step`` is required; ``check_finished``,
    ``on_turn_end``, ``on_trajectory_start``, ``on_trajectory_end``, ``on_request_finished``,
    ``finalize_output`` and ``max_turns`` are optional (see :class:`mtflow.Scheduler`). Each hook
    may be sync or async."""

    def step(self, infer_request: Any, response_choice: Any, current_turn: int, /) -> Any:
        ...
