"""The executor: the public face that runs a scheduler over a batch of requests.

:class:`Executor` checks its options once (:class:`~mtflow.engine.options.ExecutorOptions`),
resolves what depends on the scheduler (its hooks, its state graph, the accounting), and for each
:meth:`Executor.run` builds the run's state and hands it to a driver: lockstep
(:mod:`mtflow.engine.lockstep`, every live request moves one turn together) or async
(:mod:`mtflow.engine.async_driver`, every request on its own). Both drivers call the same
per-state handlers (:mod:`mtflow.engine.handlers`) and carry out their moves the same way
(:mod:`mtflow.engine.moves`); ``docs/executor.md`` walks through a turn.

The drivers are synchronous, like ms-swift's: ``rollout_fn`` and sync hooks run outside any event
loop (engines that start their own loop keep working); async hooks are driven directly and, if
they suspend, on a private event loop (:mod:`mtflow.core.calls`). Every step has a deadline.

A failure in one request (a hook or step raising or missing its deadline, a bad result, a bad
output) finishes that request (reason ``error`` or ``timeout``); the others go on, every rank
stays in step, and the failures are raised together at the end (``on_error='raise'``, with every
output attached) or returned (``on_error='return'``). A ``KeyboardInterrupt`` raises
:class:`mtflow.RolloutInterrupted` carrying every output.
"""
from __future__ import annotations

import asyncio
import warnings
from dataclasses import fields
from typing import Any, AsyncIterator, Callable, List, Optional, Sequence

from mtflow.core.errors import (DuplicateUuidError, MultiTurnRolloutError, RankMismatchError, RolloutInterrupted)
from mtflow.core.scheduler import HookSet
from mtflow.core.types import Accounting, GatherFn, RolloutFn, SchedulerLike
from mtflow.accounting.choose import accounting_for
from mtflow.accounting.token_record import native_accounting
from mtflow.engine.admission import Admission
from mtflow.engine.async_driver import AsyncDriver
from mtflow.engine.branching import Branching
from mtflow.engine.context import resolve_context
from mtflow.engine.context_budget import ContextBudget
from mtflow.engine.driver import Driver
from mtflow.engine.lockstep import LockstepDriver
from mtflow.engine.options import DEFAULT_TURN_CAP, ExecutorOptions, OnError, OnFinished
from mtflow.engine.partial import UnfinishedRequest, Until
from mtflow.engine.result import RunResult
from mtflow.engine.run_state import RunSettings, RunState
from mtflow.engine.stream import Stream, StreamGroup, aiter_stream, open_stream
from mtflow.engine.versions import PolicyClock

__all__ = ['Executor', 'RunResult', 'RankMismatchError', 'DuplicateUuidError', 'run_multi_turn', 'identity_gather',
           'DEFAULT_TURN_CAP']

#: the keyword options of :class:`Executor`, declared once, by :class:`ExecutorOptions` (a test
#: checks that the signature names exactly these)
OPTION_NAMES = tuple(f.name for f in fields(ExecutorOptions))


def identity_gather(values: List[Any]) -> List[Any]:
    """The single-process ``gather_fn``: every rank's contribution is this rank's."""
    return list(values)


