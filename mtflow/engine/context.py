"""Context budgets at run time: the check before every turn, and the ``compacting`` state.

A request about to enter ``generating``/``continuing`` (from ``pending`` or ``tool_step``) is
checked first (:func:`route`): its next prompt's tokens (the backend's exact count,
``rollout_fn.count_prompt_tokens``, or the budget's ``count_tokens``) plus the turn's
``max_tokens`` must fit the context and the prompt budget, and its total response budget must
not be spent. A request that fits goes on, its ``max_tokens`` shrunk to what is left of the
total budget (the cut is in the trace: the event into ``generating`` carries
``extra['context']`` with the counts); one that does not moves into ``compacting`` instead
(``compact``, with the counts), where :func:`handle_compacting` applies the policy: finish
``context_full`` (``stop``) or ``length_total``, or rewrite the messages (``drop_observations``,
``summarize``, an ``on_context_full`` hook), close the current training segment
(:func:`mtflow.accounting.segments_split.cut_segment`) and, when the compacted prompt fits, go on
(``docs/context.md``).

Every model call of a run with a budget goes through :meth:`ContextRun.call`: requests whose
``max_tokens`` was cut are sent in a call of their own with that ``max_tokens`` (a run without
cuts makes exactly the calls it made before).
"""
from __future__ import annotations

import copy
import dataclasses
from time import perf_counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mtflow.core.calls import TIMED_OUT, Outcome
from mtflow.core.errors import MtflowError, RequestError, StepTimeout
from mtflow.core.machine import (COMPACT, CONTEXT_FULL, CONTINUE, FINISH, GENERATE, LENGTH, LENGTH_TOTAL, TIMEOUT,
                                 RequestRecord)
from mtflow.core.protocol import RequestConfig, RolloutInferRequest
from mtflow.core.records import Move, TurnMoves
from mtflow.accounting.segments_split import cut_segment
from mtflow.engine.context_budget import BudgetView, ContextBudget
from mtflow.engine.moves import fail_move, wait_move
from mtflow.engine.run_state import RunState

__all__ = ['ContextError', 'ResolvedContext', 'resolve_context', 'ContextRun', 'route', 'relabel', 'handle_compacting',
           'with_max_tokens', 'split_turns', 'SUMMARY_OF', 'is_summary_request']

_GOING = (GENERATE, CONTINUE)
#: the ``data_dict`` key of a summary call's request (``policy: summarize``): the uuid it summarizes
SUMMARY_OF = 'mtflow_summary_of'


def is_summary_request(request: Any) -> bool:
    """Whether ``request`` is a compaction's summary call, not a turn of a request of the run
    (a run's progress does not count it as a turn)."""
    return SUMMARY_OF in (getattr(request, 'data_dict', None) or {})


class ContextError(RequestError):
    """A context budget that cannot work with this backend (larger than the model's context, no
    way to count prompt tokens, no per-turn ``max_tokens``), or a compaction that failed."""


def _max_tokens_of(request_config: Any) -> Optional[int]:
    if request_config is None:
        return None
    if isinstance(request_config, dict):
        return request_config.get('max_tokens')
    return getattr(request_config, 'max_tokens', None)


def with_max_tokens(request_config: Any, max_tokens: int) -> Any:
    """A copy of ``request_config`` (mtflow's or ms-swift's ``RequestConfig``, a dict, ``None``)
    with ``max_tokens`` set; the caller's object is never changed."""
    if request_config is None:
        return RequestConfig(max_tokens=max_tokens)
    if isinstance(request_config, dict):
        return {**request_config, 'max_tokens': max_tokens}
    model_copy = getattr(request_config, 'model_copy', None)
    if model_copy is not None:
        return model_copy(update={'max_tokens': max_tokens})
    if dataclasses.is_dataclass(request_config) and not isinstance(request_config, type):
        return dataclasses.replace(request_config, max_tokens=max_tokens)
    clone = copy.copy(request_config)
    clone.max_tokens = max_tokens
    return clone


@dataclasses.dataclass(frozen=True)
class ResolvedContext:
    """A budget resolved against one executor's backend and request config (built once)."""
    budget: ContextBudget
    context_length: Optional[int]
    per_turn: Optional[int]
    count_tokens: Optional[Callable[[Any], int]]
    #: the request config's own ``max_tokens`` (a call with that value needs no copy)
    config_max_tokens: Optional[int]

    def start(self) -> 'ContextRun':
        """The per-run state of this budget (one per :meth:`mtflow.Executor.run`)."""
        return ContextRun(self)

    def prompt_limit(self, max_tokens: int) -> Optional[int]:
        limits = [v for v in (self.budget.prompt_budget,
                              self.context_length - max_tokens if self.context_length else None) if v is not None]
        return min(limits) if limits else None


