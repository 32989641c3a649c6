"""Building a finishing request's output, and telling the scheduler and the caller it is final.

An output is built from the record (messages, token segments, masks, logprobs, infos), passed
through the scheduler's ``finalize_output``, and only then does the request move into
``finished``: a failure while building it fails the request instead of leaving it half done.
"""
from __future__ import annotations

import inspect
from typing import Any

from mtflow.core.errors import SchedulerResultError
from mtflow.core.machine import RequestRecord
from mtflow.core.protocol import RolloutOutput
from mtflow.core.records import FinishedRequest
from mtflow.core.trace import TraceEvent
from mtflow.accounting.segments import checked_logprobs
from mtflow.accounting.turn_spans import TURN_REWARDS_KEY, merged_entries, with_spans
from mtflow.engine.run_state import RunState, failure_of

__all__ = ['OutputFailed', 'finalized_output', 'build_output', 'notify_finished', 'detach_messages']


class OutputFailed(Exception):
    """Building a finishing request's output failed (phase ``output`` or ``finalize_output``)."""

    def __init__(self, phase: str, exc: BaseException) -> None:
        super().__init__(phase)
        self.phase, self.exc = phase, exc


def finalized_output(run: RunState, rec: RequestRecord, turn: int, strict: bool = False) -> Any:
    """The request's output, passed through the scheduler's ``finalize_output`` hook.

    ``strict`` (a normal finish): a failure raises :class:`OutputFailed` so that the caller
    fails the request instead; otherwise (already failing, interrupted) the output without
    the hook's change is kept and the hook's failure recorded."""
    output = build_output(run, rec, turn, strict=strict)
    hook = run.hooks.finalize_output
    if hook is None:
        return output
    try:
        replaced = hook(output, rec.reason, turn)
        if inspect.isawaitable(replaced):
            replaced = run.await_value(replaced)
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
            raise OutputFailed('finalize_output', exc) from exc
        if rec.error is None or rec.error.phase != 'finalize_output':  # not the same failure twice
            run.failures.append(failure_of(rec, turn, 'finalize_output', exc))
        return output
    return output if replaced is None else replaced


def build_output(run: RunState, rec: RequestRecord, turn: int, strict: bool = False) -> Any:
    """The output of the run's output class from the record. ``strict``: a record that cannot
    make one raises :class:`OutputFailed`; otherwise mtflow's own output class takes it."""
    infos = {**rec.infos, 'num_turns': turn}
    if rec.turn_rewards:  # the executor's turn_reward hook, beside the scheduler's own entries
        infos[TURN_REWARDS_KEY] = merged_entries(infos.get(TURN_REWARDS_KEY), rec.turn_rewards)
    if TURN_REWARDS_KEY in infos:  # each per-turn reward with the span of its turn's tokens
        infos[TURN_REWARDS_KEY] = with_spans(infos[TURN_REWARDS_KEY], rec.ids, turn)
    if rec.error is not None:
        infos['mtflow_error'] = rec.error.to_dict()
    try:
        logprobs = checked_logprobs(rec)
    except Exception as exc:  # segments that cannot be summed: never a crash of the batch
        if strict:
            raise OutputFailed('output', SchedulerResultError(
                f'cannot check the logprob segments: {exc}', uuid=rec.uuid, turn=turn, field='rollout_logprobs'))
        logprobs = []
    fields = dict(
        response=rec.response,
        messages=getattr(rec.request, 'messages', None),
        response_token_ids=rec.ids,
        response_loss_mask=rec.mask,
        rollout_infos=infos,
        rollout_logprobs=logprobs)
    built = run.builder.build(fields)
    if built is not None:
        return built
    try:
        return run.output_cls(**fields)
    except Exception as exc:  # e.g. ms-swift's class requires a response the request never got
        if strict:
            raise OutputFailed('output', SchedulerResultError(
                f'cannot build {run.output_cls.__name__}: {exc}', uuid=rec.uuid, turn=turn,
                field='output')) from exc
        try:
            return RolloutOutput(**fields)
        except Exception:
            return RolloutOutput.model_construct(**fields)


def notify_finished(run: RunState, rec: RequestRecord) -> None:
    """The request's output is final: ``on_request_finished`` (the scheduler's), then
    ``on_finished`` (the caller's). Their failures are recorded, never swallowed."""
    turn = rec.turns
    hook = run.hooks.on_request_finished
    if hook is not None:
        try:
            result = hook(rec.request, rec.reason, turn)
            if inspect.isawaitable(result):
                run.await_value(result)
        except Exception as exc:
            run.failures.append(failure_of(rec, turn, 'on_request_finished', exc))
    on_finished = run.options.on_finished
    if on_finished is not None:
        events = []
        if rec.events is not None:
            uuid, rank = rec.uuid, run.options.rank
            events = [TraceEvent(uuid, i, rank, t, src, dst, trig, reason, tokens, dur, ts, extra)
                      for (i, t, src, dst, trig, reason, tokens, dur, ts, extra) in rec.events]
        try:
            branch = rec.branch
            on_finished(FinishedRequest(rec.index, rec.uuid, rec.output, rec.reason, rec.error, events,
                                        branch.parent if branch is not None else None,
                                        branch.tree.root_index if branch is not None else rec.index))
        except Exception as exc:
            run.failures.append(failure_of(rec, turn, 'on_finished', exc))


def detach_messages(rec: RequestRecord) -> None:
    """Give a timed-out or interrupted request a copy of its messages: a step left running in an
    abandoned thread must not change an output that is already final."""
    messages = getattr(rec.request, 'messages', None)
    if isinstance(messages, list):
        try:
            rec.request.messages = [dict(m) if isinstance(m, dict) else m for m in messages]
        except Exception:  # a request type that refuses assignment keeps its own list
            pass
