"""What replay needs of each model call: the ``turns`` of a trajectory line.

A trajectory line (``docs/trace-format.md``) holds the final conversation and the trained token
segments; it does not say which text, ids, logprobs and finish reason each *model call* returned,
nor what prompt that call answered. ``mtflow replay`` needs exactly that: it serves the recorded
output of request ``uuid`` at turn ``t`` as the model, and only when the new run's prompt is the
prompt the output answered (else the request finishes with ``replay_diverged``).

:class:`TurnLog` wraps the run's ``rollout_fn`` (lockstep or async), notes each call's output per
request, and when the request finishes :meth:`TurnLog.finish` turns the notes into the line's
``turns`` list. Nothing is stored twice: a turn's text is a reference to the assistant message
holding it (``msg``) when that message is exactly the text, its ids a reference into
``response_token_ids`` (``at: [segment, start, length]``) when they lie there, its logprobs
implied by that reference when ``rollout_logprobs`` holds them at the same place; only what is
not already in the line is written inline. :func:`expand_turns` gives the full entries back.

Memory stays constant: notes exist only for requests in flight and are dropped at finish.
"""
from __future__ import annotations

import hashlib
import inspect
import json
from typing import Any, Callable, Dict, List, Optional

from mtflow.core.calls import is_async_callable

__all__ = ['REPLAY_FORMAT', 'TURNS_KEY', 'TurnLog', 'prompt_digest', 'ids_digest', 'output_turn', 'compact_turns',
           'expand_turns']

#: the version of the ``turns`` entries (also written to ``run.json`` as ``replay_format``)
REPLAY_FORMAT = 1
#: the key of a trajectory line that holds them
TURNS_KEY = 'turns'


def _message_dict(message: Any) -> Dict[str, Any]:
    if isinstance(message, dict):
        return message
    dump = getattr(message, 'model_dump', None)
    return dump() if callable(dump) else dict(vars(message))


#: ``json.dumps(..., ensure_ascii=False, sort_keys=True, default=str)``, one encoder for every digest
_DIGEST_ENCODER = json.JSONEncoder(ensure_ascii=False, sort_keys=True, default=str)


def prompt_digest(messages: Any) -> str:
    """A short, stable digest of the messages a model call was given (role, content, tool calls):
    equal prompts, equal digests. 16 hex digits of SHA-256 (a collision by chance is negligible)."""
    shown = []
    for m in messages or ():
        d = _message_dict(m)
        shown.append([d.get('role'), d.get('content'), d.get('tool_calls')])
    raw = _DIGEST_ENCODER.encode(shown)
    return hashlib.sha256(raw.encode('utf-8')).hexdigest()[:16]


def ids_digest(ids: List[int]) -> str:
    """A short, stable digest of a list of token ids (16 hex digits of SHA-256)."""
    return hashlib.sha256(','.join(map(str, ids)).encode('ascii')).hexdigest()[:16]


def output_turn(output: Any) -> Optional[Dict[str, Any]]:
    """``{text, token_ids, logprobs, finish_reason}`` of one model output (``None`` when it has
    no choice: the executor fails such a request anyway); with exact-id prompts (the backend
    reports ``response.prompt_token_ids``) also ``prompt_len`` and ``prompt_ids``
    (:func:`ids_digest`), so that ``mtflow check-tokens RUN_DIR`` can check every turn against the
    segment it belongs to."""
    try:
        choice = output.response.choices[0]
    except (AttributeError, IndexError, TypeError):
        return None
    logprobs = getattr(choice, 'logprobs', None)
    values = None
    if isinstance(logprobs, dict) and logprobs.get('content') is not None:
        values = [float(item['logprob']) for item in logprobs['content']]
    ids = getattr(choice, 'token_ids', None)
    message = getattr(choice, 'message', None)
    turn = {'text': getattr(message, 'content', None) or '', 'token_ids': list(ids) if ids is not None else None,
            'logprobs': values, 'finish_reason': getattr(choice, 'finish_reason', None)}
    prompt = getattr(output.response, 'prompt_token_ids', None)
    if prompt:
        turn['prompt_len'], turn['prompt_ids'] = len(prompt), ids_digest(list(prompt))
    return turn