def resolve_context(budget: Optional[ContextBudget], rollout_fn: Any, request_config: Any) -> Optional[ResolvedContext]:
    """Check ``budget`` against the backend (its ``context_length`` and ``count_prompt_tokens``,
    when it has them) and the request config; ``None`` without a budget. Raises
    :class:`ContextError` naming the field to fix."""
    if budget is None:
        return None
    backend = rollout_fn
    while getattr(backend, '__wrapped__', None) is not None:  # a wrapper (mtflow run's turn log) over the backend
        backend = backend.__wrapped__
    model_length = getattr(backend, 'context_length', None)
    model_length = model_length if isinstance(model_length, int) and model_length > 0 else None
    length = budget.context_length or model_length
    if budget.context_length and model_length and budget.context_length > model_length:
        raise ContextError(f'context.context_length={budget.context_length} is larger than the model\'s context '
                           f'({model_length} tokens, as {type(backend).__name__} reports it); lower it or leave '
                           f'it unset to use the model\'s')
    config_max = _max_tokens_of(request_config)
    per_turn = budget.max_tokens or config_max
    fits_checked = length is not None or budget.prompt_budget is not None
    if length is not None and per_turn is None:
        raise ContextError('a context length needs a per-turn max_tokens: set context.max_tokens or '
                           'request_config.max_tokens')
    if length is not None and per_turn is not None and per_turn >= length:
        raise ContextError(f'the per-turn max_tokens ({per_turn}) leaves no room for a prompt in the context '
                           f'({length} tokens)')
    counter = budget.count_tokens or getattr(backend, 'count_prompt_tokens', None)
    if fits_checked and counter is None:
        raise ContextError(f'{type(backend).__name__} cannot count prompt tokens (no count_prompt_tokens): '
                           f'give context.count_tokens, a function request -> int')
    if budget.policy == 'summarize' and budget.summarizer is None and not callable(rollout_fn):
        raise ContextError('context.policy=summarize needs a summarizer or a callable rollout_fn')
    return ResolvedContext(budget, length, per_turn, counter if fits_checked else None, config_max)


def split_turns(messages: List[dict]) -> Tuple[List[dict], List[List[dict]]]:
    """``(head, turns)``: the leading system messages and the task (the first user message),
    then the rest as turns, each starting at an assistant message."""
    head: List[dict] = []
    k = 0
    while k < len(messages) and messages[k].get('role') == 'system':
        head.append(messages[k])
        k += 1
    if k < len(messages) and messages[k].get('role') == 'user':
        head.append(messages[k])
        k += 1
    turns: List[List[dict]] = []
    for message in messages[k:]:
        if message.get('role') == 'assistant' or not turns:
            turns.append([])
        turns[-1].append(message)
    return head, turns


def _dropped(messages: List[dict], keep: int, placeholder: str) -> List[dict]:
    head, turns = split_turns(messages)
    old, recent = (turns[:-keep], turns[-keep:]) if keep else (turns, [])
    out = [dict(m) for m in head]
    for turn in old:
        for m in turn:
            out.append(dict(m) if m.get('role') == 'assistant' else dict(m, content=placeholder))
    for turn in recent:
        out += [dict(m) for m in turn]
    return out


def _transcript(turns: List[List[dict]]) -> str:
    return '\n\n'.join(f'{m.get("role")}: {m.get("content") or ""}' for turn in turns for m in turn)


class ContextUse:
    """What a context budget counts for one request (``record.context_use``, made when the
    budget first checks it): response tokens used, the ``max_tokens`` of its next call, why its
    next prompt does not fit, its compactions."""
    __slots__ = ('used_tokens', 'counted_turn', 'next_max_tokens', 'over_budget', 'compactions', 'prompt_tokens')

    def __init__(self) -> None:
        self.used_tokens = 0  # response tokens used over its turns
        self.counted_turn = 0  # the last turn whose tokens were added to used_tokens
        self.next_max_tokens: Optional[int] = None
        self.over_budget: Optional[Dict[str, Any]] = None  # the counts of the check it failed (compacting)
        self.compactions = 0
        self.prompt_tokens: Optional[int] = None  # the last count of its next prompt


def use_of(rec: RequestRecord) -> ContextUse:
    """``rec``'s :class:`ContextUse` (made on first use)."""
    use = rec.context_use
    if use is None:
        use = rec.context_use = ContextUse()
    return use


