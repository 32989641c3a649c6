"""The batch executor: the declared state graph drives every request, one lockstep turn at a time.

One turn (see ``docs/executor.md``):

1. ask every rank whether any has live requests (``gather_fn``); stop when none has;
2. the graph dispatches: for each phase of :data:`mtflow.core.machine.TURN_PHASES`, the handler of
   that phase takes the requests in its states and returns their moves (:class:`Move`):
   ``waiting`` (``generating``/``continuing``) applies the outputs, runs ``on_turn_end`` and
   the stop decision (:func:`mtflow.core.stop.decide_stop`) -> ``finish`` / ``run_step`` / ``fail``;
   ``tool_step`` runs the steps -> ``generate`` / ``continue_message`` / ``fail``;
   :meth:`BatchRun.apply` carries the moves out through :meth:`StateGraph.move`, which also
   records the trace;
3. ``rollout_fn`` once, with the requests that go on (``[]`` on a rank with nothing live while
   another rank works), so every rank calls it the same number of times.

The driver is synchronous, like ms-swift's: ``rollout_fn`` and sync hooks run outside any event
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
import hashlib
import inspect
import traceback as _traceback
import warnings
from collections import Counter
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple

from mtflow.core import machine as M
from mtflow.core import trace as _trace
from mtflow.core import validate as V
from mtflow.core.calls import OK, RAISED, TIMED_OUT, Caller, Outcome
from mtflow.core.errors import (DuplicateUuidError, MultiTurnRolloutError, RankMismatchError, RequestFailure, RolloutFnError,
                     RolloutInterrupted, SchedulerResultError, StepTimeout)
from mtflow.core.machine import RequestRecord, StateGraph
from mtflow.core.protocol import OutputBuilder, RolloutOutput
from mtflow.core.records import FinishedRequest, Move
from mtflow.core.scheduler import HookSet
from mtflow.accounting.choose import accounting_for
from mtflow.accounting.segments import checked_logprobs, is_continuation_of
from mtflow.core.stop import decide_stop, default_check
from mtflow.core.trace import Trace, TraceEvent, TraceRecorder
from mtflow.core.types import Accounting, GatherFn, RolloutFn, SchedulerLike

OnError = Literal['raise', 'return']
OnFinished = Callable[[FinishedRequest], None]

#: the safety cap on turns of a run that has no bound anywhere (``Executor(turn_cap=...)``)
DEFAULT_TURN_CAP = 1000

__all__ = ['Executor', 'RunResult', 'BatchRun', 'RankMismatchError', 'DuplicateUuidError', 'run_multi_turn',
           'identity_gather', 'DEFAULT_TURN_CAP']


def identity_gather(values: List[Any]) -> List[Any]:
    """The single-process ``gather_fn``: every rank's contribution is this rank's."""
    return list(values)


class RunResult:
    """What :meth:`Executor.run` returns: one output per request (input order), each request's
    finish reason, the failures, and the trace (``None`` when tracing is off).

    The trace is materialised from the recorder's raw tuples on first access, so a run whose
    trace nobody reads pays only for the tuples."""

    def __init__(self,
                 outputs: List[Any],
                 finish_reasons: List[str],
                 failures: Optional[List[RequestFailure]] = None,
                 recorder: Optional[TraceRecorder] = None,
                 turns: int = 0,
                 rollout_fn_calls: int = 0) -> None:
        self.outputs = outputs
        self.finish_reasons = finish_reasons
        self.failures = failures if failures is not None else []
        self.turns = turns  # loop iterations in which some rank had live requests
        self.rollout_fn_calls = rollout_fn_calls
        #: requests handed back unfinished (reserved for partial rollouts, issue 14); the
        #: lockstep executor finishes every request, so this is always empty here
        self.unfinished: List[Any] = []
        self._recorder = recorder
        self._trace: Optional[Trace] = None

    @property
    def trace(self) -> Optional[Trace]:
        if self._trace is None and self._recorder is not None:
            self._trace = self._recorder.trace()
        return self._trace

    @property
    def ok(self) -> bool:
        return not self.failures

    def __repr__(self) -> str:
        return (f'RunResult({len(self.outputs)} outputs, finish_reasons={dict(Counter(self.finish_reasons))}, '
                f'failures={len(self.failures)}, turns={self.turns}, rollout_fn_calls={self.rollout_fn_calls})')


def _timeout_arg(name: str, value: Any) -> Optional[float]:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise ValueError(f'{name} must be None or a number of seconds > 0, not {value!r}')
    return value


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
            :func:`mtflow.accounting.accounting_for`: ms-swift 4.6's rules for schedulers that keep
            assistant messages as token ids, else the contract's).
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
                 max_concurrency: Optional[int] = None) -> None:
        if on_error not in ('raise', 'return'):
            raise ValueError(f"on_error must be 'raise' or 'return', not {on_error!r}")
        if max_turns is not None and (not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 0):
            raise ValueError(f'max_turns must be None or an int >= 0, not {max_turns!r}')
        if not isinstance(turn_cap, int) or isinstance(turn_cap, bool) or turn_cap < 1:
            raise ValueError(f'turn_cap must be an int >= 1, not {turn_cap!r}')
        if on_finished is not None and not callable(on_finished):
            raise TypeError(f'on_finished must be callable, not {type(on_finished).__name__}')
        if mode not in ('lockstep', 'async'):
            raise ValueError(f"mode must be 'lockstep' or 'async', not {mode!r}")
        if max_concurrency is not None and (isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int)
                                            or max_concurrency < 1):
            raise ValueError(f'max_concurrency must be None or an int >= 1, not {max_concurrency!r}')
        if max_concurrency is not None and mode != 'async':
            raise ValueError("max_concurrency applies to mode='async' only (lockstep sends every live request "
                             'in one rollout_fn call)')
        self.mode = mode
        self.max_concurrency = max_concurrency
        if not callable(rollout_fn):
            raise TypeError(f'rollout_fn must be callable, not {type(rollout_fn).__name__}')
        self.scheduler = scheduler
        self.hooks = HookSet(scheduler)
        self.graph: StateGraph = self.hooks.graph()
        self.rollout_fn = rollout_fn
        self.request_config = request_config
        self.max_turns = max_turns
        self.gather_fn = gather_fn or identity_gather
        self.tracing = trace
        self.on_error = on_error
        self.rank = rank
        self.output_cls = output_cls
        self.accounting: Accounting = accounting if accounting is not None else accounting_for(scheduler)
        self.on_finished = on_finished
        self.step_timeout_s = _timeout_arg('step_timeout_s', step_timeout_s)
        self.rollout_timeout_s = _timeout_arg('rollout_timeout_s', rollout_timeout_s)
        self.turn_cap = turn_cap
        self.check_ranks = check_ranks
        self.eager_coroutines = eager_coroutines
        self.unique_uuids = bool(getattr(scheduler, 'requires_unique_uuids', False)) if unique_uuids is None \
            else bool(unique_uuids)
        # the bound of every request: the caller's max_turns, the scheduler's own (native API),
        # else the safety cap
        own = self.hooks.default_max_turns
        own = own if isinstance(own, int) and not isinstance(own, bool) and own > 0 else None
        bounds = [b for b in (max_turns, own if scheduler_bounds_run else None) if b]
        self.turn_bound: Optional[int] = min(bounds) if bounds else None
        self.unbounded = not max_turns and own is None

    # ---- entry points ------------------------------------------------------------------------
    def run(self, requests: List[Any], first_turn_outputs: Optional[Sequence[Any]] = None, *,
            until: Any = None) -> RunResult:
        """Roll out ``requests`` to the end. Without ``first_turn_outputs`` the executor calls
        ``on_trajectory_start`` and generates the first turn itself.

        Like ms-swift's loop, each request's ``messages`` are extended in place and, when
        ``requests`` is a list, its entries are replaced by the requests that steps return."""
        if self.unbounded:
            warnings.warn(f'{type(self.scheduler).__name__}: no max_turns on the executor or the scheduler; the run '
                          f'is capped at turn_cap={self.turn_cap} turns (finish reason turn_cap)',
                          RuntimeWarning, stacklevel=2)
        loop = asyncio.new_event_loop()
        try:
            run = self._batch_run(loop, requests, first_turn_outputs, until)
            try:
                result = run.drive()
            except KeyboardInterrupt as exc:
                interrupted = RolloutInterrupted(run.interrupted(), exc)
                run.end_trajectory(interrupted)
                raise interrupted from exc
            except SystemExit as exc:  # the process is leaving: finish everything, keep the exit
                exc.result = run.interrupted()  # type: ignore[attr-defined]
                run.end_trajectory(exc)
                raise
            except RankMismatchError as exc:
                run.end_trajectory(exc)
                raise
            error = None
            if result.failures and self.on_error == 'raise':
                error = MultiTurnRolloutError(result.failures, result.outputs, result)
            run.end_trajectory(error)
            if error is None and result.failures and self.on_error == 'raise':  # on_trajectory_end failed
                error = MultiTurnRolloutError(result.failures, result.outputs, result)
        finally:
            _close_loop(loop)
        if error is not None:
            raise error
        return result

    def _batch_run(self, loop: asyncio.AbstractEventLoop, requests: List[Any],
                   first_turn_outputs: Optional[Sequence[Any]], until: Any) -> 'BatchRun':
        """The driver of one run: lockstep (:class:`BatchRun`), or async mode's, which drives the
        same handlers per request (:class:`mtflow.engine.async_driver.AsyncRun`; partial rollouts with
        ``until`` and resumed :class:`~mtflow.engine.async_driver.UnfinishedRequest` items need it)."""
        if self.mode == 'async':
            from mtflow.engine.async_driver import AsyncRun, Until

            return AsyncRun(self, loop, requests, first_turn_outputs, Until.coerce(until))
        if until is not None or any(type(r).__name__ == 'UnfinishedRequest' for r in requests):
            raise ValueError("partial rollouts (until=, resuming RunResult.unfinished) need Executor(mode='async')")
        return BatchRun(self, loop, requests, first_turn_outputs)

    async def arun(self, requests: List[Any], first_turn_outputs: Optional[Sequence[Any]] = None, *,
                   until: Any = None) -> RunResult:
        """:meth:`run` from inside a running event loop (server mode): the synchronous driver runs
        in a worker thread so that blocking engines and sync hooks never stall the caller's loop."""
        return await asyncio.to_thread(self.run, requests, first_turn_outputs, until=until)


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
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


