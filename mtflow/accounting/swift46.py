"""ms-swift 4.6's token accounting, for schedulers that keep assistant messages as exact token ids.

ms-swift 4.6's ``swift.rollout.agent_loop.run_multi_turn`` is newer than mtflow's contract: it
asks the scheduler itself how a completion joins the conversation and which ids/mask a turn
contributes (``append_assistant_completion``, ``get_response_token_data``), freezes the latest
assistant message as exact token ids for the next turn (``set_assistant_message_token_ids``) so
that re-tokenizing text never changes what the model saw, and decodes those ids back to text only
while text-oriented hooks run (``snapshot_and_materialize_assistant_messages`` /
``restore_assistant_message_snapshots``).

:class:`Swift46Accounting` is that behaviour behind the interface of
:class:`mtflow.accounting.segments.ContractAccounting`, so mtflow's executor produces, field for field, what
the installed ms-swift driver produces for such a scheduler (``tests/swift/test_differential.py``
checks it against the real package). The executor picks it for any scheduler whose class has
``append_assistant_completion`` (:func:`mtflow.accounting.segments.accounting_for`), so ``run_multi_turn``
stays a drop-in for ms-swift schedulers; the ms-swift integration also passes it in explicitly.

It is part of the core (not of ``mtflow.integrations``) because it is a set of rules over five
scheduler methods, not ms-swift code; ``mtflow.accounting.swift46`` re-exports it.

It never imports ms-swift: everything goes through the scheduler's own methods, so it works for
ms-swift's classes and for any object that implements the same methods.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

from mtflow.core.errors import SchedulerResultError
from mtflow.core.machine import RequestRecord
from mtflow.core.protocol import extract_logprobs
from mtflow.accounting.segments import check_step_result, join_final, join_step_logprobs

__all__ = ['Swift46Accounting']


class Swift46Accounting:
    """ms-swift 4.6's rules for messages and segments, driven by the scheduler's own methods.

    Differences from the contract (:class:`~mtflow.accounting.segments.ContractAccounting`), all as in
    ms-swift 4.6:

    - the completion is applied by ``scheduler.append_assistant_completion`` (which decodes an
      id-backed assistant message before a continuation appends text to it);
    - a turn's ids and mask come from ``scheduler.get_response_token_data`` (which may prepend a
      template's response prefix as masked ids), computed *before* ``step`` runs and recomputed
      with the step's ``response_token_ids`` / ``response_loss_mask`` when it returns either; a
      mask may be returned alone when it matches the choice's ids;
    - on stop, the ``on_turn_end`` result's ``response_token_ids``, ``response_loss_mask`` and
      ``rollout_logprobs`` are used when present;
    - after each step, the next request's latest assistant message becomes the last id segment
      (``scheduler.set_assistant_message_token_ids``);
    - hooks (``on_turn_end``, ``check_finished``) see id-backed assistant messages decoded to
      text; they are restored afterwards (:meth:`materialize` / :meth:`restore`).
    """

    name = 'swift46'
    materializes = True

    def __init__(self, scheduler: Any) -> None:
        missing = [m for m in _REQUIRED if not callable(getattr(scheduler, m, None))]
        if missing:
            raise TypeError(f'{type(scheduler).__name__} lacks the ms-swift 4.6 method(s) {", ".join(missing)}; '
                            f'use mtflow.accounting.segments.ContractAccounting for it')
        self.scheduler = scheduler
        # (ids, mask) computed before each request's step, keyed by the record (id) until used
        self._pre_step: Dict[int, Tuple[List[int], List[int]]] = {}

    # ---- hooks see text ----------------------------------------------------------------------
    def materialize(self, records: List[RequestRecord]) -> List[Any]:
        """Decode id-backed assistant messages for the hooks; returns what :meth:`restore` needs."""
        snap = self.scheduler.snapshot_and_materialize_assistant_messages
        return [snap(rec.request) for rec in records]

    def restore(self, snapshots: List[Any]) -> None:
        restore = self.scheduler.restore_assistant_message_snapshots
        for snapshot in snapshots:
            restore(snapshot)

    # ---- applying an output ------------------------------------------------------------------
    def append_completion(self, record: RequestRecord, completion: Any) -> bool:
        messages = record.request.messages
        if messages[-1]['content'] is None and messages[-1]['role'] == 'assistant':
            messages.pop()  # the placeholder a continuation request carries
        return bool(self.scheduler.append_assistant_completion(record.request, completion))

    def _token_data(self, record: RequestRecord, choice: Any, turn: Optional[int], phase: str,
                    ids: Optional[List[int]] = None, mask: Optional[List[int]] = None) -> Tuple[List[int], List[int]]:
        """``scheduler.get_response_token_data``, with its assertions turned into errors that
        name the request, the turn and the field."""
        try:
            return self.scheduler.get_response_token_data(
                record.request,
                choice,
                is_continuation=record.is_continuation,
                response_token_ids=ids,
                response_loss_mask=mask)
        except AssertionError as exc:
            field = 'response_loss_mask'
            raise SchedulerResultError(f'{phase}: {exc or "invalid response_token_ids/response_loss_mask"}',
                                       uuid=record.uuid, turn=turn, field=field) from exc

    # ---- the request stops -------------------------------------------------------------------
    def finalize(self, record: RequestRecord, choice: Any, turn_result: Mapping[str, Any]) -> None:
        """The last turn's ids/mask/logprobs join the trajectory (``turn_result`` is the
        ``on_turn_end`` result: its ``response_token_ids``/``response_loss_mask``/
        ``rollout_logprobs`` take precedence, as in ms-swift 4.6)."""
        self._pre_step.pop(id(record), None)
        logprobs = extract_logprobs(choice)
        if 'rollout_logprobs' in turn_result:
            logprobs = turn_result['rollout_logprobs'] or []
        final_ids, final_mask = self._token_data(
            record,
            choice,
            None,
            'on_turn_end',
            ids=turn_result.get('response_token_ids'),
            mask=turn_result.get('response_loss_mask'))
        join_final(record, final_ids, final_mask, logprobs)

    # ---- the request goes on -----------------------------------------------------------------
    def before_step(self, record: RequestRecord, choice: Any, turn: int) -> None:
        """ms-swift 4.6 computes the turn's ids/mask before ``step`` runs (a step may change the
        request); the executor calls this right before the step."""
        self._pre_step[id(record)] = self._token_data(record, choice, turn, 'step')

    def accumulate_step(self, record: RequestRecord, choice: Any, result: Any, turn: int) -> Any:
        """Apply the step's ids, mask, infos and logprobs; freeze the latest assistant message of
        the next request as the last id segment; return the next request. Everything is checked
        before anything changes, so a bad result leaves the record as it was."""
        pre = self._pre_step.pop(id(record), None)
        next_request, infos = check_step_result(record, result, turn)
        step_ids, step_mask = result.get('response_token_ids'), result.get('response_loss_mask')
        if step_ids is not None or step_mask is not None:
            turn_ids, turn_mask = self._token_data(record, choice, turn, 'step', ids=step_ids, mask=step_mask)
        elif pre is not None:
            turn_ids, turn_mask = pre
        else:  # an executor without before_step: the same call, after the step
            turn_ids, turn_mask = self._token_data(record, choice, turn, 'step')

        continuing = record.is_continuation
        if turn_ids:
            if continuing and record.ids:
                record.ids[-1].extend(turn_ids)
                record.mask[-1].extend(turn_mask)
            else:
                record.ids.append(turn_ids)
                record.mask.append(turn_mask)
        if infos is not None:
            record.infos.update(infos)
        join_step_logprobs(record, choice, result)
        if record.ids:
            self.scheduler.set_assistant_message_token_ids(next_request, record.ids[-1])
        return next_request


_REQUIRED = ('append_assistant_completion', 'get_response_token_data', 'set_assistant_message_token_ids',
             'snapshot_and_materialize_assistant_messages', 'restore_assistant_message_snapshots')