class TurnLog:
    """Notes every model call's output per request uuid (see the module docstring).

    ``wrap(rollout_fn)`` returns a ``rollout_fn`` of the same kind (sync or async) that notes the
    prompt digest and the output of each request it serves."""

    def __init__(self) -> None:
        self._notes: Dict[str, List[Dict[str, Any]]] = {}
        #: called with each finished request's uuid (the replay backend drops its record)
        self.on_finish: Optional[Callable[[str], None]] = None
        #: the prompt digest the backend already computed for a request of the call just made, or
        #: ``None`` (the replay backend compares digests: each is computed once, not twice)
        self.known_digest: Optional[Callable[[Any], Optional[str]]] = None
        #: called with each request a model call served (async runs count their turns by it)
        self.on_turn: Optional[Callable[[Any], None]] = None
        #: called with ``(parent, children, turns)`` at a fork: the children hold the parent's turns
        self.on_fork: Optional[Callable[[str, List[str], int], None]] = None

    def note(self, requests: List[Any], outputs: Any) -> None:
        try:
            outs = list(outputs)
        except TypeError:
            return
        if len(outs) != len(requests):
            return  # the executor fails these requests; nothing to replay
        known = self.known_digest
        for request, output in zip(requests, outs):
            turn = output_turn(output)
            if turn is None:
                continue
            digest = known(request) if known is not None else None
            turn['prompt'] = digest if digest is not None else prompt_digest(getattr(request, 'messages', None))
            self._notes.setdefault(str(getattr(request, 'uuid', '')), []).append(turn)
            if self.on_turn is not None:
                self.on_turn(request)

    def fork(self, parent: str, children: List[str]) -> None:
        """Request ``parent`` was forked (``docs/branching.md``): each child's line will hold the
        parent's turns before its own, so that every leaf's ``turns`` replays it from turn 1."""
        notes = self._notes.get(str(parent), [])
        for child in children:
            self._notes[str(child)] = [dict(turn) for turn in notes]
        if self.on_fork is not None:
            self.on_fork(str(parent), [str(c) for c in children], len(notes))

    def wrap(self, rollout_fn: Any) -> Any:
        if is_async_callable(rollout_fn):

            async def noted_async(requests: List[Any], request_config: Any = None) -> Any:
                outputs = await rollout_fn(requests, request_config)
                self.note(requests, outputs)
                return outputs

            noted_async.__wrapped__ = rollout_fn  # type: ignore[attr-defined]
            noted_async.fork = self.fork  # type: ignore[attr-defined]
            return noted_async

        def noted(requests: List[Any], request_config: Any = None) -> Any:
            outputs = rollout_fn(requests, request_config)
            if inspect.isawaitable(outputs):  # a plain function that returned a coroutine

                async def later() -> Any:
                    value = await outputs
                    self.note(requests, value)
                    return value

                return later()
            self.note(requests, outputs)
            return outputs

        noted.__wrapped__ = rollout_fn  # type: ignore[attr-defined]  # the backend's attributes (context budgets)
        noted.fork = self.fork  # type: ignore[attr-defined]
        return noted

    def finish(self, uuid: str, record: Dict[str, Any]) -> List[Dict[str, Any]]:
        """The ``turns`` of a finished request's trajectory dict (its notes are dropped)."""
        if self.on_finish is not None:
            self.on_finish(str(uuid))
        return compact_turns(self._notes.pop(str(uuid), []), record)

    def drop(self, uuid: str) -> None:
        """Request ``uuid`` will not be written (a stream dropped it): forget its notes."""
        self._notes.pop(str(uuid), None)

    def __len__(self) -> int:
        return len(self._notes)