class ContextRun:
    """One run's budget: the checks, the model call and the compactions. What it counts per
    request lives on the request's record (:class:`ContextUse`)."""

    def __init__(self, resolved: ResolvedContext) -> None:
        self.resolved = resolved
        self.budget = resolved.budget

    # ---- the check ----------------------------------------------------------------------------
    def _used(self, rec: RequestRecord) -> int:
        use = use_of(rec)
        if rec.turns > use.counted_turn:
            use.used_tokens += rec.tokens
            use.counted_turn = rec.turns
        return use.used_tokens

    def check(self, rec: RequestRecord) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """``(fits, counts)``: whether the next turn of ``rec`` may be sent, and what the trace
        records about it: the turn's tokens against the budget (``prompt_tokens`` when counted,
        ``max_tokens``, ``context_length``, ``prompt_limit``, ``used_response_tokens`` and
        ``total_response_tokens``, each when the budget has it; ``max_tokens_asked`` when
        ``max_tokens`` was cut), on every turn, so that the viewer can show each turn against the
        budget; a run without a budget never gets here."""
        resolved, budget = self.resolved, self.budget
        used = self._used(rec)
        asked = resolved.per_turn
        max_tokens = asked
        total = budget.total_response_tokens
        counts: Dict[str, Any] = {}
        if total is not None:
            left = total - used
            counts.update(used_response_tokens=used, total_response_tokens=total)
            if left <= 0:
                counts['why'] = LENGTH_TOTAL
                return False, counts
            if max_tokens is None or left < max_tokens:
                max_tokens = left
        if resolved.count_tokens is not None:
            prompt = use_of(rec).prompt_tokens = int(resolved.count_tokens(rec.request))
            limit = resolved.prompt_limit(max_tokens or 0)
            if limit is not None and prompt > limit:
                counts.update(why=CONTEXT_FULL, prompt_tokens=prompt, prompt_limit=limit, max_tokens=max_tokens,
                              context_length=resolved.context_length)
                return False, counts
            counts['prompt_tokens'] = prompt
            if limit is not None:
                counts['prompt_limit'] = limit
        use_of(rec).next_max_tokens = max_tokens
        if max_tokens is not None:
            counts['max_tokens'] = max_tokens
            if asked is not None and max_tokens < asked:
                counts['max_tokens_asked'] = asked
        if resolved.context_length is not None:
            counts['context_length'] = resolved.context_length
        return True, counts or None

    def view(self, rec: RequestRecord, turn: int) -> BudgetView:
        why = use_of(rec).over_budget or {}
        resolved = self.resolved
        max_tokens = why.get('max_tokens') or resolved.per_turn or 0
        return BudgetView(resolved.context_length, resolved.prompt_limit(max_tokens), why.get('prompt_tokens', 0),
                          max_tokens, use_of(rec).used_tokens, turn, resolved.count_tokens or (lambda r: 0))

    # ---- the model call -----------------------------------------------------------------------
    def config_for(self, rec: RequestRecord, request_config: Any) -> Any:
        """The request config of ``rec``'s next call (a copy when its ``max_tokens`` differs;
        :func:`mtflow.engine.model_call.model_calls` makes one call per distinct config)."""
        max_tokens = use_of(rec).next_max_tokens
        if max_tokens is None or max_tokens == self.resolved.config_max_tokens:
            return request_config
        return with_max_tokens(request_config, max_tokens)

    # ---- compaction ---------------------------------------------------------------------------
    def compacted_messages(self, run: RunState, rec: RequestRecord, turn: int) -> Tuple[List[dict], Dict[str, Any]]:
        """The policy's new messages for ``rec`` and what the trace records about them."""
        budget = self.budget
        messages = list(rec.request.messages)
        if callable(budget.policy):
            new = budget.policy(rec.request, self.view(rec, turn))
            if not isinstance(new, list) or not all(isinstance(m, dict) and 'role' in m for m in new):
                raise ContextError(f'on_context_full must return a list of {{role, content}} dicts, got '
                                   f'{type(new).__name__}', uuid=rec.uuid, turn=turn, field='on_context_full')
            return new, {}
        if budget.policy == 'drop_observations':
            new = _dropped(messages, budget.keep_last_turns, budget.placeholder)
            return new, {'dropped': sum(1 for a, b in zip(messages, new) if a.get('content') != b.get('content'))}
        head, turns = split_turns(messages)
        keep = budget.keep_last_turns
        old, recent = (turns[:-keep], turns[-keep:]) if keep else (turns, [])
        if not old:
            return messages, {'summarized_turns': 0}
        summary, info = self.summarize(run, rec, old, turn)
        new = [dict(m) for m in head] + [{'role': 'user', 'content': f'Summary of the earlier turns:\n{summary}'}]
        new += [dict(m) for t in recent for m in t]
        return new, {'summarized_turns': len(old), **info}

    def summarize(self, run: RunState, rec: RequestRecord, old: List[List[dict]], turn: int) -> Tuple[str, dict]:
        """The summary of ``old``: the budget's ``summarizer(messages)``, else one call of the run's
        own ``rollout_fn`` (uuid ``<uuid>:summary-<n>``, ``max_tokens=summary_max_tokens``)."""
        budget = self.budget
        flat = [dict(m) for t in old for m in t]
        t0 = perf_counter()
        if budget.summarizer is not None:
            text = budget.summarizer(flat)
            if not isinstance(text, str):
                raise ContextError(f'the summarizer must return a str, got {type(text).__name__}', uuid=rec.uuid,
                                   turn=turn, field='summarizer')
            return text, {'summary_s': round(perf_counter() - t0, 6)}
        n = use_of(rec).compactions + 1
        request = RolloutInferRequest(messages=[{'role': 'system', 'content': budget.summary_prompt},
                                                {'role': 'user', 'content': _transcript(old)}],
                                      uuid=f'{rec.uuid}:summary-{n}', data_dict={SUMMARY_OF: rec.uuid})
        config = with_max_tokens(run.settings.request_config, budget.summary_max_tokens)
        outputs = run.settings.rollout_fn([request], config)
        if hasattr(outputs, '__await__'):
            outputs = run.await_value(outputs)
        [out] = list(outputs)
        choice = out.response.choices[0]
        text = choice.message.content
        if not isinstance(text, str):
            raise ContextError('the summary call returned no text', uuid=rec.uuid, turn=turn, field='summary')
        return text, {'summary_uuid': request.uuid, 'summary_tokens': len(choice.token_ids or []),
                      'summary_s': round(perf_counter() - t0, 6)}


