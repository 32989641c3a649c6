"""The stop decision: the one rule that says whether a request finishes after a turn, and why.

It is used by the executor, by the ms-swift adapter (``mtflow.integrations.swift``, which must
predict ms-swift's driver), by the YAML scheduler's ``max_turns`` rule and by
:meth:`mtflow.Scheduler.check_finished`, so that the four can never drift apart.

ms-swift's driver decides, per request and turn::

    stop = turn_result['done'] if 'done' in turn_result else check_finished(...)
    stop = stop or (max_turns and turn >= max_turns)

:func:`decide_stop` is exactly that, with the finish reason mtflow reports for each branch.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

from mtflow.core.machine import CHECK_FINISHED, DONE_BY_HOOK, LENGTH, MAX_TURNS, REPLAY_DIVERGED

__all__ = ['default_check', 'decide_stop', 'turn_limit_reached', 'output_finish', 'OUTPUT_FINISH_REASONS',
           'MAX_TURNS_BOUND']

#: the largest ``max_turns`` a config may set (a run config, a scheduler file): beyond it the
#: value is a typo (``1000000000000``) that makes the progress bound and the ETA meaningless;
#: unlimited is ``null`` (or ``0`` in a run config)
MAX_TURNS_BOUND = 100_000

#: finish reasons a model output carries itself (``choice.finish_reason``) that end its request
#: before the output is applied or any hook sees it: the replay backend's ``replay_diverged``
OUTPUT_FINISH_REASONS = frozenset((REPLAY_DIVERGED, ))


def output_finish(choice_finish_reason: Optional[str]) -> Optional[str]:
    """The finish reason when an output ends its request by itself (see
    :data:`OUTPUT_FINISH_REASONS`), else ``None``."""
    return choice_finish_reason if choice_finish_reason in OUTPUT_FINISH_REASONS else None


def turn_limit_reached(turn: int, max_turns: Optional[int]) -> bool:
    """Whether ``turn`` reached the bound ``max_turns`` (``None`` or ``0``: no bound)."""
    return bool(max_turns) and turn >= max_turns  # type: ignore[operator]


def default_check(choice_finish_reason: Optional[str], turn: int, max_turns: Optional[int]) -> Tuple[bool, str]:
    """ms-swift's (and mtflow's) default ``check_finished``, with its reason: the output hit the
    length limit (``length``), or the scheduler's own ``max_turns`` (``max_turns``)."""
    if choice_finish_reason == 'length':
        return True, LENGTH
    if max_turns and turn >= max_turns:  # turn_limit_reached, inlined (hot path)
        return True, MAX_TURNS
    return False, CHECK_FINISHED


def decide_stop(turn_result: Optional[Mapping[str, Any]],
                checked: bool,
                check_reason: str,
                turn: int,
                max_turns: Optional[int],
                limit_reason: str = MAX_TURNS) -> Tuple[bool, str]:
    """``(stop, reason)`` for one request after one turn.

    - ``turn_result`` (what ``on_turn_end`` returned, already validated): a ``done`` key wins
      over ``check_finished``; its reason is the hook's ``finish_reason`` (an mtflow extension,
      e.g. ``stop_rule:<name>``) or ``done_by_hook``;
    - otherwise ``checked`` (the result of ``check_finished``) with ``check_reason``;
    - then the bound: a request still going at ``max_turns`` stops with ``limit_reason``.

    The reason of a request that does not stop is meaningless (it is not recorded)."""
    if turn_result is not None and 'done' in turn_result:
        stop = bool(turn_result['done'])
        reason = turn_result.get('finish_reason') or DONE_BY_HOOK
    else:
        stop, reason = checked, check_reason
    if not stop and max_turns and turn >= max_turns:  # turn_limit_reached, inlined (hot path)
        return True, limit_reason
    return stop, reason
