"""Running totals of a run directory: what ``summary.json`` reports about the requests written.

A :class:`RunTally` is fed one finished request at a time (its trajectory line and its trace
events, as plain dicts), by the run store as it writes them and again, on ``--resume``, as it
reads back what an earlier attempt wrote. So the summary of a resumed run describes every
trajectory in the directory, and its size never depends on how many requests the run holds: it
keeps counters, not lists.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Dict, Iterable, List, Optional, Tuple

from mtflow.core.machine import CONTEXT_FULL, LENGTH_TOTAL, reason_kind
from mtflow.data.sources import group_of
from mtflow.declarative.policy import PolicyTally
from mtflow.run.reward_spread import GroupRewards

__all__ = ['RunTally', 'tool_counts', 'tool_error_kinds', 'cut_and_printed']

#: how many request errors the summary lists (the count covers all of them)
MAX_LISTED_FAILURES = 20


def _count(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, (list, tuple)):
        return len(value)
    return 0


def tool_counts(extra: Any) -> Tuple[int, int]:
    """Tool calls and tool errors of one step, from its ``trace_info`` (``docs/trace-format.md``):
    a ``calls`` list (one entry per call of this step, what the declarative scheduler writes; its
    ``tool_calls``/``tool_errors`` are then running totals and are not counted again), else
    ``tool_calls`` and ``tool_errors`` as counts or lists."""
    if not isinstance(extra, dict):
        return 0, 0
    calls = extra.get('calls')
    if isinstance(calls, list):
        errors = sum(1 for c in calls if isinstance(c, dict) and (c.get('ok') is False or c.get('error')))
        return len(calls), errors
    return _count(extra.get('tool_calls')), _count(extra.get('tool_errors'))


def tool_error_kinds(extra: Any) -> List[str]:
    """The ``error_kind`` of each failed call of one step (``calls`` in its ``trace_info``)."""
    calls = extra.get('calls') if isinstance(extra, dict) else None
    if not isinstance(calls, list):
        return []
    return [str(c.get('error_kind') or 'error') for c in calls if isinstance(c, dict) and c.get('ok') is False]


def cut_and_printed(extra: Any) -> Tuple[int, int]:
    """Calls of one step whose observation was cut to its tool's ``max_observation``, and calls
    that printed (``cut`` and ``printed_chars`` in its ``calls``, :mod:`mtflow.tools.bounds`)."""
    calls = extra.get('calls') if isinstance(extra, dict) else None
    if not isinstance(calls, list):
        return 0, 0
    entries = [c for c in calls if isinstance(c, dict)]
    return sum(1 for c in entries if c.get('cut')), sum(1 for c in entries if c.get('printed_chars'))


class RunTally:
    """Counters over the finished requests of a run (constant memory)."""

    def __init__(self) -> None:
        self.requests = 0
        self.reasons: Counter = Counter()
        self.turns: Counter = Counter()  # num_turns -> requests
        self.trace_tokens = 0
        self.trace_tool_calls = 0
        self.trace_tool_errors = 0
        self.info_tool_calls = 0
        self.info_tool_errors = 0
        self.trace_error_kinds: Counter = Counter()  # error_kind of each failed call in the trace
        self.outputs_cut = 0  # calls whose observation was cut to the tool's max_observation
        self.calls_printed = 0  # calls that printed (captured into the trace, not mtflow's stdout)
        self.info_error_kinds: Counter = Counter()  # the declarative scheduler's per-request totals
        self.reward_sum = 0.0
        self.reward_n = 0
        #: failed requests that carried a (partial) reward: left out of the mean and the groups
        self.reward_failed = 0
        self.groups = GroupRewards()  # per GRPO group: n, sums, squares, min, max
        self.errors = 0
        self.failures: List[Dict[str, Any]] = []
        self.policy = PolicyTally()  # what a YAML finish_policy did
        self.compactions: Counter = Counter()  # compactions per request (uuid -> n; docs/context.md)
        self.forked = 0  # lines of a fork's children (``parent``): a branched run (docs/branching.md)

    def add(self, record: Dict[str, Any], events: Iterable[Dict[str, Any]] = ()) -> None:
        """One finished request: its trajectory line and its trace events."""
        self.add_record(record)
        for event in events:
            self.add_event(event)

    def add_record(self, record: Dict[str, Any]) -> None:
        self.requests += 1
        self.forked += record.get('parent') is not None
        self.reasons[record.get('finish_reason')] += 1
        self.turns[int(record.get('num_turns') or 0)] += 1
        infos = record.get('rollout_infos') or {}
        if isinstance(infos, dict):
            self.policy.add(infos)
            if _count(infos.get('compactions')):
                self.compactions[str(record.get('uuid'))] = _count(infos.get('compactions'))
            self.info_tool_calls += _count(infos.get('tool_calls', infos.get('num_tool_calls')))
            self.info_tool_errors += _count(infos.get('tool_errors', infos.get('num_tool_errors')))
            kinds = infos.get('tool_error_kinds')
            if isinstance(kinds, dict):
                self.info_error_kinds.update({str(k): v for k, v in kinds.items() if isinstance(v, int)})
            reward = infos.get('reward')
            error = infos.get('mtflow_error')
            failed = isinstance(error, dict) or reason_kind(record.get('finish_reason')) == 'error'
            if isinstance(reward, (int, float)) and not isinstance(reward, bool):
                if failed:  # a partial reward of a request that did not finish: counted apart
                    self.reward_failed += 1
                else:
                    self.reward_sum += reward
                    self.reward_n += 1
                    group = record.get('group')  # lines written before the field: from the uuid
                    self.groups.add(str(group) if group is not None else group_of(str(record.get('uuid'))), reward,
                                    record.get('index'))
            if isinstance(error, dict) or record.get('finish_reason') == 'error':
                self.errors += 1
                if len(self.failures) < MAX_LISTED_FAILURES:
                    failure = dict(error) if isinstance(error, dict) else {'uuid': record.get('uuid')}
                    failure['index'] = record.get('index', failure.get('index'))
                    self.failures.append(failure)

    def add_event(self, event: Dict[str, Any]) -> None:
        tokens = event.get('tokens')
        if tokens:
            self.trace_tokens += int(tokens)
        calls, errors = tool_counts(event.get('extra'))
        self.trace_tool_calls += calls
        self.trace_tool_errors += errors
        self.trace_error_kinds.update(tool_error_kinds(event.get('extra')))
        cut, printed = cut_and_printed(event.get('extra'))
        self.outputs_cut += cut
        self.calls_printed += printed

    # ---- what the summary shows ---------------------------------------------------------------
    def tool_calls(self) -> Tuple[int, int]:
        """From the steps' ``trace_info``, else (schedulers that count tools in
        ``rollout_infos``) from the trajectories."""
        if self.trace_tool_calls:
            return self.trace_tool_calls, self.trace_tool_errors
        return self.info_tool_calls, self.info_tool_errors

    def tool_error_kinds(self) -> Dict[str, int]:
        """Failed tool calls by kind (``timeout``, ``memory``, ``exit``, ``killed``, ...), from the
        trace, else from the trajectories' ``rollout_infos['tool_error_kinds']``."""
        kinds = self.trace_error_kinds or self.info_error_kinds
        return dict(kinds.most_common())

    def turns_summary(self) -> Dict[str, Any]:
        n = sum(self.turns.values())
        if not n:
            return {'min': 0, 'mean': 0, 'max': 0, 'histogram': {}, 'multi_turn_requests': 0}
        return {
            'min': min(self.turns),
            'mean': round(sum(k * v for k, v in self.turns.items()) / n, 2),
            'max': max(self.turns),
            'histogram': {str(k): v for k, v in sorted(self.turns.items())},
            'multi_turn_requests': sum(v for k, v in self.turns.items() if k > 1),
        }

    def context_summary(self) -> Optional[Dict[str, Any]]:
        """Compactions and the context finish reasons (``None`` when the run had none of them:
        a run without a context budget has the summary it always had)."""
        full, total = self.reasons.get(CONTEXT_FULL, 0), self.reasons.get(LENGTH_TOTAL, 0)
        if not (self.compactions or full or total):
            return None
        return {'compactions': sum(self.compactions.values()), 'compacted_requests': len(self.compactions),
                'max_per_request': max(self.compactions.values(), default=0), CONTEXT_FULL: full,
                LENGTH_TOTAL: total}

    def reward_mean(self) -> Optional[float]:
        return round(self.reward_sum / self.reward_n, 4) if self.reward_n else None

    def reward_groups(self) -> Optional[Dict[str, Any]]:
        """The per-group reward spread (``num_generations`` copies of a prompt share a group:
        uuids ``<uuid>#<k>``), over every trajectory written; ``None`` without rewards."""
        return self.groups.summary()