def relabel(run: RunState, rec: RequestRecord, reason: str) -> str:
    """The finish reason of a turn that stopped on ``length`` because its ``max_tokens`` was cut
    to the rest of the total budget and used it up: ``length_total`` (else ``reason``)."""
    ctx = run.context
    if ctx is None or reason != LENGTH or ctx.budget.total_response_tokens is None:
        return reason
    asked, sent = ctx.resolved.per_turn, use_of(rec).next_max_tokens
    if sent is None or (asked is not None and sent >= asked):
        return reason
    return LENGTH_TOTAL if ctx._used(rec) >= ctx.budget.total_response_tokens else reason


def route(run: RunState, moves: Sequence[Move], turn: int) -> Sequence[Move]:
    """``moves`` with every move into ``generating``/``continuing`` checked against the budget
    (no budget: ``moves`` itself): a request that does not fit gets ``compact`` instead, one whose
    ``max_tokens`` was cut keeps its move with the counts in ``extra['context']``."""
    ctx = getattr(run, 'context', None)
    if ctx is None:
        return moves
    if moves.__class__ is TurnMoves:
        ending = moves.ending or {}
        for k, rec in enumerate(moves.records):
            if k in ending or moves.triggers[k] not in _GOING:
                continue
            extra = moves.extras[k] if moves.extras is not None else None
            trigger, extra, failed = _checked(ctx, rec, turn, moves.triggers[k], extra)
            if failed is not None:
                ending[k] = failed
                moves.ending = ending
                moves.triggers[k] = failed.trigger
                continue
            moves.triggers[k] = trigger
            if extra is not None:
                if moves.extras is None:
                    moves.extras = [None] * len(moves.records)
                moves.extras[k] = extra
        return moves
    out: List[Move] = []
    for mv in moves:
        if mv.trigger not in _GOING:
            out.append(mv)
            continue
        trigger, extra, failed = _checked(ctx, mv.record, turn, mv.trigger, mv.extra)
        out.append(failed if failed is not None else dataclasses.replace(mv, trigger=trigger, extra=extra))
    return out


def _checked(ctx: ContextRun, rec: RequestRecord, turn: int, trigger: str,
             extra: Optional[dict]) -> Tuple[str, Optional[dict], Optional[Move]]:
    """``(trigger, extra, None)`` of one move into ``generating``/``continuing`` after the check
    (``compact`` when it does not fit); ``(.., .., fail move)`` when the prompt cannot be counted."""
    try:
        fits, counts = ctx.check(rec)
    except Exception as exc:
        err = ContextError(f'cannot count the prompt tokens: {type(exc).__name__}: {exc}', uuid=rec.uuid, turn=turn,
                           field='count_tokens')
        return trigger, extra, fail_move(rec, turn, 'compacting', err)
    if counts is not None:
        extra = {**(extra or {}), 'context': counts}
    if fits:
        return trigger, extra, None
    use_of(rec).over_budget = counts or {}
    return COMPACT, extra, None