class Executor:
    """Runs a scheduler over a batch of requests with ``rollout_fn`` as the model.

    Args:
        scheduler: an :class:`mtflow.Scheduler`, an ms-swift ``MultiTurnScheduler``, or any object
            with ``step`` (and optionally ``check_finished``, ``on_turn_end``,
            ``on_trajectory_start``, ``on_trajectory_end``, ``on_request_finished``,
            ``finalize_output``), each sync or async.
        rollout_fn: ``rollout_fn(requests, request_config) -> outputs`` (one per request, same
            order; may return an awaitable).
        request_config: passed to every ``rollout_fn`` call.
        max_turns: stop every request at this turn; ``None`` or ``0``: no bound of its own.
        gather_fn: accelerate's ``gather_object`` convention (list in, concatenation out).
        trace: record every transition (``Executor.run`` returns it); ``False`` turns it off.
        on_error: ``'raise'`` one :class:`MultiTurnRolloutError` at the end if any request failed
            (it carries all failures and all outputs), or ``'return'`` them in the result.
        rank: written into trace events.
        output_cls: the class of the outputs built; default: the class of the first-turn outputs
            (so an ms-swift caller gets ms-swift's ``RolloutOutput``), else mtflow's.
        accounting: how ids/masks/logprobs accumulate (default:
            :func:`mtflow.accounting.token_record.native_accounting`: every turn's exact ids from
            the token record when the backend keeps one (``hf``, ``vllm``, ``openai`` in token
            mode), ms-swift 4.6's rules for schedulers that keep assistant messages as token ids,
            else the contract's; :func:`run_multi_turn` defaults to the contract's).
        on_finished: called once per request, in the driver's thread, the moment its output is
            final (every finish path), with a :class:`mtflow.FinishedRequest`. An exception it
            raises becomes that request's failure (phase ``on_finished``), never swallowed.
        step_timeout_s: the deadline of each ``step``, ``on_turn_end``, async ``check_finished``
            and ``on_trajectory_start`` call (``None``: none). Past it the request finishes with
            reason ``timeout``: an async call is cancelled, a sync call's thread is abandoned as
            a daemon (sync calls run in a worker thread when a deadline is set).
        rollout_timeout_s: the deadline of one ``rollout_fn`` call (``None``: none, and
            ``rollout_fn`` runs in the driver's thread). A call past it finishes the requests it
            served with reason ``timeout``.
        turn_cap: the safety cap of a run with no turn bound anywhere (finish reason
            ``turn_cap``, with a warning when such a run starts).
        scheduler_bounds_run: the scheduler's own ``max_turns`` bounds the run whatever hooks it
            overrides (the native API); :func:`run_multi_turn` turns it off, as in ms-swift,
            where only the caller's ``max_turns`` bounds the driver.
        unique_uuids: reject duplicate uuids in a batch: every later copy fails before the first
            turn with a :class:`DuplicateUuidError` naming both indexes (the first copy runs, the
            ranks stay in step). ``None`` (default): when the scheduler declares
            ``requires_unique_uuids = True`` (schedulers that key per-request state by uuid, e.g.
            the YAML scheduler and the ms-swift adapter).
        check_ranks: every turn, gather a fingerprint of each rank's live set and raise
            :class:`RankMismatchError` on every rank when they differ (for ranks that must hold
            the same requests, e.g. a tensor-parallel group). ``gather_fn`` must carry tuples
            (``accelerate.utils.gather_object`` does).
        eager_coroutines: drive async hooks directly until they first suspend (fast); ``False``
            gives each its own task from the start.
        mode: ``'lockstep'`` (default: every live request moves one turn together, the contract's
            driver) or ``'async'``: every request advances on its own, ``rollout_fn`` called with
            one-request lists concurrently (:mod:`mtflow.engine.async_driver`, ``docs/executor.md``).
        max_concurrency: async mode: the most requests in flight at once (admitted and not
            finished; so also the most ``rollout_fn`` calls in flight); ``None``: all.
        skip_empty_calls: lockstep, one rank (no ``gather_fn``): make no ``rollout_fn([])`` call
            when nothing is live, such as the contract's last call after the final turn, which
            keeps ranks in step and which a single-rank native run does not need (``mtflow run``
            sets it; the default keeps the contract's calls).
        context: a :class:`mtflow.ContextBudget`: the context length, per-turn and total token
            budgets and the compaction policy (``docs/context.md``); checked against the backend
            here (a context larger than the model's is a :class:`mtflow.engine.context.ContextError`).
        image_store: ``image -> ImageRef``, called with each image a ``step`` added the moment
            it returns (after the image checks); the request then holds the reference, not the
            pixels (``mtflow run`` gives its run directory's store, ``docs/multimodal.md``).
        turn_reward: ``fn(infer_request, response_choice, current_turn) -> float | None`` (sync
            or async), called after every turn's ``on_turn_end``; each number is recorded in
            ``rollout_infos['turn_rewards']`` with the turn's token span (source ``turn_reward``,
            ``docs/streaming.md``). Takes the place of the scheduler's own ``turn_reward`` method.
        admission: a :class:`mtflow.Admission` (or a dict of its bounds): tool and sandbox calls
            in flight across all tools, environment sessions open; what exceeds a bound waits
            (``docs/admission.md``). The scheduler gets it through ``use_admission(admission)``
            when it has that method; async mode and streams start a request only when a session
            is free; lockstep refuses a batch larger than ``env_sessions`` (it runs together).
        branch: a :class:`mtflow.Branching` (or a dict of its fields): where each request's
            machine forks into branches that share its history exactly, and the tree's leaf
            budget (``docs/branching.md``); default: the scheduler's own ``branch`` attribute when it is a ``Branching``
            (a YAML scheduler's ``branch:`` section), else no forks. Every driver forks alike;
            the outputs are one per leaf and :attr:`RunResult.trees` holds the trees. With
            ``gather_fn`` each rank forks its own requests (its outputs: its prompts' leaves) and
            the ranks stay in step as in any run (a fork adds no model call of its own).

    A ``KeyboardInterrupt`` inside :meth:`run` raises :class:`mtflow.RolloutInterrupted`, whose
    ``.result`` holds every output (finished ones unchanged, the others partial with reason
    ``interrupted``).
    """


    def __init__(self,
                 scheduler: SchedulerLike,
                 rollout_fn: RolloutFn,
                 request_config: Any = None,
                 *,
                 max_turns: Optional[int] = None,
                 gather_fn: Optional[GatherFn] = None,
                 trace: bool = True,
                 on_error: OnError = 'raise',
                 rank: int = 0,
                 output_cls: Optional[type] = None,
                 accounting: Optional[Accounting] = None,
                 on_finished: Optional[OnFinished] = None,
                 step_timeout_s: Optional[float] = 600.0,
                 rollout_timeout_s: Optional[float] = None,
                 turn_cap: int = DEFAULT_TURN_CAP,
                 scheduler_bounds_run: bool = True,
                 check_ranks: bool = False,
                 unique_uuids: Optional[bool] = None,
                 eager_coroutines: bool = True,
                 mode: str = 'lockstep',
                 max_concurrency: Optional[int] = None,
                 skip_empty_calls: bool = False,
                 context: Optional[ContextBudget] = None,
                 image_store: Optional[Callable[[Any], Any]] = None,
                 turn_reward: Optional[Callable[..., Any]] = None,
                 admission: Any = None,
                 branch: Any = None) -> None:
        admission = Admission.coerce(admission)
        gather_fn = None if gather_fn is identity_gather else gather_fn  # run_multi_turn's default: one rank
        branch = Branching.of(branch, scheduler)
        given = locals()
        options = ExecutorOptions(**{name: given[name] for name in OPTION_NAMES})
        bound, per_prompt = admission.session_bounds(scheduler, branch) if admission is not None else (None, 1)
        if not callable(rollout_fn):
            raise TypeError(f'rollout_fn must be callable, not {type(rollout_fn).__name__}')
        self.scheduler = scheduler
        self.rollout_fn = rollout_fn
        self.request_config = request_config
        self.options = options
        hooks = HookSet(scheduler, turn_reward, image_store=image_store)
        self.settings = RunSettings(
            options=options,
            hooks=hooks,
            graph=hooks.graph(),
            rollout_fn=rollout_fn,
            request_config=request_config,
            accounting=accounting if accounting is not None else native_accounting(scheduler),
            gather_fn=gather_fn or identity_gather,
            unique_uuids=bool(getattr(scheduler, 'requires_unique_uuids', False)) if unique_uuids is None else
            bool(unique_uuids),
            turn_bound=options.turn_bound(hooks.default_max_turns),
            context=resolve_context(context, rollout_fn, request_config),
            session_bound=bound,
            prompt_sessions=per_prompt,
            branching=branch)
        if admission is not None:
            admission.give_to(scheduler)
        self.unbounded = options.unbounded(hooks.default_max_turns)
        self.clock = PolicyClock()

    def set_policy_version(self, version: int) -> None:
        """Declare the version of the weights ``rollout_fn`` samples with from now on (any
        thread; versions only go forward). Runs (lockstep and async) and streams stamp every
        generated turn with it (``rollout_infos['policy_versions']``); a running stream with ``max_staleness``
        reacts at once (``docs/streaming.md``). A backend's own ``policy_version`` wins."""
        self.clock.set(version)

    @property
    def policy_version(self) -> int:
        """The current weights version (the backend's declared one, else the last set)."""
        return self.clock.current(self.rollout_fn)

    # ---- entry points ------------------------------------------------------------------------
    def run(self, requests: List[Any], first_turn_outputs: Optional[Sequence[Any]] = None, *,
            until: Any = None) -> RunResult:
        """Roll out ``requests`` to the end. Without ``first_turn_outputs`` the executor calls
        ``on_trajectory_start`` and generates the first turn itself.

        Like ms-swift's loop, each request's ``messages`` are extended in place and, when
        ``requests`` is a list, its entries are replaced by the requests that steps return."""
        if self.unbounded:
            warnings.warn(f'{type(self.scheduler).__name__}: no max_turns on the executor or the scheduler; the run '
                          f'is capped at turn_cap={self.options.turn_cap} turns (finish reason turn_cap)',
                          RuntimeWarning, stacklevel=2)
        loop = asyncio.new_event_loop()
        try:
            driver = self._driver(loop, requests, first_turn_outputs, until)
            try:
                result = driver.drive()
            except KeyboardInterrupt as exc:
                interrupted = RolloutInterrupted(driver.interrupted(), exc)
                driver.end_trajectory(interrupted)
                raise interrupted from exc
            except SystemExit as exc:  # the process is leaving: finish everything, keep the exit
                exc.result = driver.interrupted()  # type: ignore[attr-defined]
                driver.end_trajectory(exc)
                raise
            except RankMismatchError as exc:
                driver.end_trajectory(exc)
                raise
            raise_on_error = self.options.on_error == 'raise'
            error = None
            if result.failures and raise_on_error:
                error = MultiTurnRolloutError(result.failures, result.outputs, result)
            driver.end_trajectory(error)
            if error is None and result.failures and raise_on_error:  # on_trajectory_end failed
                error = MultiTurnRolloutError(result.failures, result.outputs, result)
        finally:
            close_loop(loop)
        if error is not None:
            raise error
        return result

    def _driver(self, loop: asyncio.AbstractEventLoop, requests: List[Any],
                first_turn_outputs: Optional[Sequence[Any]], until: Any) -> Driver:
        """The driver of one run: lockstep, or async mode's, which drives the same handlers per
        request (partial rollouts with ``until`` and resumed :class:`UnfinishedRequest` items
        need it)."""
        if self.options.branch is not None and first_turn_outputs is not None:
            raise ValueError('a branched run generates every turn itself: first_turn_outputs cannot be given with '
                             'branch (a fork at turn 1 would have no first output for its children)')
        if self.options.mode == 'async':
            budget = Until.coerce(until)
            if first_turn_outputs is not None and any(isinstance(r, UnfinishedRequest) for r in requests):
                raise ValueError('first_turn_outputs cannot be given with unfinished requests to resume')
            return AsyncDriver(RunState(self.settings, loop, requests, first_turn_outputs), budget, self.clock)
        if until is not None or any(isinstance(r, UnfinishedRequest) for r in requests):
            raise ValueError("partial rollouts (until=, resuming RunResult.unfinished) need Executor(mode='async')")
        bound, each = self.settings.session_bound, self.settings.prompt_sessions
        if bound is not None and len(requests) * each > bound:
            held = f'up to {each} each, a tree of branch.leaves={each} leaves' if each > 1 else 'one each'
            raise ValueError(f'admission.env_sessions is {bound} but this lockstep batch has {len(requests)} requests, '
                             f'holding environment sessions ({held}) from their first turn to their last (lockstep '
                             f"runs them together); use mode='async' (requests wait for free sessions) or batches of "
                             f'at most {bound // each}')
        return LockstepDriver(RunState(self.settings, loop, requests, first_turn_outputs), self.clock)

    def stream(self, source: Any, *, max_concurrency: Optional[int] = None, buffer: Optional[int] = None,
               until: Any = None, max_staleness: Optional[int] = None, stale: str = 'restart',
               on_update: str = 'keep') -> Stream:
        """Stream ``source`` (an iterable or async iterator of requests, or of lists of requests:
        groups) through the async driver: ``max_concurrency`` requests in flight, each group
        yielded as a :class:`mtflow.StreamGroup` the moment its last member finishes, at most
        ``buffer`` finished groups waiting for the consumer (then admission stops), ``until`` a
        budget (``{'requests'|'groups'|'seconds'|'tokens': n}``), ``max_staleness`` versions at
        most between a group's oldest turn and the weights at delivery (``stale``: ``'restart'``
        or ``'drop'`` a group that would be staler; ``on_update='abort'``: generations in flight
        at an update are issued again under the new weights; ``'resume'``: they go on from the
        ids they had, with a resumable ``rollout_fn``, :mod:`mtflow.engine.resume`).
        ``docs/streaming.md``."""
        return open_stream(self.settings, self.clock, close_loop, source, max_concurrency=max_concurrency,
                           buffer=buffer, until=until, max_staleness=max_staleness, stale=stale, on_update=on_update)

    async def astream(self, source: Any, **options: Any) -> AsyncIterator[StreamGroup]:
        """:meth:`stream` from inside a running event loop: ``async for group in
        executor.astream(source)``; the driver runs in its own thread, the caller's loop waits
        for each group without blocking (options as :meth:`stream`)."""
        async for group in aiter_stream(self.stream(source, **options)):
            yield group

    async def arun(self, requests: List[Any], first_turn_outputs: Optional[Sequence[Any]] = None, *,
                   until: Any = None) -> RunResult:
        """:meth:`run` from inside a running event loop (server mode): the synchronous driver runs
        in a worker thread so that blocking engines and sync hooks never stall the caller's loop."""
        return await asyncio.to_thread(self.run, requests, first_turn_outputs, until=until)


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel whatever an interrupt or a deadline left pending on the private loop, then close it
    (no "coroutine was never awaited" or "task was destroyed" noise)."""
    try:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
        loop.run_until_complete(loop.shutdown_asyncgens())
    except BaseException:  # pragma: no cover - a second interrupt while cleaning up
        pass
    finally:
        loop.close()


def run_multi_turn(requests: List[Any],
                   first_turn_outputs: List[Any],
                   scheduler: SchedulerLike,
                   rollout_fn: RolloutFn,
                   request_config: Any,
                   max_turns: Optional[int] = None,
                   gather_fn: GatherFn = identity_gather,
                   *,
                   trace: bool = True,
                   on_error: OnError = 'raise',
                   step_timeout_s: Optional[float] = 600.0,
                   rollout_timeout_s: Optional[float] = None,
                   accounting: Optional[Accounting] = None) -> List[Any]:
    """Drop-in for ms-swift's ``run_multi_turn``: same arguments, same outputs, field for field.

    Returns one output per request, in input order, built with the class of
    ``first_turn_outputs``. A request that fails is finished with reason ``error`` (``timeout``
    past a deadline); with ``on_error='raise'`` (default) one :class:`MultiTurnRolloutError` is
    raised after the loop (every rank stays in step) carrying all failures and all outputs. As in
    ms-swift, only ``max_turns`` bounds the driver (the scheduler's own ``max_turns`` acts
    through its ``check_finished``)."""
    executor = Executor(
        scheduler,
        rollout_fn,
        request_config,
        max_turns=max_turns,
        gather_fn=gather_fn,
        trace=trace,
        on_error=on_error,
        step_timeout_s=step_timeout_s,
        rollout_timeout_s=rollout_timeout_s,
        accounting=accounting if accounting is not None else accounting_for(scheduler),
        scheduler_bounds_run=False)
    return executor.run(requests, first_turn_outputs).outputs
