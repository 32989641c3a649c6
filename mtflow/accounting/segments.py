"""How one turn's token ids, loss mask and logprobs join a request's trajectory.

These are the contract's rules (``docs/contract.md``), kept apart from the turn loop so that they
can be read, tested and swapped as one piece: :class:`ContractAccounting` is the behaviour of
ms-swift's original driver; ``mtflow.integrations.swift`` may supply the variant of ms-swift 4.6,
whose schedulers keep assistant messages as exact token ids.

Every method validates before it mutates, so a bad scheduler result leaves the record exactly as
it was, and the request's partial output loses nothing.
"""
from __future__ import annotations

from collections import abc
from typing import Any, Dict, List, Optional, Tuple

from mtflow.core.errors import SchedulerResultError
from mtflow.core.machine import RequestRecord
from mtflow.core.protocol import extract_logprobs
from mtflow.core.validate import check_ids, check_infos, check_logprobs, check_mask

def is_continuation_of(messages: List[Dict[str, Any]]) -> bool:
    """Whether the next output continues the last assistant message, judged the way the contract
    applies it: a trailing assistant placeholder (content ``None``) is dropped first."""
    if not messages:
        return False
    last = messages[-1]
    if last.get('content') is None and last.get('role') == 'assistant':
        if len(messages) < 2:
            return False
        last = messages[-2]
    return last.get('role') == 'assistant'


def checked_logprobs(record: RequestRecord) -> List[List[float]]:
    """The logprob segments, kept only if they cover exactly the trained tokens.

    Their total must equal the number of 1s in the loss mask (when there is a mask) or the number
    of token ids (when there are ids but no mask); otherwise importance sampling would pair
    logprobs with the wrong tokens, so ``[]`` is returned and the trainer skips the correction."""
    logprobs = record.logprobs
    if not logprobs:
        return logprobs
    total = sum(map(len, logprobs))
    if record.mask:
        return logprobs if total == sum(map(sum, record.mask)) else []
    if record.ids:
        return logprobs if total == sum(map(len, record.ids)) else []
    return []


class ContractAccounting:
    """The contract's rules for messages and segments (ms-swift's original ``run_multi_turn``)."""

    name = 'contract'
    #: whether hooks need :meth:`materialize` / :meth:`restore` around them (ms-swift 4.6 does)
    materializes = False

    def materialize(self, records: List[RequestRecord]) -> Any:
        return None

    def restore(self, snapshots: Any) -> None:
        return None

    def append_completion(self, record: RequestRecord, completion: Any) -> bool:
        """Apply the output text to the messages; return whether this turn is a continuation."""
        messages = record.request.messages
        if messages and messages[-1]['content'] is None and messages[-1]['role'] == 'assistant':
            messages.pop()  # the placeholder a continuation request carries
        if messages and messages[-1]['role'] == 'assistant':
            messages[-1]['content'] += completion
            return True
        messages.append({'role': 'assistant', 'content': completion})
        return False

    def finalize(self, record: RequestRecord, choice: Any, turn_result: Dict[str, Any]) -> None:
        """The request stops: its last output's ids, a mask of 1s and its logprobs join the
        trajectory. ``token_ids=None`` on a continuation adds no ids (the original loop raised
        a TypeError there)."""
        ids = choice.token_ids
        join_final(record, ids, [1] * len(ids) if ids else None, extract_logprobs(choice))

    def accumulate_step(self, record: RequestRecord, choice: Any, result: Dict[str, Any], turn: int) -> Any:
        """The request goes on: apply the step's ids, mask, infos and logprobs; return the next
        request. Raises :class:`SchedulerResultError` (record untouched) on a bad result."""
        next_request, infos = check_step_result(record, result, turn)
        get = result.get
        ids: Optional[List[int]] = get('response_token_ids')
        mask: Optional[List[int]] = get('response_loss_mask')
        if mask is not None:
            if ids is None:
                raise SchedulerResultError(
                    'response_loss_mask was returned without response_token_ids',
                    uuid=record.uuid,
                    turn=turn,
                    field='response_loss_mask')
            if len(mask) != len(ids):
                raise SchedulerResultError(
                    f'response_loss_mask has {len(mask)} values but response_token_ids has {len(ids)}',
                    uuid=record.uuid,
                    turn=turn,
                    field='response_loss_mask')

        # extend_or_append and join_step_logprobs, inlined: this runs once per request and turn
        extend = record.is_continuation
        if ids is not None:
            segments = record.ids
            if extend and segments:
                segments[-1].extend(ids)
            else:
                segments.append(list(ids))
        if mask is not None:
            segments = record.mask
            if extend and segments:
                segments[-1].extend(mask)
            else:
                segments.append(list(mask))
        if infos:
            record.infos.update(infos)
        logprobs = get('rollout_logprobs') or extract_logprobs(choice)
        if logprobs:
            segments = record.logprobs
            if extend and segments:
                segments[-1].extend(logprobs)
            else:
                segments.append(list(logprobs))
        return next_request