def handle_compacting(run: RunState, records: List[RequestRecord], turn: int) -> List[Move]:
    """``compacting``: per record, ``finish`` (``length_total``; ``context_full`` under ``stop``
    or when the compacted prompt still does not fit), ``generate``/``continue_message`` with the
    compacted messages (the training segment closed first), or ``fail`` (phase ``compacting``:
    the policy raised, or ran past ``step_timeout_s``: reason ``timeout``). Compactions run one
    request at a time, each under the deadline, so one failing summary fails only its request."""
    ctx: ContextRun = run.context
    budget = ctx.budget
    moves: List[Move] = []
    exact_ids = getattr(run.accounting, 'name', None) == 'record'
    todo: List[RequestRecord] = []
    for rec in records:
        why = use_of(rec).over_budget or {}
        if why.get('why') == LENGTH_TOTAL:
            moves.append(Move(rec, FINISH, turn, reason=LENGTH_TOTAL, extra={'context': why}))
        elif budget.policy == 'stop':
            moves.append(Move(rec, FINISH, turn, reason=CONTEXT_FULL, extra={'context': why}))
        else:
            todo.append(rec)
            moves.append(None)  # type: ignore[arg-type]
    if todo:
        args = [(run, rec, turn) for rec in todo]
        values, problems, durations = run.caller.values(ctx.compacted_messages, args, False,
                                                        run.options.step_timeout_s)
        done = iter(range(len(todo)))
        for pos, mv in enumerate(moves):
            if mv is not None:
                continue
            k = next(done)
            rec = todo[k]
            if problems is not None and k in problems:
                moves[pos] = _failed(rec, turn, problems[k])
                continue
            moves[pos] = _compacted(run, ctx, rec, turn, values[k], exact_ids,
                                    durations[k] if durations is not None else None)
    for rec in records:
        use_of(rec).over_budget = None
    return moves


def _failed(rec: RequestRecord, turn: int, outcome: Outcome) -> Move:
    if outcome.kind == TIMED_OUT:
        err = StepTimeout(f'compacting did not return within {outcome.value:g} s', uuid=rec.uuid, turn=turn,
                          field='compacting')
        return fail_move(rec, turn, 'compacting', err, TIMEOUT)
    exc = outcome.value
    if not isinstance(exc, MtflowError):
        wrapped = ContextError(f'compaction failed: {type(exc).__name__}: {exc}', uuid=rec.uuid, turn=turn,
                               field='compacting')
        wrapped.__cause__ = exc
        exc = wrapped
    return fail_move(rec, turn, 'compacting', exc)


def _compacted(run: RunState, ctx: ContextRun, rec: RequestRecord, turn: int, value: Any, exact_ids: bool,
               duration: Optional[float]) -> Move:
    """The move after a compaction returned ``(messages, info)``: the segment closed, the
    messages replaced in place, then the check again."""
    why = use_of(rec).over_budget or {}
    new_messages, info = value
    if new_messages == list(rec.request.messages):  # nothing left to compact
        return Move(rec, FINISH, turn, reason=CONTEXT_FULL,
                    extra={'context': why, 'compaction': {'policy': ctx.budget.policy_name, 'changed': False}})
    messages = rec.request.messages
    old_messages = list(messages)
    messages[:] = new_messages
    fits, counts = ctx.check(rec)  # counted on the compacted messages
    messages[:] = old_messages
    compaction = {'policy': ctx.budget.policy_name, 'prompt_tokens_before': why.get('prompt_tokens'), **info}
    if use_of(rec).prompt_tokens is not None:
        compaction['prompt_tokens_after'] = use_of(rec).prompt_tokens
    extra: Dict[str, Any] = {'compaction': compaction}
    if counts is not None:
        extra['context'] = counts
    if not fits:  # the trajectory ends as it was: no segment is cut, the messages stay
        compaction['fits'] = False
        return Move(rec, FINISH, turn, reason=counts.get('why', CONTEXT_FULL) if counts else CONTEXT_FULL,
                    extra={'context': why, **extra})
    segment = cut_segment(rec, exact_ids)
    messages[:] = new_messages
    use = use_of(rec)
    use.compactions += 1
    rec.infos['compactions'] = use.compactions
    compaction['segment'] = segment['segment'] + 1
    return wait_move(rec, turn, duration, extra)
