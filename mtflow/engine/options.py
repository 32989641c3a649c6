"""Every option of :class:`mtflow.Executor`, checked once.

The options are one frozen record so that a bad value is rejected when the executor is built
(with the message the caller sees today), and the drivers read values that are known to be good.
What each option means is documented on :class:`mtflow.engine.executor.Executor`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

from mtflow.core.records import FinishedRequest
from mtflow.core.types import Accounting, GatherFn
from mtflow.engine.admission import Admission
from mtflow.engine.branching import Branching
from mtflow.engine.context_budget import ContextBudget

__all__ = ['ExecutorOptions', 'OnError', 'OnFinished', 'MODES', 'DEFAULT_TURN_CAP', 'bound_of']

OnError = Literal['raise', 'return']
OnFinished = Callable[[FinishedRequest], None]

#: the drivers: every live request moves one turn together, or each request on its own
MODES = ('lockstep', 'async')

#: the safety cap on turns of a run that has no bound anywhere (``Executor(turn_cap=...)``)
DEFAULT_TURN_CAP = 1000


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_timeout(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise ValueError(f'{name} must be None or a number of seconds > 0, not {value!r}')


def bound_of(max_turns: Any) -> Optional[int]:
    """A ``max_turns`` that bounds anything: a positive int, else ``None`` (``0``, ``None``, junk)."""
    return max_turns if _is_int(max_turns) and max_turns > 0 else None


@dataclass(frozen=True)
class ExecutorOptions:
    """The executor's options besides the scheduler and the model call (``rollout_fn``,
    ``request_config``); the defaults are :class:`mtflow.Executor`'s."""
    max_turns: Optional[int] = None
    gather_fn: Optional[GatherFn] = None
    trace: bool = True
    on_error: OnError = 'raise'
    rank: int = 0
    output_cls: Optional[type] = None
    accounting: Optional[Accounting] = None
    on_finished: Optional[OnFinished] = None
    step_timeout_s: Optional[float] = 600.0
    rollout_timeout_s: Optional[float] = None
    turn_cap: int = DEFAULT_TURN_CAP
    scheduler_bounds_run: bool = True
    check_ranks: bool = False
    unique_uuids: Optional[bool] = None
    eager_coroutines: bool = True
    mode: str = 'lockstep'
    max_concurrency: Optional[int] = None
    skip_empty_calls: bool = False
    context: Optional[ContextBudget] = None
    turn_reward: Optional[Callable[..., Any]] = None
    admission: Optional[Admission] = None
    branch: Optional[Branching] = None

    def __post_init__(self) -> None:
        if self.on_error not in ('raise', 'return'):
            raise ValueError(f"on_error must be 'raise' or 'return', not {self.on_error!r}")
        if self.max_turns is not None and (not _is_int(self.max_turns) or self.max_turns < 0):
            raise ValueError(f'max_turns must be None or an int >= 0, not {self.max_turns!r}')
        if not _is_int(self.turn_cap) or self.turn_cap < 1:
            raise ValueError(f'turn_cap must be an int >= 1, not {self.turn_cap!r}')
        if self.on_finished is not None and not callable(self.on_finished):
            raise TypeError(f'on_finished must be callable, not {type(self.on_finished).__name__}')
        if self.turn_reward is not None and not callable(self.turn_reward):
            raise TypeError(f'turn_reward must be callable, not {type(self.turn_reward).__name__}')
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'lockstep' or 'async', not {self.mode!r}")
        if self.max_concurrency is not None and (not _is_int(self.max_concurrency) or self.max_concurrency < 1):
            raise ValueError(f'max_concurrency must be None or an int >= 1, not {self.max_concurrency!r}')
        if self.max_concurrency is not None and self.mode != 'async':
            raise ValueError("max_concurrency applies to mode='async' only (lockstep sends every live request "
                             'in one rollout_fn call)')
        if self.skip_empty_calls and self.gather_fn is not None:
            raise ValueError('skip_empty_calls needs a single rank (no gather_fn): with ranks, every rank calls '
                             'rollout_fn the same number of times, empty calls included')
        if self.context is not None and not isinstance(self.context, ContextBudget):
            raise TypeError(f'context must be a ContextBudget, not {type(self.context).__name__}')
        if self.context is not None and self.gather_fn is not None and (
                self.context.total_response_tokens is not None or self.context.policy != 'stop'):
            raise ValueError('a total response budget or a compaction policy needs a single rank (no gather_fn): '
                             'cut max_tokens and compactions make extra model calls on one rank only')
        if self.admission is not None and not isinstance(self.admission, Admission):
            raise TypeError(f'admission must be an Admission, not {type(self.admission).__name__}')
        if self.branch is not None and not isinstance(self.branch, Branching):
            raise TypeError(f'branch must be a Branching, not {type(self.branch).__name__}')
        _check_timeout('step_timeout_s', self.step_timeout_s)
        _check_timeout('rollout_timeout_s', self.rollout_timeout_s)

    def turn_bound(self, scheduler_max_turns: Any) -> Optional[int]:
        """The bound of every request: the smaller of the caller's ``max_turns`` and the
        scheduler's own (when it bounds the run); ``None`` when neither does (``turn_cap`` then)."""
        own = bound_of(scheduler_max_turns) if self.scheduler_bounds_run else None
        bounds = [b for b in (self.max_turns, own) if b]
        return min(bounds) if bounds else None

    def unbounded(self, scheduler_max_turns: Any) -> bool:
        """No turn bound anywhere (the run is capped at ``turn_cap``, with a warning)."""
        return not self.max_turns and bound_of(scheduler_max_turns) is None