# ---- pieces shared by every accounting (the contract's and ms-swift 4.6's) ---------------------
def extend_or_append(segments: List[list], values: List[Any], continuing: bool) -> None:
    """A continuation extends the last segment (when there is one); anything else opens a new one."""
    if continuing and segments:
        segments[-1].extend(values)
    else:
        segments.append(list(values))


def join_final(record: RequestRecord, ids: Optional[List[int]], mask: Optional[List[int]],
               logprobs: List[float]) -> None:
    """The stopping turn's ids, mask and logprobs join the trajectory (the contract's three cases).

    - a continuation with earlier id segments extends the last segments;
    - with no id segment yet, the ids become the first segment and non-empty logprobs *replace*
      the logprob segments collected so far;
    - otherwise they are new segments (logprobs even when there were no ids)."""
    if record.is_continuation and record.ids:
        if ids:
            record.ids[-1].extend(ids)
            if record.mask:
                record.mask[-1].extend(mask)
        if record.logprobs and logprobs:
            record.logprobs[-1].extend(logprobs)
    elif not record.ids:
        if ids:
            record.ids = [list(ids)]
            record.mask = [list(mask)]
        if logprobs:
            record.logprobs = [list(logprobs)]
    else:
        if ids:
            record.ids.append(list(ids))
            record.mask.append(list(mask))
        if logprobs:
            record.logprobs.append(list(logprobs))


def join_step_logprobs(record: RequestRecord, choice: Any, result: Dict[str, Any]) -> None:
    """A step's non-empty ``rollout_logprobs``, else the choice's, join the logprob segments."""
    logprobs = result.get('rollout_logprobs') or extract_logprobs(choice)
    if logprobs:
        extend_or_append(record.logprobs, logprobs, record.is_continuation)


def check_step_result(record: RequestRecord, result: Any, turn: int) -> Tuple[Any, Optional[Dict[str, Any]]]:
    """The envelope every step result must have: a dict with a usable ``infer_request`` and, if
    present, dict ``rollout_infos``. Returns ``(next_request, infos)``; raises
    :class:`SchedulerResultError` naming the request, the turn and the field."""
    if result.__class__ is not dict and not isinstance(result, dict):
        hint = ''
        if hasattr(result, '__await__'):
            hint = ' (declare step as async def, or return a dict)'
            getattr(result, 'close', lambda: None)()  # never awaited: close it quietly
        raise SchedulerResultError(
            f'step() must return a dict, got {type(result).__name__}{hint}', uuid=record.uuid, turn=turn, field='step')
    get = result.get
    next_request = get('infer_request')
    if next_request is None:
        raise SchedulerResultError(
            'step() result has no infer_request (the request for the next turn)',
            uuid=record.uuid,
            turn=turn,
            field='infer_request')
    messages = getattr(next_request, 'messages', None)
    if (messages.__class__ is not list and not isinstance(messages, list)) or not messages:
        raise SchedulerResultError(
            'infer_request must have a non-empty messages list', uuid=record.uuid, turn=turn, field='infer_request')
    infos = get('rollout_infos')
    if infos is not None and infos.__class__ is not dict and not isinstance(infos, abc.Mapping):
        try:
            infos = check_infos(infos, record.uuid, turn)  # key/value pairs, as dict.update takes them
        except SchedulerResultError as exc:
            raise SchedulerResultError(f'rollout_infos {exc.detail}', uuid=record.uuid, turn=turn,
                                       field='rollout_infos') from None
    if len(result) > 1:
        value = get('response_token_ids')
        if value is not None:
            check_ids(value, record.uuid, turn, 'response_token_ids')
        value = get('response_loss_mask')
        if value is not None:
            check_mask(value, record.uuid, turn, 'response_loss_mask')
        value = get('rollout_logprobs')
        if value is not None:
            check_logprobs(value, record.uuid, turn, 'rollout_logprobs')
    return next_request, infos
