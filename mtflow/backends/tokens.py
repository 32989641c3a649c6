"""Token-in/token-out prompts: each turn's prompt is the previous prompt + the ids sampled at the
previous turn + the template's delta for what was appended after them, tokenized alone.

:class:`TokenPrompter` is what the HF and vLLM backends (and the OpenAI backend's token mode) use
to build prompts. For each request it reads the :class:`~mtflow.accounting.token_record.TokenRecord` the
request carries (or, when a scheduler returned a new request object, the one kept for its uuid)
and checks that the new messages extend the history the model saw, with the last completion
applied. Then:

* **a new turn** (messages were appended after the assistant message): the delta is the text the
  template renders after that assistant message, found by rendering the history with a sentinel
  in place of the assistant content: ``render(history' + new, add_generation_prompt=True)``
  minus everything up to the sentinel. That is the message's closing glue (``<|im_end|>\\n``),
  the new messages and the generation prompt; a closing special token the model already sampled
  (its EOS) is not repeated. The delta is tokenized alone (``add_special_tokens=False``);
* **a continuation** (the last assistant message continues): the delta is the text appended to
  that message since (often ``''``), tokenized alone;
* **anything else** (the first turn, a scheduler that rewrote or dropped history, a request whose
  record was lost): the chat is rendered from text and the turn says why (``rendered``).

Templates that are not prefix-stable (Qwen3-style templates strip ``<think>`` from earlier
assistant turns; some render an empty think block in the generation prompt only) are detected
per turn by comparing the template's rendering of the real history with the rendering that
extends what the model saw. ``policy='exact'`` (default) keeps the exact ids anyway and marks the
turn ``template_stable=False``; ``policy='rerender'`` renders such turns from text and records
that the prompt does not extend the previous one (``extends=False``).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os.path
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from mtflow.accounting.token_record import RECORD_ATTR, TokenRecord, TokenTurn, record_of
from mtflow.backends.base import BackendError, Chat, prepare_chat
from mtflow.backends.chat_templates import TemplateSource, resolve_chat_template
from mtflow.core.protocol import extract_logprobs

__all__ = ['TokenPrompter', 'PromptPlan', 'POLICIES', 'render_text', 'what_changed']

POLICIES = ('exact', 'rerender')
#: replaces the assistant content when the template's glue is measured; never in real text
SENTINEL = '\u2063mtflow-sentinel-7c1f\u2063'


def render_text(tokenizer: Any, chat: Chat, messages: Optional[List[Dict[str, Any]]] = None,
                chat_template: Optional[str] = None, continuation: Optional[bool] = None, where: str = '',
                generation: Optional[bool] = None) -> str:
    """The chat template's text for ``messages`` (default: the chat's) with the chat's tools and
    template kwargs; a generation prompt unless the turn continues the last assistant message
    (``generation=False``: neither, the conversation as it stands). ``tool_calls`` arguments given
    as JSON strings (OpenAI's shape) reach the template as dicts, as vLLM's server gives them
    (transformers' convention; one that is not JSON as ``{}``), and as strings to a template that
    fails on dicts (DeepSeek-V3's concatenates them)."""
    kwargs: Dict[str, Any] = dict(chat.chat_template_kwargs)
    if chat.tools:
        kwargs['tools'] = chat.tools
    if chat_template is not None:
        kwargs['chat_template'] = chat_template
    cont = chat.continuation if continuation is None else continuation
    given = chat.messages if messages is None else messages
    decoded = _dict_arguments(given)
    for attempt in ([decoded, given] if decoded is not given else [given]):
        try:
            return tokenizer.apply_chat_template(
                attempt,
                tokenize=False,
                add_generation_prompt=not cont if generation is None else generation,
                continue_final_message=cont and generation is None,
                **kwargs)
        except Exception as exc:
            error = exc
    raise BackendError(f'{where}: the chat template failed: {error}') from error


def _dict_arguments(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``messages`` with each ``tool_calls`` entry's string ``arguments`` decoded (``{}`` when they
    are not a JSON object); the same list when no message has such calls."""
    if not any(isinstance(m, dict) and m.get('tool_calls') for m in messages):
        return messages
    out = []
    for m in messages:
        calls = m.get('tool_calls') if isinstance(m, dict) else None
        if calls:
            m = dict(m, tool_calls=[_decoded_call(c) for c in calls])
        out.append(m)
    return out


def _decoded_call(call: Any) -> Any:
    function = call.get('function') if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get('arguments'), str):
        return call
    try:
        args = json.loads(function['arguments']) if function['arguments'].strip() else {}
    except (ValueError, RecursionError):
        args = {}
    return dict(call, function=dict(function, arguments=args if isinstance(args, dict) else {}))


@dataclass
class PromptPlan:
    """One request's prompt for this turn, and what :meth:`TokenPrompter.commit` records once
    the turn has been generated (nothing is recorded for a turn that fails)."""
    ids: List[int]
    chat: Chat
    record: TokenRecord
    #: ids appended after the previous turn's sampled ids (``None`` when rendered from text)
    appended: Optional[List[int]]
    rendered: Optional[str]
    template_stable: bool
    open_text: str


class TokenPrompter:
    """Builds exact-id prompts for one tokenizer and chat template (see the module docstring).

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        chat_template: overrides the tokenizer's template: a file, Jinja text or a bundled name
            (:func:`~mtflow.backends.chat_templates.resolve_chat_template`).
        policy: ``'exact'`` or ``'rerender'`` for turns the template does not render prefix-stably.
        exact: ``False`` renders every turn from text (the old behaviour, kept for comparison:
            ``benchmarks/tokens.py`` measures the drift it causes); the record is still kept.
        max_tracked: how many requests' records are also kept by uuid (for schedulers that return
            a new request object each turn); the oldest are forgotten first.
    """

    def __init__(self, tokenizer: Any, chat_template: Union[None, str, TemplateSource] = None, *,
                 policy: str = 'exact', exact: bool = True, max_tracked: int = 65536) -> None:
        if policy not in POLICIES:
            raise BackendError(f"prefix policy must be 'exact' or 'rerender', not {policy!r}")
        self.tokenizer = tokenizer
        #: where the template came from (a file, Jinja text, a bundled name, the tokenizer's own)
        self.template_source = resolve_chat_template(chat_template)
        self.chat_template = self.template_source.text
        self.policy = policy
        self.exact = exact
        self.max_tracked = max_tracked
        self._by_uuid: 'OrderedDict[str, TokenRecord]' = OrderedDict()
        self._special_text: Dict[int, str] = {}
        self._special_ids: Optional[frozenset] = None

    def forget(self, uuid: Any) -> None:
        """Request ``uuid`` is final: drop the record kept for it (memory stays flat however many
        requests pass; a stream and the gateway call it)."""
        self._by_uuid.pop(str(uuid), None)

    # ---- helpers -------------------------------------------------------------------------------
    def encode(self, text: str) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=False)['input_ids'])

    def _render(self, chat: Chat, where: str, messages: Optional[List[Dict[str, Any]]] = None,
                continuation: Optional[bool] = None, generation: Optional[bool] = None) -> str:
        return render_text(self.tokenizer, chat, messages, self.chat_template, continuation, where, generation)

    def _token_text(self, token_id: int) -> str:
        text = self._special_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._special_text[token_id] = text
        return text

    def _is_special(self, token_id: int) -> bool:
        if self._special_ids is None:
            self._special_ids = frozenset(int(i) for i in (getattr(self.tokenizer, 'all_special_ids', ()) or ()))
        return token_id in self._special_ids

    def _decode_token_backed(self, chat: Chat) -> None:
        """Assistant messages whose content is token ids (ms-swift 4.6 freezes them so) become
        their text for the template; the record's own ids stay exact where the history extends."""
        for message in chat.messages:
            content = message.get('content')
            if message.get('role') == 'assistant' and isinstance(content, list) and content and \
                    all(isinstance(t, int) for t in content):
                message['content'] = self.tokenizer.decode(content, skip_special_tokens=True)

    def find_record(self, request: Any) -> tuple:
        """``(record, carried)``: the request's own record, else the one kept for its uuid."""
        rec = record_of(request)
        if rec is not None:
            return rec, True
        uuid = getattr(request, 'uuid', None)
        return (self._by_uuid.get(str(uuid)) if uuid else None), False

    # ---- one turn ------------------------------------------------------------------------------
    def plan(self, request: Any) -> PromptPlan:
        """The prompt ids for ``request``'s next turn (the request is not modified)."""
        where = f'request {getattr(request, "uuid", None)!r}'
        chat = prepare_chat(request)
        self._decode_token_backed(chat)
        rec, carried = self.find_record(request)
        if rec is None or not rec.turns:
            return self._fresh(chat, TokenRecord(), 'first', where)
        if not self.exact:
            return self._fresh(chat, rec, 'no_exact_ids', where)
        history, new = rec.history, chat.messages
        head = _extension(history, new)
        if head is None:
            if not carried:  # a new conversation under a uuid seen before
                return self._fresh(chat, TokenRecord(), 'first', where)
            return self._fresh(chat, _restarted(rec, 'history_changed', history, new), 'history_changed', where)
        extra, added, reshaped = head
        if chat.continuation and not reshaped:
            appended = self.encode(extra) if extra else []
            return PromptPlan(rec.next_prefix() + appended, chat, rec, appended, None, True, rec.open_text)
        if extra or chat.continuation:  # the assistant message was edited and then answered: no exact delta exists
            return self._fresh(chat, _restarted(rec, 'history_changed', history, new), 'history_changed', where)
        if reshaped:
            return self._reshaped_turn(chat, rec, where)
        return self._new_turn(chat, rec, where)

    def _fresh(self, chat: Chat, rec: TokenRecord, why: str, where: str) -> PromptPlan:
        text = self._render(chat, where)
        if rec.turns:
            rec.restarted = True
        open_text = text
        if chat.continuation:  # the text before the continued assistant message's content
            marked = chat.messages[:-1] + [dict(chat.messages[-1], content=SENTINEL)]
            probe = self._render(chat, where, marked)
            at = probe.find(SENTINEL)
            open_text = probe[:at] if at >= 0 else ''
        return PromptPlan(self.encode(text), chat, rec, None, why, True, open_text)

    def _new_turn(self, chat: Chat, rec: TokenRecord, where: str) -> PromptPlan:
        history = rec.history
        marked = history[:-1] + [dict(history[-1], content=SENTINEL)]
        added = chat.messages[len(history):]
        text = self._render(chat, where, marked + added, continuation=False)
        at = text.find(SENTINEL)
        if at < 0 or text.count(SENTINEL) != 1:
            # the template does not render assistant content verbatim: only text is left
            return self._fresh(chat, _restarted(rec, 'template_hides_content'), 'template_hides_content', where)
        delta_text = text[at + len(SENTINEL):]
        sampled = rec.turns[-1].sampled
        if sampled and self._is_special(sampled[-1]):
            eos_text = self._token_text(sampled[-1])
            if eos_text and delta_text.startswith(eos_text):
                delta_text = delta_text[len(eos_text):]  # the model sampled the template's closing token
        content = history[-1].get('content') or ''
        expected = text[:at] + content + text[at + len(SENTINEL):]
        real = self._render(chat, where)
        stable = real == expected and text[:at] == rec.open_text
        if not stable and self.policy == 'rerender':
            return self._rerendered(chat, rec, real)
        appended = self.encode(delta_text)
        return PromptPlan(rec.next_prefix() + appended, chat, rec, appended, None, stable, expected)

    def _rerendered(self, chat: Chat, rec: TokenRecord, real: str) -> PromptPlan:
        """``prefix_policy='rerender'`` where the template renders the earlier turns otherwise: the
        prompt is the conversation rendered as it stands, and the record says where ids were lost."""
        rec.restarted = True
        rec.restart = rec.restart or _restart_info(rec, 'template_rewrites_history',
                                                   'the chat template renders the earlier turns differently')
        return PromptPlan(self.encode(real), chat, rec, None, 'template_rewrites_history', False, real)

    def _reshaped_turn(self, chat: Chat, rec: TokenRecord, where: str) -> PromptPlan:
        """A new turn after the assistant message was put in OpenAI's shape once sampled (its calls
        as ``tool_calls``, its reasoning apart: :mod:`mtflow.declarative.call_messages`). The
        template renders that message its own way, not as the sampled text, so the delta is what it
        writes after the message: the conversation rendered as it stands, then with the new
        messages and the generation prompt; the closing glue after the reply is what the template
        writes after the token the model ended it with (its EOS), else after the reply as text."""
        head = chat.messages[:len(rec.history)]
        upto = self._render(chat, where, head, generation=False)
        real = self._render(chat, where)
        if not real.startswith(upto):  # the message renders otherwise once others follow it
            changed = 'the chat template renders the reply otherwise once messages follow it'
            return self._fresh(chat, _restarted(rec, 'template_rewrites_history', changed=changed),
                               'template_rewrites_history', where)
        delta_text = self._closing_glue(chat, rec, head, upto, where) + real[len(upto):]
        expected = rec.open_text + (rec.history[-1].get('content') or '') + delta_text
        stable = real == expected
        if not stable and self.policy == 'rerender':
            return self._rerendered(chat, rec, real)
        appended = self.encode(delta_text)
        return PromptPlan(rec.next_prefix() + appended, chat, rec, appended, None, stable, expected)

    def _closing_glue(self, chat: Chat, rec: TokenRecord, head: List[Dict[str, Any]], upto: str, where: str) -> str:
        """What the template writes after the model's reply (``upto``: the conversation rendered up
        to it): after the last special token the model ended on, when the template writes it there
        (``<|im_end|>`` then ``\\n``; gpt-oss's ``<|call|>``, nothing); else what it writes after a
        reply given as text (the reply stopped by a stop string, without its EOS)."""
        sampled = rec.turns[-1].sampled
        if sampled and self._is_special(sampled[-1]):
            end = self._token_text(sampled[-1])
            at = upto.rfind(end) if end else -1
            if at >= len(os.path.commonprefix([upto, rec.open_text])):
                return upto[at + len(end):]
        plain = head[:-1] + [{'role': 'assistant', 'content': SENTINEL}]
        try:
            text = self._render(chat, where, plain, generation=False)
        except BackendError:
            return ''
        at = text.find(SENTINEL)
        return text[at + len(SENTINEL):] if at >= 0 else ''

    def commit(self, request: Any, plan: PromptPlan, sampled: List[int], completion: Optional[str],
               logprobs: Optional[List[float]] = None) -> TokenRecord:
        """Record the turn generated from ``plan`` and attach the record to ``request``.

        The request gets a new record object (the old one is left as it was), so requests that
        share a record (a shallow copy forked after some turns) never write into each other's."""
        old = plan.record
        turns = list(old.turns)
        if plan.appended is not None and turns:
            turns[-1] = dataclasses.replace(turns[-1], appended=list(plan.appended))
        rec = TokenRecord(turns=turns, restarted=old.restarted, first_turn=old.first_turn, restart=old.restart)
        rendered = plan.rendered
        rec.turns.append(
            TokenTurn(
                prompt_len=len(plan.ids),
                sampled=list(sampled),
                prompt=list(plan.ids) if rendered is not None else None,
                logprobs=None if logprobs is None else list(logprobs),
                continuation=plan.chat.continuation,
                extends=rendered in (None, 'first'),
                template_stable=plan.template_stable,
                rendered=rendered))
        rec.last_prompt = list(plan.ids)
        rec.open_text = plan.open_text
        history = copy.deepcopy(plan.chat.messages)
        text = completion or ''
        if plan.chat.continuation:
            history[-1]['content'] = (history[-1].get('content') or '') + text
        else:
            history.append({'role': 'assistant', 'content': text})
        rec.history = history
        try:
            setattr(request, RECORD_ATTR, rec)
        except (AttributeError, TypeError):  # a frozen/slotted request: the uuid map still has it
            pass
        uuid = getattr(request, 'uuid', None)
        if uuid:
            key = str(uuid)
            self._by_uuid[key] = rec
            self._by_uuid.move_to_end(key)
            while len(self._by_uuid) > self.max_tracked:
                self._by_uuid.popitem(last=False)
        return rec


def _restart_info(old: TokenRecord, why: str, changed: str) -> Dict[str, Any]:
    return {'turn': old.first_turn + len(old.turns), 'why': why, 'changed': changed}


def _restarted(old: TokenRecord, why: str, history: Optional[List[Dict[str, Any]]] = None,
               new: Optional[List[Dict[str, Any]]] = None, changed: Optional[str] = None) -> TokenRecord:
    """The record a turn rendered from text starts: it holds the turns from this one on, and says
    where the exact ids were first lost and what changed (the first such loss is kept)."""
    if changed is None:
        changed = what_changed(history, new, old.first_turn) if history is not None and new is not None else \
            'the chat template does not render the assistant content verbatim'
    return TokenRecord(restarted=True, first_turn=old.first_turn + len(old.turns),
                       restart=old.restart or _restart_info(old, why, changed))


def _clip(value: Any, width: int = 40) -> str:
    text = value if isinstance(value, str) else repr(value)
    return repr(text if len(text) <= width else text[:width] + '...')


def what_changed(history: List[Dict[str, Any]], new: List[Dict[str, Any]], first_turn: int = 1) -> str:
    """One phrase naming the first message of ``history`` (what the model saw) that ``new`` does
    not keep: its number, role (an assistant message: the turn that generated it), and the field
    that changed, with both values where they are text."""
    replies = 0
    for k, was in enumerate(history):
        if was.get('role') == 'assistant':
            replies += 1
        role = was.get('role')
        name = f"message {k + 1} ({role}{f', the reply of turn {first_turn + replies - 1}' if role == 'assistant' else ''})"
        if k >= len(new):
            return f'{name} and the {len(history) - k - 1} after it were removed'
        now = new[k]
        if now == was:
            continue
        if now.get('role') != role:
            return f"{name}: its role became {now.get('role')!r}"
        for key in sorted(set(was) | set(now)):
            if was.get(key) == now.get(key):
                continue
            before, after = was.get(key), now.get(key)
            if key == 'content' and isinstance(before, str) and isinstance(after, str) and after.startswith(before):
                return f'{name}: text was appended to its content after the model saw it: {_clip(after[len(before):])}'
            return f'{name}: field {key!r} changed from {_clip(before)} to {_clip(after)}'
    return 'the messages were replaced'


#: what putting an assistant message in OpenAI's shape adds to it (:mod:`mtflow.declarative.call_messages`)
RESHAPED = ('tool_calls', 'reasoning_content')


def _extension(history: List[Dict[str, Any]], new: List[Dict[str, Any]]) -> Optional[tuple]:
    """``(extra, added, reshaped)`` when ``new`` extends ``history``: the same messages, the last
    (assistant) one possibly with text appended (``extra``), then ``added`` messages; else
    ``None``. ``reshaped``: the last one was put in OpenAI's shape after it was sampled (it gained
    ``tool_calls`` or ``reasoning_content``, its content the reply without them): the sampled ids
    stand for it."""
    if not history or len(new) < len(history):
        return None
    last = len(history) - 1
    if new[:last] != history[:last]:
        return None
    was, now = history[last], new[last]
    if now.get('role') != 'assistant':
        return None
    if any(k in now and k not in was for k in RESHAPED):
        same = {k: v for k, v in now.items() if k != 'content' and k not in RESHAPED} == \
            {k: v for k, v in was.items() if k != 'content' and k not in RESHAPED}
        return ('', new[len(history):], True) if same else None
    if {k: v for k, v in now.items() if k != 'content'} != {k: v for k, v in was.items() if k != 'content'}:
        return None
    before, after = was.get('content') or '', now.get('content')
    if not isinstance(after, str) or not after.startswith(before):
        return None
    return after[len(before):], new[len(history):], False


def commit_outputs(prompter: TokenPrompter, requests: List[Any], plans: List[PromptPlan], outputs: List[Any]) -> None:
    """Record every generated turn (the outputs of one call, in request order)."""
    for request, plan, out in zip(requests, plans, outputs):
        choice = out.response.choices[0]
        logprobs = extract_logprobs(choice)
        prompter.commit(request, plan, list(choice.token_ids or []), choice.message.content,
                        logprobs if logprobs else None)