def _failure(rec: RequestRecord, turn: int, phase: str, exc: BaseException) -> RequestFailure:
    return RequestFailure(rec.index, rec.uuid, turn, phase, exc,
                          ''.join(_traceback.format_exception(type(exc), exc, exc.__traceback__)))


def _fail_move(rec: RequestRecord, turn: int, phase: str, exc: BaseException, reason: str = M.ERROR,
               tokens: Optional[int] = None) -> Move:
    """``fail``; ``tokens``: the completion tokens of this turn's output when it was applied (the
    trace counts them on the move that leaves ``generating``/``continuing``)."""
    return Move(rec, M.FAIL, turn, tokens=tokens or None, reason=reason, failure=_failure(rec, turn, phase, exc))


def _outcome_move(rec: RequestRecord, turn: int, phase: str, outcome: Outcome, tokens: Optional[int] = None) -> Move:
    """The ``fail`` move of an outcome that raised or timed out."""
    if outcome.kind == TIMED_OUT:
        err = StepTimeout(f'{phase} did not return within {outcome.value:g} s', uuid=rec.uuid, turn=turn, field=phase)
        return _fail_move(rec, turn, phase, err, M.TIMEOUT, tokens)
    return _fail_move(rec, turn, phase, outcome.value, tokens=tokens)


