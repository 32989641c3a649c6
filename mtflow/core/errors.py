"""mtflow's errors. Each one names the request (uuid), the turn and the field it is about, so that
a failure in a batch of thousands points at the one request that caused it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional


class MtflowError(Exception):
    """Base class of every error mtflow raises on purpose."""


class UserError(MtflowError):
    """A problem the user fixes: a bad config or flag, a missing file, a scheduler that does not
    import, a run directory that cannot be opened as asked. The command line prints it as the one
    line ``mtflow: <message>`` (no traceback) and exits with ``code``; the library raises a
    subclass that says which part failed, so callers outside the command line can catch it."""

    def __init__(self, message: str = '', code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class RunSetupError(UserError):
    """A run that cannot start as configured: its scheduler does not import or build, its
    backend does not start, a run option is out of range. Raised before any request runs."""


class IllegalTransition(MtflowError):
    """A move that the declared state graph does not allow."""

    def __init__(self, uuid: str, state: str, trigger: str) -> None:
        self.uuid, self.state, self.trigger = uuid, state, trigger
        super().__init__(f'request {uuid}: illegal transition {trigger!r} from state {state!r}')


class RequestError(MtflowError):
    """Something wrong with what a hook, a step or ``rollout_fn`` produced for one request."""

    def __init__(self, message: str, *, uuid: Optional[str] = None, turn: Optional[int] = None,
                 field: Optional[str] = None) -> None:
        self.uuid, self.turn, self.field, self.detail = uuid, turn, field, message
        where = [f'request {uuid}' if uuid is not None else None, f'turn {turn}' if turn is not None else None,
                 f'field {field!r}' if field else None]
        prefix = ', '.join(w for w in where if w)
        super().__init__(f'{prefix}: {message}' if prefix else message)


class SchedulerResultError(RequestError):
    """A scheduler hook returned something the contract does not allow."""


class RolloutFnError(RequestError):
    """``rollout_fn`` failed or returned the wrong number or shape of outputs."""


class ForkRefused(RequestError):
    """A request cannot be forked where a branch policy asked: what it needs cannot be copied
    (an environment that neither copies nor replays, ``docs/branching.md``). The message names what
    refused, the state and the turn; the request fails (phase ``fork``), the others go on."""


class StepTimeout(RequestError):
    """A step or a ``rollout_fn`` call ran past its deadline (``step_timeout_s`` /
    ``rollout_timeout_s``); the request finishes with reason ``timeout``."""


class DeadlockError(RequestError):
    """A request waits in its step for other requests of the run (a role of a multi-agent episode
    waiting for the others, ``docs/multi-agent.md``) and none of them can act any more: nothing
    would end its wait. The message names the episode and the turn where it knows them; the
    waiting request fails (phase ``step``) instead of hanging the run."""


@dataclass
class RequestFailure:
    """One request that finished with reason ``error``: where, when and why."""
    index: int
    uuid: str
    turn: int
    phase: str  # 'on_trajectory_start' | 'apply' | 'on_turn_end' | 'check_finished' | 'step' | 'rollout_fn' | ...
    error: BaseException
    traceback: str = ''

    def to_dict(self) -> dict:
        return {
            'index': self.index,
            'uuid': self.uuid,
            'turn': self.turn,
            'phase': self.phase,
            'type': type(self.error).__name__,
            'message': str(self.error)
        }

    def __str__(self) -> str:
        return f'request {self.uuid} (index {self.index}), turn {self.turn}, {self.phase}: ' \
               f'{type(self.error).__name__}: {self.error}'


@dataclass
class MultiTurnRolloutError(MtflowError):
    """Raised at the end of a run (never mid-run, so other ranks are never left waiting) when one or
    more requests failed. Carries every failure and every output, the failed requests' partial
    outputs included, so nothing that was already done is lost."""
    failures: List[RequestFailure]
    outputs: List[Any] = field(default_factory=list)
    result: Any = None  # the native RunResult, when raised by Executor.run

    def __post_init__(self) -> None:
        lines = [f'{len(self.failures)} of {len(self.outputs)} request(s) failed:']
        lines += [f'  - {f}' for f in self.failures[:20]]
        if len(self.failures) > 20:
            lines.append(f'  ... and {len(self.failures) - 20} more')
        super().__init__('\n'.join(lines))

    def __str__(self) -> str:
        return self.args[0]


class DuplicateUuidError(MtflowError, ValueError):
    """Two requests of one batch share a ``uuid`` (schedulers key per-request state by it)."""


class RankMismatchError(MtflowError):
    """Ranks that must see the same live set (``Executor(check_ranks=True)``) disagree: raised
    on every rank, at the same turn, instead of hanging in the engine's next collective.
    ``.result`` is this rank's ``RunResult`` (the live requests failed with this error)."""

    def __init__(self, message: str, turn: int, ranks: List[int], result: Any = None) -> None:
        super().__init__(message)
        self.turn, self.ranks, self.result = turn, ranks, result


class RolloutInterrupted(KeyboardInterrupt):
    """A ``KeyboardInterrupt`` (Ctrl-C) or ``SystemExit`` arrived inside :meth:`mtflow.Executor.run`.

    It is a ``KeyboardInterrupt`` so that code which stops on Ctrl-C still stops, but nothing is
    lost: ``.result`` is the :class:`mtflow.RunResult` so far, every request that had finished
    with its output exactly as it would have been, the others with their partial outputs and
    finish reason ``interrupted``. ``.cause`` is the original exception."""

    def __init__(self, result: Any, cause: Optional[BaseException] = None) -> None:
        self.result = result
        self.cause = cause
        done = 0 if result is None else sum(1 for r in result.finish_reasons if r != 'interrupted')
        total = 0 if result is None else len(result.finish_reasons)
        super().__init__(f'rollout interrupted: {done} of {total} request(s) had finished; '
                         f'the others finished with reason interrupted (see .result)')
