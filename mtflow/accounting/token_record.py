"""The token-level record of one request: the exact ids every turn was generated from.

Re-rendering a conversation as text and tokenizing it again each turn conditions turn t+1 on ids
that are not the ids sampled at turn t (a reply cut inside a multi-byte character, BPE merges
across a message boundary, templates that strip earlier ``<think>`` blocks); training, which uses
the sampled ids, then optimises a sequence the model never saw. A :class:`TokenRecord` keeps the
sequence itself instead:

* the turn-1 prompt ids, rendered once from the chat template;
* for every turn, the ids exactly as sampled, and the ids appended after them before the next
  turn (the template's glue such as ``<|im_end|>\\n<|im_start|>user\\n``, observations, user
  messages), so that ``prompt[t+1] == prompt[t] + sampled[t] + appended[t]``.

Backends build and extend it (``mtflow.backends.tokens``); it travels with the request as
``request.token_record`` (a field of :class:`mtflow.RolloutInferRequest` that is never dumped, an
attribute on any other request object), so it survives schedulers that return the same request
or a copy of it. :class:`RecordAccounting` turns it into the trajectory's
``response_token_ids`` / ``response_loss_mask`` / ``rollout_logprobs``.

This module is plain data: it imports nothing outside the core.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from mtflow.core.machine import RequestRecord
from mtflow.core.types import Accounting
from mtflow.accounting.choose import accounting_for, keeps_messages_as_ids
from mtflow.accounting.segments import ContractAccounting

__all__ = ['TokenTurn', 'TokenRecord', 'RecordAccounting', 'record_of', 'record_accounting', 'native_accounting',
           'RECORD_ATTR', 'RESTART_KEY']

#: the attribute of a request that carries its record
RECORD_ATTR = 'token_record'
#: the ``rollout_infos`` key of a restarted record's :attr:`TokenRecord.restart`
RESTART_KEY = 'token_record_restart'


@dataclass
class TokenTurn:
    """One generation: what it was conditioned on and what it produced.

    ``prompt`` holds the full prompt ids only when they were rendered from text (turn 1, or a
    turn whose prompt could not extend the previous one); otherwise the prompt is the previous
    turn's prompt + its ``sampled`` + its ``appended`` and ``prompt`` is ``None``."""
    prompt_len: int
    sampled: List[int]
    prompt: Optional[List[int]] = None
    logprobs: Optional[List[float]] = None
    #: the ids appended after ``sampled`` before the next turn (filled when that turn is built)
    appended: List[int] = field(default_factory=list)
    #: this turn continued the previous assistant message (no new generation prompt)
    continuation: bool = False
    #: the prompt extends the previous turn's prompt + sampled + appended exactly
    extends: bool = True
    #: the template rendered the history the way it was rendered live (``False``: it rewrites
    #: earlier turns, e.g. strips ``<think>``; with the ``'exact'`` policy the ids were kept anyway)
    template_stable: bool = True
    #: why the prompt was rendered from text: ``'first'``, ``'history_changed'``,
    #: ``'template_rewrites_history'`` (``'rerender'`` policy), ``'no_record'``
    rendered: Optional[str] = None
    #: the policy version that sampled this turn (``mtflow.engine.versions``; ``None``: not tracked)
    version: Optional[int] = None
    #: a generation cut by a weight update and resumed (``mtflow.engine.resume``): the
    #: ``[start, end, version]`` of each part of ``sampled``; ``None``: one version sampled it all
    segments: Optional[List[List[int]]] = None

    def to_dict(self) -> Dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class TokenRecord:
    """The exact token history of one request (see the module docstring)."""
    turns: List[TokenTurn] = field(default_factory=list)
    #: the messages the model has seen, with the last completion applied (how the next request is
    #: checked to extend this history)
    history: List[Dict[str, Any]] = field(default_factory=list)
    #: the last turn's full prompt ids (so the next prompt is built without replaying the turns)
    last_prompt: List[int] = field(default_factory=list)
    #: template text that opened the current assistant message (the prefix-stability check)
    open_text: str = ''
    #: set when a turn's prompt was rendered from text after turn 1
    restarted: bool = False
    #: the request turn of ``turns[0]`` (a record restarted at turn 3 holds turns 3, 4, ...)
    first_turn: int = 1
    #: where and why the exact ids were first lost (``{'turn', 'why', 'changed'}``: the first turn
    #: rendered from text, the reason, what the history edit changed); kept across later restarts
    restart: Optional[Dict[str, Any]] = None

    # ---- reading -----------------------------------------------------------------------------
    @property
    def prompt_ids(self) -> List[int]:
        """The first rendered prompt (turn 1's)."""
        return list(self.turns[0].prompt or []) if self.turns else []

    @property
    def exact(self) -> bool:
        """Every turn after the first extended the previous one exactly."""
        return all(t.extends for t in self.turns[1:])

    def next_prefix(self) -> List[int]:
        """The ids every continuation of this history starts with: last prompt + last sampled."""
        return self.last_prompt + (self.turns[-1].sampled if self.turns else [])

    def sequence(self) -> List[int]:
        """All ids from turn 1's prompt to the last sampled token (exact when :attr:`exact`)."""
        ids = self.prompt_ids
        for turn in self.turns:
            ids += turn.sampled + turn.appended
        return ids

    def segments(self) -> Tuple[List[List[int]], List[List[int]], List[List[float]], List[List[int]]]:
        """The trajectory in ms-swift 4.6's layout: one segment per assistant message, holding
        exactly the ids of that message: the sampled ids of its turns (mask 1) and the text a
        continuation appended to it between them (observations, mask 0). The ids between two
        assistant messages (the template's glue, tool and user messages) are the *glue*: not
        trained, and rendered by a trainer from ``messages`` anyway; they are returned apart, so
        that ``prompt_ids + seg_1 + glue_1 + seg_2 + ... + seg_n`` is exactly the sequence the
        model saw. Logprob segments hold the sampled tokens' logprobs only (``[]`` when a turn
        had none), so their total equals the mask's 1s."""
        ids: List[List[int]] = []
        mask: List[List[int]] = []
        logprobs: List[List[float]] = []
        glue: List[List[int]] = []
        turns = self.turns
        have_logprobs = all(t.logprobs is not None and len(t.logprobs) == len(t.sampled) for t in turns)
        for i, turn in enumerate(turns):
            if not (turn.continuation and ids):
                ids.append([])
                mask.append([])
                if have_logprobs:
                    logprobs.append([])
            ids[-1] += turn.sampled
            mask[-1] += [1] * len(turn.sampled)
            if have_logprobs:
                logprobs[-1] += turn.logprobs or []
            if i + 1 < len(turns):
                if turns[i + 1].continuation:
                    ids[-1] += turn.appended
                    mask[-1] += [0] * len(turn.appended)
                else:
                    glue.append(list(turn.appended))
        return ids, mask, logprobs, glue

    def summary(self) -> Dict[str, Any]:
        """What ``rollout_infos['token_record']`` carries: the turn-1 prompt ids (a trainer needs
        them beside ``response_token_ids``) and where the ids were not kept exactly."""
        return {
            'prompt_ids': self.prompt_ids,
            'glue_ids': self.segments()[3],
            'exact': self.exact,
            'turns': len(self.turns),
            'rendered_turns': [i + 1 for i, t in enumerate(self.turns) if t.rendered and i > 0],
            'template_unstable_turns': [i + 1 for i, t in enumerate(self.turns) if not t.template_stable],
        }