# ---- references into the line ---------------------------------------------------------------------
def _find(haystack: List[Any], needle: List[Any], start: int) -> int:
    n = len(needle)
    for i in range(start, len(haystack) - n + 1):
        if haystack[i:i + n] == needle:
            return i
    return -1


def _logprob_offset(mask: List[int], start: int) -> int:
    return sum(1 for v in mask[:start] if v)


def compact_turns(turns: List[Dict[str, Any]], record: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The entries as written: each full turn with what the line already holds replaced by a
    reference (see the module docstring); :func:`expand_turns` is the inverse."""
    messages = record.get('messages') or []
    segments = record.get('response_token_ids') or []
    masks = record.get('response_loss_mask') or []
    lps = record.get('rollout_logprobs') or []
    out: List[Dict[str, Any]] = []
    msg_at, seg_at, pos_at = 0, 0, 0
    for k, turn in enumerate(turns, 1):
        entry: Dict[str, Any] = {'turn': k, 'prompt': turn['prompt'], 'finish_reason': turn['finish_reason']}
        if 'prompt_len' in turn:
            entry['prompt_len'], entry['prompt_ids'] = turn['prompt_len'], turn['prompt_ids']
        text = turn['text']
        for i in range(msg_at, len(messages)):
            m = messages[i]
            if isinstance(m, dict) and m.get('role') == 'assistant' and m.get('content') == text:
                entry['msg'], msg_at = i, i + 1
                break
        else:
            entry['text'] = text
        ids = turn['token_ids']
        where = None
        if ids:
            for s in range(seg_at, len(segments)):
                start = _find(segments[s], ids, pos_at if s == seg_at else 0)
                if start >= 0:
                    where = (s, start)
                    break
        if where is None:
            entry['token_ids'] = ids
            if turn['logprobs'] is not None:
                entry['logprobs'] = turn['logprobs']
            out.append(entry)
            continue
        s, start = where
        seg_at, pos_at = s, start + len(ids)
        entry['at'] = [s, start, len(ids)]
        values = turn['logprobs']
        mask = masks[s] if s < len(masks) else [1] * len(segments[s])
        lp_start = _logprob_offset(mask, start)
        implied = (values is not None and all(mask[start:start + len(ids)]) and s < len(lps)
                   and lps[s][lp_start:lp_start + len(ids)] == values)
        if not implied:
            entry['logprobs'] = values
        out.append(entry)
    return out


def expand_turns(record: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The full entries of a trajectory dict's ``turns``: ``turn``, ``prompt``, ``text``,
    ``token_ids``, ``logprobs``, ``finish_reason`` (``[]`` for a line written without them)."""
    messages = record.get('messages') or []
    segments = record.get('response_token_ids') or []
    masks = record.get('response_loss_mask') or []
    lps = record.get('rollout_logprobs') or []
    full = []
    for entry in record.get(TURNS_KEY) or []:
        text = entry['text'] if 'text' in entry else messages[entry['msg']].get('content')
        if 'at' in entry:
            s, start, n = entry['at']
            ids = segments[s][start:start + n]
            if 'logprobs' in entry:
                values = entry['logprobs']
            else:
                mask = masks[s] if s < len(masks) else [1] * len(segments[s])
                lp_start = _logprob_offset(mask, start)
                values = lps[s][lp_start:lp_start + n]
        else:
            ids, values = entry.get('token_ids'), entry.get('logprobs')
        turn = {'turn': entry['turn'], 'prompt': entry['prompt'], 'text': text, 'token_ids': ids,
                'logprobs': values, 'finish_reason': entry.get('finish_reason')}
        if 'prompt_len' in entry:
            turn['prompt_len'], turn['prompt_ids'] = entry['prompt_len'], entry['prompt_ids']
        full.append(turn)
    return full
