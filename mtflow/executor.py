"""The batch executor: advances every request's state machine one turn at a time.

One turn (see ``docs/executor.md``):

1. ask every rank whether any has live requests (``gather_fn``); stop when none has;
2. apply this turn's outputs to the live requests (messages and, on stop, token segments);
3. run ``on_turn_end`` for all of them (async ones gathered), then decide for each: finish, or
   enter ``tool_step``;
4. run the steps (async ones concurrently, sync ones in request order), then each request moves
   to ``generating`` or ``continuing``;
5. call ``rollout_fn`` once with the requests that go on (``[]`` on a rank with nothing live
   while another rank works), so every rank calls it the same number of times.

The driver loop itself is synchronous, like ms-swift's: ``rollout_fn``, ``step`` and
``check_finished`` run outside any event loop (engines that start their own loop keep working),
and only async hooks are driven on a private event loop.

A failure in one request (a hook or step raising, a bad step result, a bad output) finishes that
request with reason ``error``; the others go on, every rank stays in step, and the failures are
raised together at the end (``on_error='raise'``, with every output attached) or returned
(``on_error='return'``).
"""
from __future__ import annotations

import asyncio
import inspect
import traceback as _traceback
from collections import Counter
from time import perf_counter
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence

from . import machine as M
from . import trace as _trace
from .errors import (MultiTurnRolloutError, RequestFailure, RolloutFnError, RolloutInterrupted, SchedulerResultError)
from .machine import RequestRecord
from .protocol import RolloutOutput
from .records import FinishedRequest
from .scheduler import HookSet
from .segments import ContractAccounting, checked_logprobs, is_continuation_of
from .trace import Trace, TraceEvent, TraceRecorder

RolloutFn = Callable[[List[Any], Any], Any]
GatherFn = Callable[[List[bool]], List[bool]]
OnError = Literal['raise', 'return']
OnFinished = Callable[[FinishedRequest], None]

_EMPTY: Dict[str, Any] = {}


def identity_gather(values: List[bool]) -> List[bool]:
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


