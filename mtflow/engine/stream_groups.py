"""The groups of a stream: what is in flight (:class:`InFlightGroup`) and what is handed out
(:class:`StreamGroup`), with the one place a finished group becomes a delivered one.

Split from :mod:`mtflow.engine.stream` so that the driver, the staleness policy
(:mod:`mtflow.engine.staleness`) and the consumer side share the group shapes without importing
each other.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from mtflow.core.errors import RequestFailure
from mtflow.core.machine import RequestRecord
from mtflow.core.protocol import generated_tokens
from mtflow.core.trace import TraceEvent
from mtflow.engine.run_state import RunState
from mtflow.engine.versions import versions_of

__all__ = ['StreamGroup', 'InFlightGroup', 'fresh_copy', 'span_and_age', 'delivered_group', 'completion_tokens']


@dataclass
class StreamGroup:
    """One delivered group (a request alone is a group of one), members in source order.

    ``versions[k]`` are member ``k``'s per-turn policy versions; ``version_span`` is the newest
    minus the oldest of all of them, ``age`` the version at delivery minus the oldest (``0`` when
    nothing was generated); ``restarts``: how often staleness restarted it."""
    seq: int
    uuids: List[str]
    outputs: List[Any]
    finish_reasons: List[Optional[str]]
    requests: List[Any]
    events: List[List[TraceEvent]]
    failures: List[RequestFailure]
    versions: List[List[int]]
    version: int
    version_span: int
    age: int
    tokens: int
    restarts: int = 0
    #: fresh copies of the members' prompts (a group found stale when taken starts again from them)
    prompts: List[Any] = field(default_factory=list, repr=False)
    #: a branched stream's trees (``docs/branching.md``): one per prompt of the group; its members
    #: are every leaf (the prompts' records, then each fork's children as they were born)
    trees: List[Dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def output(self) -> Any:
        """The output of a group of one."""
        if len(self.outputs) != 1:
            raise ValueError(f'group {self.seq} has {len(self.outputs)} outputs; read .outputs')
        return self.outputs[0]


@dataclass
class InFlightGroup:
    """A group in flight: its records, the prompts it restarts from, what is finished."""
    seq: int
    prompts: List[Any]
    records: List[RequestRecord] = field(default_factory=list)
    done: int = 0
    tokens: int = 0
    restarts: int = 0
    doomed: bool = False  # too stale to deliver: being wound down


def fresh_copy(request: Any) -> Any:
    """A copy of a request before its first turn (messages are extended in place)."""
    copier = getattr(request, 'model_copy', None)
    return copier(deep=True) if callable(copier) else copy.deepcopy(request)


def span_and_age(versions: List[List[int]], current: int) -> Tuple[int, int]:
    """``(version_span, age)`` of a group's per-member versions at version ``current``: newest
    minus oldest, and ``current`` minus oldest (both ``0`` when nothing was generated)."""
    flat = [v for vs in versions for v in vs]
    if not flat:
        return 0, 0
    return max(flat) - min(flat), current - min(flat)


def delivered_group(run: RunState, group: InFlightGroup, current: int) -> StreamGroup:
    """The :class:`StreamGroup` of a finished group (its failures leave the run's list)."""
    versions = [versions_of(rec) for rec in group.records]
    rank = run.options.rank
    events = [[TraceEvent(rec.uuid, i, rank, t, src, dst, trig, reason, tokens, dur, ts, extra)
               for (i, t, src, dst, trig, reason, tokens, dur, ts, extra) in (rec.events or [])]
              for rec in group.records]
    uuids = {rec.uuid for rec in group.records}
    failures = [f for f in run.failures if f.uuid in uuids]
    if failures:
        run.failures = [f for f in run.failures if f.uuid not in uuids]
    span, age = span_and_age(versions, current)
    return StreamGroup(
        seq=group.seq, uuids=[r.uuid for r in group.records], outputs=[r.output for r in group.records],
        finish_reasons=[r.reason for r in group.records], requests=[r.request for r in group.records],
        events=events, failures=failures, versions=versions, version=current,
        version_span=span, age=age, tokens=group.tokens, restarts=group.restarts, prompts=group.prompts)


def completion_tokens(outputs: Any) -> int:
    """Completion tokens of a one-request ``rollout_fn`` result (:func:`~mtflow.core.protocol.generated_tokens`)."""
    try:
        output = outputs[0]
        response = getattr(output, 'response', output)
        return generated_tokens(response, response.choices[0])
    except Exception:  # an output the handlers will reject anyway
        return 0