def record_of(request: Any) -> Optional[TokenRecord]:
    """The record a request carries, if any."""
    rec = getattr(request, RECORD_ATTR, None)
    return rec if isinstance(rec, TokenRecord) else None


class RecordAccounting(ContractAccounting):
    """The contract's accounting, with a finished trajectory's ids, mask and logprobs taken from
    the token record its request carries (see :meth:`TokenRecord.segments`), and
    ``rollout_infos['token_record']`` (:meth:`TokenRecord.summary`: the turn-1 prompt ids and
    the glue between segments).

    The ids always come from the record. Where the scheduler's own segments (``step``'s
    ``response_token_ids`` / ``response_loss_mask``) have the record's shape, their mask is kept
    (the scheduler said what to train); otherwise the record's mask (sampled 1, appended 0).
    The record is used only when it describes this trajectory: it was never restarted from text,
    it holds every model turn the request had (not so when the caller handed in the first turn's
    outputs) and its last turn's sampled ids are the final choice's ids. Otherwise (a backend without a
    record, a scheduler that edited the history) the contract's segments stay."""

    name = 'record'

    def finalize(self, record: RequestRecord, choice: Any, turn_result: Dict[str, Any]) -> None:
        super().finalize(record, choice, turn_result)
        self.finalize_after_step(record, choice)

    def finalize_after_step(self, record: RequestRecord, choice: Any) -> None:
        """The record's ids for a request whose last turn a step already accumulated (it finishes
        from ``compacting``: ``context_full``, ``length_total``)."""
        rec = record_of(record.request)
        if rec is not None and rec.restart is not None:
            record.infos[RESTART_KEY] = dict(rec.restart)  # samples name the first turn that lost the ids
        if rec is None or rec.restarted or not rec.turns or choice is None:
            return
        if list(choice.token_ids or []) != rec.turns[-1].sampled:
            return
        if len(rec.turns) != record.turns - record.segment_start:  # a turn the backend never saw (first_turn_outputs
            # given); after a compaction the record holds the turns of the last segment only
            return
        ids, mask, logprobs, _ = rec.segments()
        if len(record.mask) == len(mask) and all(len(a) == len(b) for a, b in zip(record.mask, mask)):
            mask = record.mask
        record.ids, record.mask, record.logprobs = ids, mask, logprobs
        record.infos['token_record'] = rec.summary()


def record_accounting(scheduler: Any) -> Optional[RecordAccounting]:
    """The accounting for ``mtflow run`` and other drivers: :class:`RecordAccounting`, except for
    ms-swift 4.6-style schedulers (``append_assistant_completion``), which keep their own exact-id
    semantics (``None``: the executor's default picks it)."""
    if keeps_messages_as_ids(scheduler):
        return None
    return RecordAccounting()


def native_accounting(scheduler: Any) -> Accounting:
    """The default of :class:`mtflow.Executor` (the native API): every turn's exact ids whenever
    the backend keeps a token record (:class:`RecordAccounting`, which is the contract's
    accounting, unchanged, for requests without a record), ms-swift 4.6's for schedulers that keep
    assistant messages as ids. ``run_multi_turn`` keeps :func:`accounting_for` (the contract's
    outputs, field for field), so a drop-in caller sees what ms-swift's driver returns."""
    return record_accounting(scheduler) or accounting_for(scheduler)