class Executor:
    """Runs a scheduler over a batch of requests with ``rollout_fn`` as the model.

    Args:
        scheduler: an :class:`mtflow.Scheduler`, an ms-swift ``MultiTurnScheduler``, or any object
            with ``step`` (and optionally ``check_finished``, ``on_turn_end``,
            ``on_trajectory_start``, ``on_request_finished``), each sync or async.
        rollout_fn: ``rollout_fn(requests, request_config) -> outputs`` (one per request, same
            order; may return an awaitable).
        request_config: passed to every ``rollout_fn`` call.
        max_turns: stop every request at this turn; ``None`` or ``0``: unlimited.
        gather_fn: accelerate's ``gather_object`` convention (list in, concatenation out).
        trace: record every transition (``Executor.run`` returns it); ``False`` turns it off.
        on_error: ``'raise'`` one :class:`MultiTurnRolloutError` at the end if any request failed
            (it carries all failures and all outputs), or ``'return'`` them in the result.
        rank: written into trace events.
        output_cls: the class of the outputs built; default: the class of the first-turn outputs
            (so an ms-swift caller gets ms-swift's ``RolloutOutput``), else mtflow's.
        accounting: how ids/masks/logprobs accumulate (default: the contract's rules).
        on_finished: called once per request, in the driver's thread, the moment its output is
            final (every finish path), with a :class:`mtflow.FinishedRequest`. An exception it
            raises becomes that request's failure (phase ``on_finished``), never swallowed.
        step_timeout_s: the deadline of one ``step`` call (``None``: none). A step past it
            finishes its request with reason ``timeout``.
        rollout_timeout_s: the deadline of one ``rollout_fn`` call (``None``: none). A call past
            it finishes the requests it served with reason ``timeout``.

    A ``KeyboardInterrupt`` inside :meth:`run` raises :class:`mtflow.RolloutInterrupted`, whose
    ``.result`` holds every output (finished ones unchanged, the others partial with reason
    ``interrupted``).
    """

    def __init__(self,
                 scheduler: Any,
                 rollout_fn: RolloutFn,
                 request_config: Any = None,
                 *,
                 max_turns: Optional[int] = None,
                 gather_fn: Optional[GatherFn] = None,
                 trace: bool = True,
                 on_error: OnError = 'raise',
                 rank: int = 0,
                 output_cls: Optional[type] = None,
                 accounting: Any = None,
                 on_finished: Optional[OnFinished] = None,
                 step_timeout_s: Optional[float] = 600.0,
                 rollout_timeout_s: Optional[float] = None) -> None:
        if on_error not in ('raise', 'return'):
            raise ValueError(f"on_error must be 'raise' or 'return', not {on_error!r}")
        for name, value in (('step_timeout_s', step_timeout_s), ('rollout_timeout_s', rollout_timeout_s)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f'{name} must be None or a number of seconds > 0, not {value!r}')
        if on_finished is not None and not callable(on_finished):
            raise TypeError(f'on_finished must be callable, not {type(on_finished).__name__}')
        if max_turns is not None and (not isinstance(max_turns, int) or max_turns < 0):
            raise ValueError(f'max_turns must be None or an int >= 0, not {max_turns!r}')
        self.scheduler = scheduler
        self.hooks = HookSet(scheduler)
        self.graph = self.hooks.graph()
        self.rollout_fn = rollout_fn
        self.request_config = request_config
        self.max_turns = max_turns
        self.gather_fn = gather_fn or identity_gather
        self.tracing = trace
        self.on_error = on_error
        self.rank = rank
        self.output_cls = output_cls
        self.accounting = accounting if accounting is not None else _default_accounting(scheduler)
        self.on_finished = on_finished
        self.step_timeout_s = step_timeout_s
        self.rollout_timeout_s = rollout_timeout_s

    # ---- entry points ------------------------------------------------------------------------
    def run(self, requests: List[Any], first_turn_outputs: Optional[Sequence[Any]] = None) -> RunResult:
        """Roll out ``requests`` to the end. Without ``first_turn_outputs`` the executor calls
        ``on_trajectory_start`` and generates the first turn itself.

        Like ms-swift's loop, each request's ``messages`` are extended in place and, when
        ``requests`` is a list, its entries are replaced by the requests that steps return."""
        loop = asyncio.new_event_loop()
        run = _Run(self, loop, requests, first_turn_outputs)
        try:
            return run.drive()
        except KeyboardInterrupt as exc:
            raise RolloutInterrupted(run.interrupted(), exc) from exc
        except SystemExit as exc:  # the process is leaving: finish everything, keep the exit
            exc.result = run.interrupted()  # type: ignore[attr-defined]
            raise
        finally:
            _close_loop(loop)

    async def arun(self, requests: List[Any], first_turn_outputs: Optional[Sequence[Any]] = None) -> RunResult:
        """:meth:`run` from inside a running event loop (server mode): the synchronous driver runs
        in a worker thread so that blocking engines and sync hooks never stall the caller's loop."""
        return await asyncio.to_thread(self.run, requests, first_turn_outputs)


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel whatever an interrupt left pending on the private loop, then close it (no
    "coroutine was never awaited" or "task was destroyed" noise)."""
    try:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    except BaseException:  # pragma: no cover - a second interrupt while cleaning up
        pass
    finally:
        loop.close()


def _default_accounting(scheduler: Any) -> Any:
    """The contract's rules, or ms-swift 4.6's for schedulers that keep assistant messages as
    exact token ids (they have ``append_assistant_completion``)."""
    if callable(getattr(type(scheduler), 'append_assistant_completion', None)):
        try:
            from .integrations.swift_accounting import Swift46Accounting
        except ImportError:  # pragma: no cover - the integration is part of the package
            return ContractAccounting()
        return Swift46Accounting(scheduler)
    return ContractAccounting()


class _Run:
    """The state of one :meth:`Executor.run` call. Kept out of :class:`Executor` so that an
    executor can be reused and nothing leaks from one batch into the next."""

    def __init__(self, ex: Executor, loop: asyncio.AbstractEventLoop, requests: List[Any],
                 first_turn_outputs: Optional[Sequence[Any]]) -> None:
        self.ex = ex
        self.loop = loop
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
        self.raw = self.recorder.raw if self.recorder is not None else None
        self.turn = 1
        self.cleaning_up = False  # an interrupt arrived: no more user hooks after a second one
        self.table = ex.graph.table
        self.rollout_calls = 0
        if ex.output_cls is not None:
            self.output_cls = ex.output_cls
        elif first_turn_outputs:
            self.output_cls = type(first_turn_outputs[0])
        else:
            self.output_cls = RolloutOutput

    # ---- transitions -------------------------------------------------------------------------
    def move(self, rec: RequestRecord, trigger: str, turn: int, tokens: Optional[int] = None,
             duration: Optional[float] = None, extra: Optional[dict] = None) -> None:
        src = rec.state
        dst = self.table[src].get(trigger)
        if dst is None:
            raise M.IllegalTransition(rec.uuid, src, trigger)
        rec.state = dst
        raw = self.raw
        if raw is not None:
            event = (rec.index, turn, src, dst, trigger, rec.reason if dst == M.FINISHED else None, tokens, duration,
                     perf_counter() - self.recorder.t0, extra)
            raw.append(event)
            if rec.events is not None:
                rec.events.append(event)

    def enter_wait(self, rec: RequestRecord, turn: int, duration: Optional[float] = None,
                   extra: Optional[dict] = None) -> None:
        trigger = M.CONTINUE if is_continuation_of(rec.request.messages) else M.GENERATE
        self.move(rec, trigger, turn, duration=duration, extra=extra)

    def fail(self, rec: RequestRecord, turn: int, phase: str, exc: BaseException, tokens: Optional[int] = None,
             reason: str = M.ERROR) -> None:
        failure = RequestFailure(rec.index, rec.uuid, turn, phase, exc,
                                 ''.join(_traceback.format_exception(type(exc), exc, exc.__traceback__)))
        self.failures.append(failure)
        rec.error = failure
        rec.reason = reason
        rec.turns = turn
        rec.output = self.finalized_output(rec, turn)
        self.move(rec, M.FAIL, turn, tokens=tokens, extra={'error': failure.to_dict()})
        self.notify_finished(rec, turn)

    def finish(self, rec: RequestRecord, choice: Any, turn_result: Dict[str, Any], reason: str, turn: int,
               tokens: int) -> None:
        try:
            self.ex.accounting.finalize(rec, choice, turn_result)
        except Exception as exc:  # e.g. ms-swift 4.6's get_response_token_data rejects a mask
            self.fail(rec, turn, 'finalize', exc, tokens)
            return
        rec.reason = reason
        rec.turns = turn
        try:
            rec.output = self.finalized_output(rec, turn, strict=True)
        except _OutputFailed as failed:  # the output cannot be built, or finalize_output failed
            self.fail(rec, turn, failed.phase, failed.exc, tokens)
            return
        self.move(rec, M.FINISH, turn, tokens=tokens)
        self.notify_finished(rec, turn)

    def interrupted(self) -> RunResult:
        """Finish every request still live with reason ``interrupted`` (partial outputs), and
        return the result so far; finished requests keep their outputs untouched."""
        self.cleaning_up = True
        for rec in self.records:
            if rec.state == M.FINISHED:
                continue
            rec.reason = M.INTERRUPTED
            try:
                rec.output = self.finalized_output(rec, rec.turns)
            except BaseException:  # pragma: no cover - a second interrupt: keep what can be built
                rec.output = RolloutOutput.model_construct(messages=getattr(rec.request, 'messages', None))
            self.move(rec, M.INTERRUPT, rec.turns)
            self.notify_finished(rec, rec.turns)
        return self.result(self.loops, raise_failures=False)

    # ---- outputs -----------------------------------------------------------------------------
    def finalized_output(self, rec: RequestRecord, turn: int, strict: bool = False) -> Any:
        """The request's output, passed through the scheduler's ``finalize_output`` hook.

        ``strict`` (a normal finish): a failure raises :class:`_OutputFailed` so that the caller
        fails the request instead; otherwise (already failing, interrupted) the output without
        the hook's change is kept and the hook's failure recorded."""
        output = self.build_output(rec, turn, strict=strict)
        hook = self.ex.hooks.finalize_output
        if hook is None:
            return output
        try:
            replaced = hook(output, rec.reason, turn)
            if inspect.isawaitable(replaced):
                replaced = self.loop.run_until_complete(replaced)
        except Exception as exc:
            if strict:
                raise _OutputFailed('finalize_output', exc) from exc
            if rec.error is None or rec.error.phase != 'finalize_output':  # not the same failure twice
                self.failures.append(RequestFailure(rec.index, rec.uuid, turn, 'finalize_output', exc,
                                                    _traceback.format_exc()))
            return output
        return output if replaced is None else replaced

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

    def notify_finished(self, rec: RequestRecord, turn: int) -> None:
        """The request's output is final: ``on_request_finished`` (the scheduler's), then
        ``on_finished`` (the caller's). Their failures are recorded, never swallowed."""
        hook = self.ex.hooks.on_request_finished
        if hook is not None:
            try:
                result = hook(rec.request, rec.reason, turn)
                if inspect.isawaitable(result):
                    self.loop.run_until_complete(result)
            except Exception as exc:
                self.failures.append(RequestFailure(rec.index, rec.uuid, turn, 'on_request_finished', exc,
                                                    _traceback.format_exc()))
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
                self.failures.append(RequestFailure(rec.index, rec.uuid, turn, 'on_finished', exc,
                                                    _traceback.format_exc()))

    # ---- the loop ----------------------------------------------------------------------------
    def call_rollout(self, live: List[RequestRecord], turn: int) -> List[Any]:
        self.rollout_calls += 1
        try:
            outputs = self.ex.rollout_fn([r.request for r in live], self.ex.request_config)
            if inspect.isawaitable(outputs):
                outputs = self.loop.run_until_complete(outputs)
            return list(outputs)
        except Exception as exc:
            err = RolloutFnError(f'rollout_fn raised {type(exc).__name__}: {exc}', turn=turn, field='rollout_fn')
            err.__cause__ = exc
            for rec in live:
                self.fail(rec, turn, 'rollout_fn', err)
            return []

    def drive(self) -> RunResult:
        ex, hooks, loop, records = self.ex, self.ex.hooks, self.loop, self.records
        accounting = ex.accounting
        max_turns = ex.max_turns
        turn = 1

        if self.first is None:
            if hooks.on_trajectory_start is not None:
                try:
                    result = hooks.on_trajectory_start([r.request for r in records])
                    if inspect.isawaitable(result):
                        loop.run_until_complete(result)
                except Exception as exc:
                    for rec in records:
                        self.fail(rec, turn, 'on_trajectory_start', exc)
            live = [r for r in records if r.state == M.PENDING]
            for rec in live:
                self.enter_wait(rec, turn)
            outputs = self.call_rollout(live, turn)
            live = [r for r in live if r.state != M.FINISHED]
        else:
            live = list(records)
            for rec in live:
                self.enter_wait(rec, turn)
            outputs = list(self.first)

        self.loops = loops = 0
        step, step_async = hooks.step, hooks.step_is_async
        on_turn_end, check = hooks.on_turn_end, hooks.check_finished
        default_max = hooks.default_max_turns
        before = getattr(accounting, 'before_step', None)  # resolved once, not per request-turn
        while True:
            has_local = bool(live)
            if not any(ex.gather_fn([has_local])):
                break
            loops += 1
            self.loops, self.turn = loops, turn
            if len(outputs) != len(live):
                err = RolloutFnError(f'rollout_fn returned {len(outputs)} output(s) for {len(live)} request(s)',
                                     turn=turn, field='outputs')
                for rec in live:
                    self.fail(rec, turn, 'rollout_fn', err)
                live, outputs = [], []

            # 2. apply the outputs
            applied: List[tuple] = []
            for rec, out in zip(live, outputs):
                try:
                    response = out.response
                    choice = response.choices[0]
                    rec.response = response
                    rec.is_continuation = accounting.append_completion(rec, choice.message.content)
                    rec.turns = turn
                except Exception as exc:
                    self.fail(rec, turn, 'apply', RolloutFnError(
                        f'cannot apply the output: {type(exc).__name__}: {exc}', uuid=rec.uuid, turn=turn,
                        field='response'))
                    continue
                ids = choice.token_ids
                applied.append((rec, choice, len(ids) if ids else 0))

            # 3. on_turn_end for all, then the stop decision for each
            results: Optional[List[Any]] = None
            snapshots = accounting.materialize([a[0] for a in applied]) if accounting.materializes else None
            decided: List[tuple] = []
            try:
                if on_turn_end is not None and applied:
                    results = self.run_hooks(on_turn_end, hooks.on_turn_end_is_async, applied, turn)
                for k, (rec, choice, ntok) in enumerate(applied):
                    tr = _EMPTY if results is None else results[k]
                    if tr.__class__ is not dict:
                        if isinstance(tr, BaseException):
                            self.fail(rec, turn, 'on_turn_end', tr, ntok)
                            continue
                        if tr is None:
                            tr = _EMPTY
                        elif not isinstance(tr, dict):
                            self.fail(rec, turn, 'on_turn_end', SchedulerResultError(
                                f'on_turn_end must return a dict, got {type(tr).__name__}', uuid=rec.uuid, turn=turn,
                                field='on_turn_end'), ntok)
                            continue
                    infos = tr.get('rollout_infos')
                    if infos:
                        rec.infos.update(infos)
                    if check is not None:
                        try:
                            checked = check(rec.request, choice, turn)
                            if hooks.check_is_async:
                                checked = loop.run_until_complete(checked)
                        except Exception as exc:
                            self.fail(rec, turn, 'check_finished', exc, ntok)
                            continue
                        reason = M.CHECK_FINISHED
                    elif choice.finish_reason == 'length':
                        checked, reason = True, M.LENGTH
                    elif default_max and turn >= default_max:
                        checked, reason = True, M.MAX_TURNS
                    else:
                        checked, reason = False, M.CHECK_FINISHED
                    if 'done' in tr:
                        # mtflow extension: a hook may name its reason, e.g. 'stop_rule:final_answer'
                        stop, reason = tr['done'], tr.get('finish_reason') or M.DONE_BY_HOOK
                    else:
                        stop = checked
                    if not stop and max_turns and turn >= max_turns:
                        stop, reason = True, M.MAX_TURNS
                    decided.append((rec, choice, ntok, tr, stop, reason))
            finally:
                if snapshots is not None:
                    accounting.restore(snapshots)

            # 4. finish, or step
            next_live: List[RequestRecord] = []
            if step_async:
                going = []
                for rec, choice, ntok, tr, stop, reason in decided:
                    if stop:
                        self.finish(rec, choice, tr, reason, turn, ntok)
                    else:
                        self.move(rec, M.RUN_STEP, turn, tokens=ntok)
                        if before is None or self.before_step(before, rec, choice, turn):
                            going.append((rec, choice, ntok))
                if going:
                    timed = self.loop.run_until_complete(_gather_timed(step, going, turn))
                    for (rec, choice, ntok), (result, dur) in zip(going, timed):
                        self.after_step(rec, choice, result, dur, turn, next_live)
            else:
                for rec, choice, ntok, tr, stop, reason in decided:
                    if stop:
                        self.finish(rec, choice, tr, reason, turn, ntok)
                        continue
                    self.move(rec, M.RUN_STEP, turn, tokens=ntok)
                    if before is not None and not self.before_step(before, rec, choice, turn):
                        continue
                    t = perf_counter()
                    try:
                        result = step(rec.request, choice, turn)
                    except Exception as exc:
                        result = _Raised(exc)
                    self.after_step(rec, choice, result, perf_counter() - t, turn, next_live)

            # 5. the next turn's inference, on every rank alike
            turn += 1
            outputs = self.call_rollout(next_live if has_local else [], turn)
            live = [r for r in next_live if r.state != M.FINISHED]

        return self.result(loops)

    def before_step(self, before: Callable[..., Any], rec: RequestRecord, choice: Any, turn: int) -> bool:
        """The accounting's optional ``before_step`` (ms-swift 4.6 computes a turn's ids before
        the step runs); ``False`` when it failed the request."""
        try:
            before(rec, choice, turn)
        except Exception as exc:
            self.fail(rec, turn, 'step', exc)
            return False
        return True

    def run_hooks(self, hook: Callable[..., Any], is_async: bool, applied: List[tuple], turn: int) -> List[Any]:
        """Call ``hook(request, choice, turn)`` for every applied request; an exception becomes
        that request's result (so one failure never stops the others)."""
        if is_async:

            async def gather() -> List[Any]:
                return await asyncio.gather(*[hook(rec.request, choice, turn) for rec, choice, _ in applied],
                                            return_exceptions=True)

            return self.loop.run_until_complete(gather())
        results = []
        for rec, choice, _ in applied:
            try:
                results.append(hook(rec.request, choice, turn))
            except Exception as exc:
                results.append(exc)
        return results

    def after_step(self, rec: RequestRecord, choice: Any, result: Any, duration: float, turn: int,
                   next_live: List[RequestRecord]) -> None:
        if isinstance(result, _Raised):
            self.fail(rec, turn, 'step', result.exc)
            return
        try:
            next_request = self.ex.accounting.accumulate_step(rec, choice, result, turn)
        except Exception as exc:
            self.fail(rec, turn, 'step', exc)
            return
        rec.request = next_request
        if self.requests.__class__ is list:
            self.requests[rec.index] = next_request
        self.enter_wait(rec, turn, duration=duration, extra=result.get('trace_info'))
        next_live.append(rec)

    def result(self, loops: int, raise_failures: bool = True) -> RunResult:
        records = self.records
        unfinished = [r for r in records if r.state != M.FINISHED]
        for rec in unfinished:  # cannot happen unless a rank's gather_fn lies; never lose them silently
            self.fail(rec, rec.turns, 'executor', RuntimeError(f'request left in state {rec.state!r}'))
        result = RunResult(
            outputs=[r.output for r in records],
            finish_reasons=[r.reason for r in records],
            failures=self.failures,
            recorder=self.recorder,
            turns=loops,
            rollout_fn_calls=self.rollout_calls)
        if self.recorder is not None and _trace.has_listeners():
            _trace.publish(result.trace)
        if raise_failures and self.failures and self.ex.on_error == 'raise':
            raise MultiTurnRolloutError(self.failures, result.outputs, result)
        return result


class _OutputFailed(Exception):
    """Building a finishing request's output failed (phase ``output`` or ``finalize_output``)."""

    def __init__(self, phase: str, exc: BaseException) -> None:
        super().__init__(phase)
        self.phase, self.exc = phase, exc


class _Raised:
    """A step's exception, carried to where results are applied in request order."""
    __slots__ = ('exc', )

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


async def _timed(step: Callable[..., Any], request: Any, choice: Any, turn: int) -> tuple:
    t = perf_counter()
    try:
        result = await step(request, choice, turn)
    except Exception as exc:
        result = _Raised(exc)
    return result, perf_counter() - t


async def _gather_timed(step: Callable[..., Any], going: List[tuple], turn: int) -> List[tuple]:
    # Built inside the private loop: asyncio.gather outside it would bind to another loop.
    return await asyncio.gather(*[_timed(step, rec.request, choice, turn) for rec, choice, _ in going])


def _uuid_of(request: Any, index: int) -> str:
    uuid = getattr(request, 'uuid', None)
    return str(uuid) if uuid else f'#{index}'


def run_multi_turn(requests: List[Any],
                   first_turn_outputs: List[Any],
                   scheduler: Any,
                   rollout_fn: RolloutFn,
                   request_config: Any,
                   max_turns: Optional[int] = None,
                   gather_fn: GatherFn = identity_gather,
                   *,
                   trace: bool = True,
                   on_error: OnError = 'raise',
                   step_timeout_s: Optional[float] = 600.0,
                   rollout_timeout_s: Optional[float] = None) -> List[Any]:
    """Drop-in for ms-swift's ``run_multi_turn``: same arguments, same outputs, field for field.

    Returns one output per request, in input order, built with the class of
    ``first_turn_outputs``. A request that fails is finished with reason ``error``; with
    ``on_error='raise'`` (default) one :class:`MultiTurnRolloutError` is raised after the loop
    (every rank stays in step) carrying all failures and all outputs."""
    ex = Executor(
        scheduler,
        rollout_fn,
        request_config,
        max_turns=max_turns,
        gather_fn=gather_fn,
        trace=trace,
        on_error=on_error,
        step_timeout_s=step_timeout_s,
        rollout_timeout_s=rollout_timeout_s)
    return ex.run(requests, first_turn_outputs).outputs