class BatchRun:
    """The state of one :meth:`Executor.run` call, and the per-state handlers.

    Kept out of :class:`Executor` so that an executor can be reused and nothing leaks from one
    batch into the next.

    **Handler API** (also driven per request by other drivers, e.g. an async one): each handler
    takes any subset of the records in its states (one record is fine) and the turn, and returns
    one :class:`Move` per record; it never changes a state itself. :meth:`apply` carries the
    moves out. ::

        run = BatchRun(executor, loop, requests)          # records in ``pending``
        run.apply(run.start(run.records))                 # on_trajectory_start -> generate/continue
        run.rollout(records, turn)                        # sets record.incoming (or fails them)
        run.apply(run.handle_waiting(records, turn))      # generating/continuing -> finish/run_step/fail
        run.apply(run.handle_tool_step(records, turn))    # tool_step -> generate/continue_message/fail
        run.result()

    ``handle_waiting`` needs ``record.incoming`` (the output of this turn, set by :meth:`rollout`
    or by the caller); ``handle_tool_step`` uses ``record.choice``, set by ``handle_waiting``.
    :attr:`handlers` maps each phase name of :data:`mtflow.core.machine.TURN_PHASES` to its handler.
    """

    def __init__(self, ex: Executor, loop: asyncio.AbstractEventLoop, requests: List[Any],
                 first_turn_outputs: Optional[Sequence[Any]] = None) -> None:
        self.ex = ex
        self.graph = ex.graph
        self.hooks = ex.hooks
        self.accounting = ex.accounting
        self.loop = loop
        self.caller = Caller(loop, eager=ex.eager_coroutines)
        self.requests = requests
        self.first = first_turn_outputs
        self.records = [RequestRecord(i, _uuid_of(req, i), req) for i, req in enumerate(requests)]
        self.failures: List[RequestFailure] = []
        self.recorder = TraceRecorder(ex.rank) if ex.tracing else None
        if self.recorder is not None:
            self.recorder.uuids = [r.uuid for r in self.records]
            if ex.on_finished is not None:
                for rec in self.records:
                    rec.events = []
        self.limit = ex.turn_bound or ex.turn_cap
        self.limit_reason = M.MAX_TURNS if ex.turn_bound else M.TURN_CAP
        self.rollout_calls = 0
        self.loops = 0
        self.turn = 1
        self.ended = False
        if ex.output_cls is not None:
            self.output_cls = ex.output_cls
        elif first_turn_outputs:
            self.output_cls = type(first_turn_outputs[0])
        else:
            self.output_cls = RolloutOutput
        self.builder = OutputBuilder(self.output_cls)
        self.handlers: Dict[str, Callable[[List[RequestRecord], int], List[Move]]] = {
            'waiting': self.handle_waiting,
            'tool_step': self.handle_tool_step,
        }
        #: what the lockstep loop calls per phase: the handler with its moves carried out
        self.runners: Dict[str, Callable[[List[RequestRecord], int], None]] = {
            'waiting': self.run_waiting,
            'tool_step': self.run_tool_step,
        }
        self.phases = [(name, frozenset(states), self.runners[name]) for name, states in M.TURN_PHASES]

    # ---- moves -------------------------------------------------------------------------------
    def apply(self, moves: List[Move]) -> None:
        """Carry out the handlers' moves, in order: a request that finishes gets its output built
        (and passed through ``finalize_output``) *before* it moves, so a failure there becomes its
        ``fail`` move instead of a second move out of ``finished``; then the finish hooks run."""
        graph, recorder = self.graph, self.recorder
        for mv in moves:
            rec = mv.record
            trigger = mv.trigger
            if trigger == M.FINISH:
                mv = self._finishing(mv)
                trigger = mv.trigger
            if trigger == M.FAIL or trigger == M.INTERRUPT:
                self._failing(mv)
            extra = mv.extra
            if mv.failure is not None:
                extra = {'error': mv.failure.to_dict()}
            if rec.finalize_trace is not None:  # what finalize_output asked the finish event to carry
                extra = {**(extra or {}), **rec.finalize_trace}
            graph.move(rec, trigger, mv.turn, recorder, mv.tokens, mv.duration, extra)
            if rec.state == M.FINISHED:
                self.notify_finished(rec)

    def _finishing(self, mv: Move) -> Move:
        rec, turn = mv.record, mv.turn
        try:
            self.accounting.finalize(rec, rec.choice, rec.turn_result or _EMPTY)
        except Exception as exc:  # e.g. ms-swift 4.6's get_response_token_data rejects a mask
            return _fail_move(rec, turn, 'finalize', exc, tokens=mv.tokens)
        rec.reason = mv.reason
        try:
            rec.output = self.finalized_output(rec, rec.turns, strict=True)
        except _OutputFailed as failed:  # the output cannot be built, or finalize_output failed
            return _fail_move(rec, turn, failed.phase, failed.exc, tokens=mv.tokens)
        return mv

    def _failing(self, mv: Move) -> None:
        rec = mv.record
        rec.reason = mv.reason or M.ERROR
        if mv.trigger == M.FAIL:
            rec.turns = mv.turn
        if mv.failure is not None:
            self.failures.append(mv.failure)
            rec.error = mv.failure
        if rec.reason in (M.TIMEOUT, M.INTERRUPTED):
            _detach_messages(rec)  # an abandoned step may still write into them
        rec.output = self.finalized_output(rec, rec.turns)

    # ---- outputs -----------------------------------------------------------------------------
    def finalized_output(self, rec: RequestRecord, turn: int, strict: bool = False) -> Any:
        """The request's output, passed through the scheduler's ``finalize_output`` hook.

        ``strict`` (a normal finish): a failure raises :class:`_OutputFailed` so that the caller
        fails the request instead; otherwise (already failing, interrupted) the output without
        the hook's change is kept and the hook's failure recorded."""
        output = self.build_output(rec, turn, strict=strict)
        hook = self.hooks.finalize_output
        if hook is None:
            return output
        try:
            replaced = hook(output, rec.reason, turn)
            if inspect.isawaitable(replaced):
                replaced = self._await(replaced)
            if isinstance(replaced, dict):  # {'output': ..., 'trace_info': {...}}, as steps annotate the trace
                trace_info = replaced.get('trace_info')
                if trace_info is not None and not isinstance(trace_info, dict):
                    raise SchedulerResultError(
                        f'finalize_output: trace_info must be a dict, got {type(trace_info).__name__}',
                        uuid=rec.uuid, turn=turn, field='finalize_output.trace_info')
                rec.finalize_trace = trace_info or None
                replaced = replaced.get('output')
            if replaced is not None and not isinstance(replaced, type(output)) and not (
                    hasattr(replaced, 'messages') and hasattr(replaced, 'rollout_infos')):
                raise SchedulerResultError(
                    f'finalize_output must return an output (or None to keep it), got {type(replaced).__name__}',
                    uuid=rec.uuid, turn=turn, field='finalize_output')
        except Exception as exc:
            if strict:
                raise _OutputFailed('finalize_output', exc) from exc
            if rec.error is None or rec.error.phase != 'finalize_output':  # not the same failure twice
                self.failures.append(_failure(rec, turn, 'finalize_output', exc))
            return output
        return output if replaced is None else replaced

    def _await(self, awaitable: Any) -> Any:
        [outcome] = self.caller._awaitables([awaitable], 0.0, self.ex.step_timeout_s)
        if outcome.kind == RAISED:
            raise outcome.value
        if outcome.kind == TIMED_OUT:
            raise StepTimeout(f'did not return within {outcome.value:g} s')
        return outcome.value

    def build_output(self, rec: RequestRecord, turn: int, strict: bool = False) -> Any:
        infos = {**rec.infos, 'num_turns': turn}
        if rec.error is not None:
            infos['mtflow_error'] = rec.error.to_dict()
        try:
            logprobs = checked_logprobs(rec)
        except Exception as exc:  # segments that cannot be summed: never a crash of the batch
            if strict:
                raise _OutputFailed('output', SchedulerResultError(
                    f'cannot check the logprob segments: {exc}', uuid=rec.uuid, turn=turn, field='rollout_logprobs'))
            logprobs = []
        fields = dict(
            response=rec.response,
            messages=getattr(rec.request, 'messages', None),
            response_token_ids=rec.ids,
            response_loss_mask=rec.mask,
            rollout_infos=infos,
            rollout_logprobs=logprobs)
        built = self.builder.build(fields)
        if built is not None:
            return built
        try:
            return self.output_cls(**fields)
        except Exception as exc:  # e.g. ms-swift's class requires a response the request never got
            if strict:
                raise _OutputFailed('output', SchedulerResultError(
                    f'cannot build {self.output_cls.__name__}: {exc}', uuid=rec.uuid, turn=turn,
                    field='output')) from exc
            try:
                return RolloutOutput(**fields)
            except Exception:
                return RolloutOutput.model_construct(**fields)

    def notify_finished(self, rec: RequestRecord) -> None:
        """The request's output is final: ``on_request_finished`` (the scheduler's), then
        ``on_finished`` (the caller's). Their failures are recorded, never swallowed."""
        turn = rec.turns
        hook = self.hooks.on_request_finished
        if hook is not None:
            try:
                result = hook(rec.request, rec.reason, turn)
                if inspect.isawaitable(result):
                    self._await(result)
            except Exception as exc:
                self.failures.append(_failure(rec, turn, 'on_request_finished', exc))
        on_finished = self.ex.on_finished
        if on_finished is not None:
            events = []
            if rec.events is not None:
                uuid, rank = rec.uuid, self.ex.rank
                events = [TraceEvent(uuid, i, rank, t, src, dst, trig, reason, tokens, dur, ts, extra)
                          for (i, t, src, dst, trig, reason, tokens, dur, ts, extra) in rec.events]
            try:
                on_finished(FinishedRequest(rec.index, rec.uuid, rec.output, rec.reason, rec.error, events))
            except Exception as exc:
                self.failures.append(_failure(rec, turn, 'on_finished', exc))

    # ---- the start ---------------------------------------------------------------------------
    def check_uuids(self) -> List[Move]:
        """Duplicate uuids: every later copy fails before the first turn, with an error naming
        both indexes (per-request scheduler state is keyed by uuid); the first copy runs."""
        seen: Dict[str, int] = {}
        moves: List[Move] = []
        if not self.ex.unique_uuids:
            return moves
        for rec in self.records:
            first = seen.setdefault(rec.uuid, rec.index)
            if first != rec.index:
                err = DuplicateUuidError(f'request {rec.uuid}: uuid used by index {first} and index {rec.index} '
                                         f'of the same batch; give every request its own uuid')
                moves.append(_fail_move(rec, 1, 'input', err))
        return moves

    def start(self, records: List[RequestRecord]) -> List[Move]:
        """``pending``: ``on_trajectory_start`` for ``records`` (native API), then each enters
        ``generating`` or ``continuing``."""
        hook = self.hooks.on_trajectory_start
        if hook is not None and records:
            [outcome] = self.caller.batch(hook, [([r.request for r in records], )],
                                          self.hooks.on_trajectory_start_is_async, self.ex.step_timeout_s)
            if outcome.kind != OK:
                return [_outcome_move(rec, 1, 'on_trajectory_start', outcome) for rec in records]
        return [self.wait_move(rec, 1) for rec in records]

    @staticmethod
    def wait_move(rec: RequestRecord, turn: int, duration: Optional[float] = None,
                  extra: Optional[dict] = None) -> Move:
        """Into ``generating`` or ``continuing``, by the contract's continuation rule (``fail``
        when the messages cannot be read)."""
        try:
            trigger = M.CONTINUE if is_continuation_of(rec.request.messages) else M.GENERATE
        except Exception as exc:
            err = SchedulerResultError(f'messages must be a list of {{role, content}} dicts: {type(exc).__name__}: '
                                       f'{exc}', uuid=rec.uuid, turn=turn, field='messages')
            return _fail_move(rec, turn, 'step' if rec.state == M.TOOL_STEP else 'input', err)
        return Move(rec, trigger, turn, duration=duration, extra=extra)

    # ---- the model ---------------------------------------------------------------------------
    def rollout(self, records: List[RequestRecord], turn: int, deliver: bool = True) -> Any:
        """One ``rollout_fn`` call for ``records`` (possibly ``[]``: every rank calls it alike).
        If it raises or misses ``rollout_timeout_s``, every record fails at once; otherwise
        (``deliver``) each record gets its output in ``incoming`` (:meth:`deliver`). The lockstep
        driver delivers after the next gather, as ms-swift checks the count there. Returns the
        outputs (``None`` when the call failed)."""
        self.rollout_calls += 1
        ex = self.ex
        outcome = self.caller.one(ex.rollout_fn, ([r.request for r in records], ex.request_config),
                                  ex.rollout_timeout_s)
        if outcome.kind == TIMED_OUT:
            err = StepTimeout(f'rollout_fn did not return within {outcome.value:g} s', turn=turn, field='rollout_fn')
            self.apply([_fail_move(rec, turn, 'rollout_fn', err, M.TIMEOUT) for rec in records])
            return None
        if outcome.kind == RAISED:
            exc = outcome.value
            err = RolloutFnError(f'rollout_fn raised {type(exc).__name__}: {exc}', turn=turn, field='rollout_fn')
            err.__cause__ = exc
            self.apply([_fail_move(rec, turn, 'rollout_fn', err) for rec in records])
            return None
        if deliver:
            self.deliver(records, outcome.value, turn)
        return outcome.value

    def deliver(self, records: List[RequestRecord], outputs: Any, turn: int) -> None:
        """Hand each record its output (``incoming``); the wrong number of outputs fails them all."""
        returned = outputs
        try:
            outputs = list(outputs)
        except TypeError:
            outputs = None
        if outputs is None or len(outputs) != len(records):
            got = f'{len(outputs)} output(s)' if outputs is not None else f'a {type(returned).__name__}'
            err = RolloutFnError(f'rollout_fn returned {got} for {len(records)} request(s)', turn=turn,
                                 field='outputs')
            self.apply([_fail_move(rec, turn, 'rollout_fn', err) for rec in records])
            return
        for rec, out in zip(records, outputs):
            rec.incoming = out

    # ---- handlers ----------------------------------------------------------------------------
    # Each handler has a public form that returns one Move per record (the handler API, used by
    # other drivers) and a lean core used by the lockstep loop: the core returns, per record,
    # either a Move (finish, fail: rare) or a compact entry for the common move (``None``:
    # ``run_step``; ``(trigger, duration, extra)``: back to generating/continuing), which
    # :meth:`run_waiting` / :meth:`run_tool_step` hand straight to :meth:`StateGraph.move`.
    # Both forms make the same moves with the same trace events, in the same order.
    def handle_waiting(self, records: List[RequestRecord], turn: int) -> List[Move]:
        """``generating`` / ``continuing``: apply each record's ``incoming`` output, run
        ``on_turn_end`` (all at once), ``check_finished`` and the stop decision; return
        ``finish`` (with the reason), ``run_step`` or ``fail`` per record, in order."""
        entries = self._waiting(records, turn)
        if entries is None:
            return [Move(rec, M.RUN_STEP, turn, tokens=rec.tokens) for rec in records]
        return [Move(rec, M.RUN_STEP, turn, tokens=rec.tokens) if mv is None else mv
                for rec, mv in zip(records, entries)]

    def run_waiting(self, records: List[RequestRecord], turn: int) -> None:
        """:meth:`handle_waiting` and its moves carried out (``apply(handle_waiting(...))``)."""
        move, recorder, run_step = self.graph.move, self.recorder, M.RUN_STEP
        entries = self._waiting(records, turn)
        if entries is None:  # every record runs its step: one pass
            self.graph.move_all(records, (run_step, ) * len(records), turn, recorder, [r.tokens for r in records])
            return
        for rec, mv in zip(records, entries):
            if mv is None:
                move(rec, run_step, turn, recorder, rec.tokens)
            else:
                self.apply([mv])

    def _waiting(self, records: List[RequestRecord], turn: int) -> Optional[List[Optional[Move]]]:
        """The core of :meth:`handle_waiting`: per record a Move, or ``None`` for ``run_step``
        (the whole list ``None`` when every record runs its step)."""
        accounting = self.accounting
        append_completion, check_output = accounting.append_completion, V.check_output
        moves: Dict[int, Move] = {}
        applied: List[RequestRecord] = []
        for rec in records:
            out, rec.incoming = rec.incoming, None
            rec.tokens = 0
            try:
                response, choice = check_output(out, rec.uuid, turn)
                rec.response = response
                rec.is_continuation = append_completion(rec, choice.message.content)
            except Exception as exc:
                if not isinstance(exc, RolloutFnError):
                    exc = RolloutFnError(f'cannot apply the output: {type(exc).__name__}: {exc}', uuid=rec.uuid,
                                         turn=turn, field='response')
                moves[rec.index] = _fail_move(rec, turn, 'apply', exc)
                continue
            rec.turns = turn
            rec.choice = choice
            ids = choice.token_ids
            rec.tokens = len(ids) if ids else 0
            rec.turn_result = None
            applied.append(rec)

        snapshots: Dict[int, Any] = {}
        if accounting.materializes:
            for rec in list(applied):
                try:
                    snapshots[rec.index] = accounting.materialize([rec])
                except Exception as exc:  # ms-swift 4.6 decodes id-backed messages here
                    moves[rec.index] = _fail_move(rec, turn, 'materialize', exc, tokens=rec.tokens)
                    applied.remove(rec)
        try:
            stops = self._decide(applied, turn, moves)
        finally:
            if snapshots:
                for rec in records:
                    snap = snapshots.get(rec.index)
                    if snap is not None:
                        try:
                            accounting.restore(snap)
                        except Exception as exc:
                            moves[rec.index] = _fail_move(rec, turn, 'restore', exc, tokens=rec.tokens)
        out: List[Optional[Move]] = []
        if not moves and not stops:
            return None
        for rec in records:
            index = rec.index
            mv = moves.get(index)
            if mv is None:
                reason = stops.get(index)
                if reason is not None:
                    mv = Move(rec, M.FINISH, turn, tokens=rec.tokens, reason=reason)
            out.append(mv)
        return out

    def _decide(self, applied: List[RequestRecord], turn: int, moves: Dict[int, Move]) -> Dict[int, str]:
        """``on_turn_end``, ``check_finished`` and the stop decision for the applied records:
        the records that stop (index -> reason); failures go into ``moves``."""
        hooks, caller, timeout = self.hooks, self.caller, self.ex.step_timeout_s
        on_turn_end = hooks.on_turn_end
        going = applied
        if on_turn_end is not None and going:
            values, problems, _ = caller.values(on_turn_end, [(r.request, r.choice, turn) for r in going],
                                                hooks.on_turn_end_is_async, timeout, timed=False)
            kept = []
            check_turn_result = V.check_turn_result
            for k, rec in enumerate(going):
                if problems is not None and k in problems:
                    moves[rec.index] = _outcome_move(rec, turn, 'on_turn_end', problems[k], rec.tokens)
                    continue
                try:
                    tr = check_turn_result(values[k], rec.uuid, turn)
                except Exception as exc:
                    moves[rec.index] = _fail_move(rec, turn, 'on_turn_end', exc, tokens=rec.tokens)
                    continue
                rec.turn_result = tr
                if tr:
                    infos = tr.get('rollout_infos')
                    if infos:
                        rec.infos.update(infos)
                kept.append(rec)
            going = kept
        check = hooks.check_finished
        checks: Optional[List[Outcome]] = None
        if check is not None and going:
            # a sync check_finished is a cheap predicate: called inline, in the driver's thread
            checks = caller.batch(check, [(r.request, r.choice, turn) for r in going], hooks.check_is_async,
                                  timeout if hooks.check_is_async else None)
        default_max = self.hooks.default_max_turns
        limit, limit_reason = self.limit, self.limit_reason
        stops: Dict[int, str] = {}
        for k, rec in enumerate(going):
            if checks is not None:
                outcome = checks[k]
                if outcome.kind != OK:
                    moves[rec.index] = _outcome_move(rec, turn, 'check_finished', outcome, rec.tokens)
                    continue
                try:
                    checked = V.check_bool(outcome.value, rec.uuid, turn, 'check_finished')
                except Exception as exc:
                    moves[rec.index] = _fail_move(rec, turn, 'check_finished', exc, tokens=rec.tokens)
                    continue
                check_reason = M.CHECK_FINISHED
            else:
                checked, check_reason = default_check(rec.choice.finish_reason, turn, default_max)
            stop, reason = decide_stop(rec.turn_result, checked, check_reason, turn, limit, limit_reason)
            if stop:
                stops[rec.index] = reason
        return stops

    def handle_tool_step(self, records: List[RequestRecord], turn: int) -> List[Move]:
        """``tool_step``: run the scheduler's ``step`` for every record (async ones concurrently,
        sync ones in order, each under ``step_timeout_s``), apply each result through the
        accounting, and return ``generate`` / ``continue_message`` (by the next request's
        messages) or ``fail`` per record, in order.

        Two halves, so that a driver that runs each step on its own (async mode) applies the
        same rules: :meth:`begin_steps` (before any step runs) and :meth:`end_steps` (the step
        outcomes applied)."""
        return [self._entry_move(rec, turn, e) for rec, e in zip(records, self._tool_step(records, turn))]

    def run_tool_step(self, records: List[RequestRecord], turn: int) -> None:
        """:meth:`handle_tool_step` and its moves carried out (``apply(handle_tool_step(...))``)."""
        move, recorder = self.graph.move, self.recorder
        entries = self._tool_step(records, turn)
        if all(e.__class__ is tuple for e in entries):  # every step went back to the model: one pass
            triggers, durations, extras = zip(*entries)
            self.graph.move_all(records, triggers, turn, recorder, None, durations, extras)
            return
        for rec, e in zip(records, entries):
            if e.__class__ is tuple:
                move(rec, e[0], turn, recorder, None, e[1], e[2])
            else:
                self.apply([e])

    def _tool_step(self, records: List[RequestRecord], turn: int) -> List[Any]:
        going, failed = self.begin_steps(records, turn)
        values, problems, durations = self.caller.values(self.hooks.step, [(r.request, r.choice, turn) for r in going],
                                                         self.hooks.step_is_async, self.ex.step_timeout_s)
        return self._stepped(records, turn, going, values, problems, durations, failed)

    @staticmethod
    def _entry_move(rec: RequestRecord, turn: int, entry: Any) -> Move:
        if entry.__class__ is tuple:
            return Move(rec, entry[0], turn, duration=entry[1], extra=entry[2])
        return entry

    def begin_steps(self, records: List[RequestRecord], turn: int) -> Tuple[List[RequestRecord], List[Move]]:
        """The accounting's ``before_step`` for each record: the records whose step may run, and
        the ``fail`` moves of the others."""
        before = getattr(self.accounting, 'before_step', None)
        if before is None:
            return records, []
        going, failed = [], []
        for rec in records:
            try:
                before(rec, rec.choice, turn)
            except Exception as exc:
                failed.append(_fail_move(rec, turn, 'step', exc))
                continue
            going.append(rec)
        return going, failed

    def end_steps(self, records: List[RequestRecord], turn: int, outcomes: Sequence[Outcome],
                  going: Optional[List[RequestRecord]] = None, failed: Sequence[Move] = ()) -> List[Move]:
        """Apply each step outcome (``going[k]``'s is ``outcomes[k]``; ``going`` defaults to
        ``records``); return one move per record, in order."""
        going = records if going is None else going
        values = [o.value if o.kind == OK else None for o in outcomes]
        problems = {k: o for k, o in enumerate(outcomes) if o.kind != OK} or None
        durations = [o.duration for o in outcomes]
        entries = self._stepped(records, turn, going, values, problems, durations, failed)
        return [self._entry_move(rec, turn, e) for rec, e in zip(records, entries)]

    def _stepped(self, records: List[RequestRecord], turn: int, going: List[RequestRecord], values: List[Any],
                 problems: Optional[Dict[int, Outcome]], durations: Optional[List[float]],
                 failed: Sequence[Move] = ()) -> List[Any]:
        """The step results applied: per record a Move (``fail``) or ``(trigger, duration,
        extra)`` for its move back into ``generating``/``continuing``."""
        accumulate = self.accounting.accumulate_step
        entries: Dict[int, Any] = {mv.record.index: mv for mv in failed} if failed else {}
        requests = self.requests if self.requests.__class__ is list else None
        generate, continue_message = M.GENERATE, M.CONTINUE
        for k, rec in enumerate(going):
            duration = durations[k] if durations is not None else None
            if problems is not None and k in problems:
                entries[rec.index] = _outcome_move(rec, turn, 'step', problems[k])
                continue
            result = values[k]
            try:
                next_request = accumulate(rec, rec.choice, result, turn)
                extra = result.get('trace_info')
                if extra is not None and extra.__class__ is not dict and not isinstance(extra, dict):
                    raise SchedulerResultError(f'trace_info must be a dict, got {type(extra).__name__}',
                                               uuid=rec.uuid, turn=turn, field='trace_info')
            except Exception as exc:
                entries[rec.index] = _fail_move(rec, turn, 'step', exc)
                continue
            rec.request = next_request
            if requests is not None:
                requests[rec.index] = next_request
            try:  # wait_move's continuation rule, without a Move
                entry = (continue_message if is_continuation_of(next_request.messages) else generate, duration, extra)
            except Exception:
                entry = self.wait_move(rec, turn, duration, extra)  # the fail move, with its error
            entries[rec.index] = entry
        return [entries[rec.index] for rec in records]

    # ---- ranks -------------------------------------------------------------------------------
    def ranks_have_work(self, live: List[RequestRecord], turn: int) -> bool:
        """The turn's collective: does any rank have live requests? With ``check_ranks`` the
        ranks also compare a fingerprint of their live sets."""
        ex = self.ex
        if not ex.check_ranks:
            return any(ex.gather_fn([bool(live)]))
        digest = hashlib.blake2b('\x1f'.join(r.uuid for r in live).encode(), digest_size=8).hexdigest()
        gathered = ex.gather_fn([(bool(live), len(live), digest)])
        prints = [tuple(g) if isinstance(g, (list, tuple)) else (bool(g), None, None) for g in gathered]
        if len(set(prints)) > 1:
            counts = Counter(prints)
            majority = counts.most_common(1)[0][0]
            odd = [r for r, p in enumerate(prints) if p != majority]
            same = [r for r, p in enumerate(prints) if p == majority]
            detail = ', '.join(f'rank {r}: {prints[r][1]} live' for r in range(len(prints)))
            err = RankMismatchError(
                f'turn {turn}: ranks {odd} disagree with ranks {same} on the live set ({detail}); ranks that must '
                f'hold the same requests made different stop decisions (is check_finished deterministic?)', turn, odd)
            self.apply([_fail_move(rec, turn, 'ranks', err) for rec in live])
            err.result = self.result()
            raise err
        return any(p[0] for p in prints)

    # ---- the loop ----------------------------------------------------------------------------
    def drive(self) -> RunResult:
        """The lockstep loop: every live request moves one turn together, on every rank alike."""
        records = self.records
        self.apply(self.check_uuids())
        pending = [r for r in records if r.state == M.PENDING]
        if self.first is None:
            self.apply(self.start(pending))
            live = [r for r in pending if r.state in M.WAITING_STATES]
            outputs = self.rollout(live, 1, deliver=False)
        else:
            self.apply([self.wait_move(rec, 1) for rec in pending])
            live = [r for r in pending if r.state in M.WAITING_STATES]
            outputs = self.first
            if len(live) != len(records) and len(outputs) == len(records):  # duplicates were failed
                outputs = [outputs[r.index] for r in live]
        turn = 1
        phases = self.phases
        while True:
            live = [r for r in live if r.state in M.WAITING_STATES]
            has_local = bool(live)
            self.turn = turn
            if not self.ranks_have_work(live, turn):
                break
            self.loops += 1
            if live:
                self.deliver(live, outputs, turn)
            for _name, states, run_phase in phases:
                batch = [r for r in live if r.state in states]
                if batch:
                    run_phase(batch, turn)
            live = [r for r in live if r.state in M.WAITING_STATES]
            turn += 1
            self.turn = turn
            outputs = self.rollout(live if has_local else [], turn, deliver=False)
            live = [r for r in live if r.state in M.WAITING_STATES]
        return self.result()

    def interrupted(self) -> RunResult:
        """Finish every request still live with reason ``interrupted`` (partial outputs), and
        return the result so far; finished requests keep their outputs untouched."""
        moves = [Move(rec, M.INTERRUPT, rec.turns, reason=M.INTERRUPTED) for rec in self.records
                 if rec.state != M.FINISHED]
        for mv in moves:
            rec = mv.record
            try:
                self._failing(mv)
            except BaseException:  # pragma: no cover - a second interrupt: keep what can be built
                rec.output = RolloutOutput.model_construct(messages=getattr(rec.request, 'messages', None))
            self.graph.move(rec, M.INTERRUPT, rec.turns, self.recorder, extra=rec.finalize_trace)
            try:
                self.notify_finished(rec)
            except BaseException:  # pragma: no cover - a second interrupt while notifying
                pass
        return self.result()

    def end_trajectory(self, error: Optional[BaseException]) -> None:
        """``on_trajectory_end(requests, error)`` once, on every path; a failure in it is
        recorded (phase ``on_trajectory_end``)."""
        hook = self.hooks.on_trajectory_end
        if hook is None or self.ended:
            return
        self.ended = True
        try:
            result = hook([r.request for r in self.records], error)
            if inspect.isawaitable(result):
                self._await(result)
        except Exception as exc:
            failure = RequestFailure(-1, '*', self.turn, 'on_trajectory_end', exc, _traceback.format_exc())
            self.failures.append(failure)

    def result(self) -> RunResult:
        records = self.records
        unfinished = [r for r in records if r.state != M.FINISHED]
        if unfinished:  # cannot happen unless a rank's gather_fn lies; never lose them silently
            self.apply([_fail_move(r, r.turns, 'executor', RuntimeError(f'request left in state {r.state!r}'))
                        for r in unfinished])
        result = RunResult(
            outputs=[r.output for r in records],
            finish_reasons=[r.reason for r in records],
            failures=self.failures,
            recorder=self.recorder,
            turns=self.loops,
            rollout_fn_calls=self.rollout_calls)
        if self.recorder is not None and _trace.has_listeners():
            _trace.publish(result.trace)
        return result


_EMPTY: Dict[str, Any] = {}


class _OutputFailed(Exception):
    """Building a finishing request's output failed (phase ``output`` or ``finalize_output``)."""

    def __init__(self, phase: str, exc: BaseException) -> None:
        super().__init__(phase)
        self.phase, self.exc = phase, exc


def _detach_messages(rec: RequestRecord) -> None:
    """Give a timed-out or interrupted request a copy of its messages: a step left running in an
    abandoned thread must not change an output that is already final."""
    messages = getattr(rec.request, 'messages', None)
    if isinstance(messages, list):
        try:
            rec.request.messages = [dict(m) if isinstance(m, dict) else m for m in messages]
        except Exception:  # a request type that refuses assignment keeps its own list
            pass


def _uuid_of(request: Any, index: int) -> str:
    uuid = getattr(request, 'uuid', None)
    return str(uuid) if uuid else f'#{index}'


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
    ex = Executor(
        scheduler,
        rollout_fn,
        request_config,
        max_turns=max_turns,
        gather_fn=gather_fn,
        trace=trace,
        on_error=on_error,
        step_timeout_s=step_timeout_s,
        rollout_timeout_s=rollout_timeout_s,
        accounting=accounting,
        scheduler_bounds_run=False)
    return ex.run(requests, first_turn_outputs).outputs
