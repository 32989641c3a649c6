"""Streamed (SSE) calls of the OpenAI backend: what makes its generations cut-and-resumable.

``OpenAIBackend(resumable=True)`` keeps the contract of :mod:`mtflow.engine.resume` for a
stream's ``on_update='resume'`` (AReaL's interruptible generation over HTTP):

* each single-request async call (``backend.acall``, what ``async_rollout_fn()`` returns) is
  sent with ``"stream": true`` and read event by event, each chunk's text, ``token_ids``
  (``return_token_ids``, vLLM >= 0.10.2; else logprob tokens written ``token_id:<n>``) and
  logprobs kept in a :class:`StreamedReply`;
* **abort**: when the driver cancels the call, leaving the response closes its connection (the
  server sees the disconnect; vLLM's server then aborts the request in its engine, as AReaL's
  HTTP cancel does) and the call raises :class:`~mtflow.engine.resume.GenerationAborted` with
  the ids, logprobs and text received so far. A cancellation that comes after the stream's last
  chunk returns the whole turn instead (nothing is left to resume);
* **resume**: the re-issued call continues after ``current_prefix().ids``: in token mode
  (``/v1/completions`` with a token prompt) the prefix ids are appended to the prompt ids, so
  the model continues from exactly the ids it sampled; in chat mode the prefix text is sent as
  the final assistant message with ``continue_final_message: true, add_generation_prompt:
  false`` (the server re-tokenizes it, so ids are exact only where the text round-trips, as
  every chat-mode turn). The call returns only the new tokens; the stream joins the segments,
  and the token record (token mode) is committed with the joined turn.

A server that answers ``stream: true`` with one JSON body (it does not stream), an error event
in the middle of a stream, or a connection that breaks after the first chunk fail the request
alone, with an error naming it; before the first chunk the usual retries apply.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from mtflow.backends.base import BackendError, sampling_seeds
from mtflow.backends.http_client import TimedOut, Unreachable
from mtflow.backends.images import refuse_images
from mtflow.backends.resumable import bridged, resumed_options
from mtflow.backends.tokens import commit_outputs
from mtflow.core.protocol import (ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage, RolloutOutput,
                                  UsageInfo)
from mtflow.engine.resume import ResumeFrom, current_prefix, merged_output

__all__ = ['StreamedReply', 'streamed_acall', 'stream_body', 'completion_items', 'token_ids_from_logprobs',
           'message_tool_calls', 'server_reasoning']


def token_ids_from_logprobs(logprobs: Optional[Dict[str, Any]]) -> Optional[List[int]]:
    """Ids from logprob tokens written ``token_id:<n>`` (``vllm serve --return-tokens-as-token-ids``)."""
    content = (logprobs or {}).get('content') if isinstance(logprobs, dict) else None
    if not content:
        return None
    ids = []
    for item in content:
        token = item.get('token', '') if isinstance(item, dict) else ''
        if not isinstance(token, str) or not token.startswith('token_id:'):
            return None
        try:
            ids.append(int(token[len('token_id:'):]))
        except ValueError:
            return None
    return ids


def completion_items(lp: Any) -> Optional[List[Dict[str, Any]]]:
    """The completions API's logprobs (``tokens``, ``token_logprobs``, ``top_logprobs``) as chat
    items (``[{'token', 'logprob', 'top_logprobs'}]``); ``None`` when there are none."""
    if not isinstance(lp, dict) or lp.get('token_logprobs') is None:
        return None
    tokens = lp.get('tokens') or [''] * len(lp['token_logprobs'])
    tops = lp.get('top_logprobs') or [None] * len(tokens)
    content = []
    for token, value, top in zip(tokens, lp['token_logprobs'], tops):
        item: Dict[str, Any] = {'token': token, 'logprob': float(value)}
        if top:
            item['top_logprobs'] = [{'token': k, 'logprob': float(v)} for k, v in top.items()]
        content.append(item)
    return content


def stream_body(body: Dict[str, Any], prefix: Optional[ResumeFrom], flavor: str, where: str) -> Dict[str, Any]:
    """``body`` streamed; in chat mode with a prefix, its text continues the final assistant
    message (token mode: the prefix ids are in the prompt already)."""
    body = dict(body, stream=True, stream_options={'include_usage': True})
    if prefix is None or not prefix.text or 'messages' not in body:
        return body
    if flavor == 'openai':
        raise BackendError(f"{where}: resuming a cut generation continues the assistant message, which flavor "
                           "'openai' cannot (continue_final_message)")
    messages = list(body['messages'])
    last = messages[-1]
    if body.get('continue_final_message') or (flavor == 'swift' and last.get('role') == 'assistant'):
        if not isinstance(last.get('content') or '', str):
            raise BackendError(f'{where}: cannot resume a continued assistant message whose content is not text')
        messages[-1] = {**last, 'content': (last.get('content') or '') + prefix.text}
    else:
        messages.append({'role': 'assistant', 'content': prefix.text})
    if flavor in ('vllm', 'sglang'):
        body['continue_final_message'] = True
        body['add_generation_prompt'] = False
    body['messages'] = messages
    return body


def server_reasoning(message: Dict[str, Any]) -> Optional[str]:
    """The reasoning a server split off a reply itself (``vllm serve --reasoning-parser``): the
    message's ``reasoning`` (vLLM >= 0.11) or ``reasoning_content`` (older vLLM, SGLang, DeepSeek's
    API); ``None`` when it sent neither."""
    for key in ('reasoning_content', 'reasoning'):
        value = message.get(key)
        if isinstance(value, str):
            return value
    return None


def message_tool_calls(tool_calls: Any) -> Optional[List[Dict[str, Any]]]:
    """A reply's structured ``tool_calls`` (OpenAI's shape, as a tool-call-parsing server returns
    them), each with an ``id``: ``call_<k>`` where the server gave none, so a run's messages
    are the same on every replay (the protocol's default id is random); ``None`` without any."""
    if not isinstance(tool_calls, list) or not tool_calls:
        return None
    return [dict(c, id=c.get('id') or f'call_{k}') if isinstance(c, dict) else c for k, c in enumerate(tool_calls)]


class StreamedReply:
    """What one streamed call received so far, chunk by chunk. It is fed on the backend's loop
    and read (:meth:`output`) from the caller's when the call is cut, so each chunk is added,
    and read, under a lock: a snapshot is always whole chunks."""

    def __init__(self, where: str, token_mode: bool, prefix: Optional[ResumeFrom],
                 on_text: Optional[Callable[[str], None]] = None) -> None:
        self.where, self.token_mode, self.prefix = where, token_mode, prefix
        #: given the text received so far after each chunk that added some (a gateway's streaming call)
        self.on_text = on_text
        self.ids: List[int] = []
        self.items: List[Dict[str, Any]] = []
        self.texts: List[str] = []
        #: the reasoning the server split off (``delta.reasoning``), when it streams some
        self.reasoning: Optional[List[str]] = None
        #: the structured tool calls streamed as ``delta.tool_calls`` pieces, by their index
        self.tool_calls: Dict[int, Dict[str, Any]] = {}
        self.has_ids = self.has_logprobs = True
        self.finish: Optional[str] = None
        self.usage: Dict[str, Any] = {}
        self.prompt_ids: Optional[List[int]] = None
        self.model, self.id = '', None
        self.events = 0
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self.events > 0

    def feed(self, line: str) -> None:
        """One line of the SSE stream: ``data: {json}`` events are read, ``data: [DONE]``,
        comments and other fields are skipped."""
        line = line.strip()
        if not line.startswith('data:'):
            return
        data = line[len('data:'):].strip()
        if data == '[DONE]':
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise BackendError(f'{self.where}: the server streamed an event that is not JSON: {data[:200]!r}') from None
        if not isinstance(event, dict):
            raise BackendError(f'{self.where}: the server streamed {data[:200]!r}, not a JSON object')
        if event.get('error') is not None:
            err = event['error']
            message = err.get('message', err) if isinstance(err, dict) else err
            raise BackendError(f'{self.where}: the server failed mid-stream after {len(self.ids)} token(s): '
                               f'{str(message)[:300]}')
        self.add(event)

    def add(self, event: Dict[str, Any]) -> None:
        with self._lock:
            self.events += 1
            self.model = str(event.get('model') or self.model)
            self.id = event.get('id') or self.id
            if isinstance(event.get('usage'), dict):
                self.usage = event['usage']
            if event.get('prompt_token_ids') is not None:
                self.prompt_ids = list(event['prompt_token_ids'])
            grew = False
            for raw in event.get('choices') or []:
                if not isinstance(raw, dict) or raw.get('index', 0) != 0:
                    continue
                grew = self._add_choice(raw) or grew
            text = ''.join(self.texts) if grew and self.on_text is not None else None
        if text is not None:
            self.on_text(text)

    def _add_choice(self, raw: Dict[str, Any]) -> bool:
        """Add one chunk's choice; whether its text grew."""
        if raw.get('prompt_token_ids') is not None:
            self.prompt_ids = list(raw['prompt_token_ids'])
        text = raw.get('text') if self.token_mode else (raw.get('delta') or {}).get('content')
        lp = raw.get('logprobs')
        items = completion_items(lp) if self.token_mode else (lp.get('content') if isinstance(lp, dict) else None)
        ids = raw.get('token_ids')
        if ids is None and items:
            ids = token_ids_from_logprobs({'content': items})
        if ids is None and (text or items):
            self.has_ids = False
        if items is None and (text or ids):
            self.has_logprobs = False
        self.ids.extend(int(t) for t in ids or ())
        self.items.extend(items or ())
        self.texts.append(text or '')
        if not self.token_mode:
            delta = raw.get('delta') or {}
            self._add_tool_calls(delta.get('tool_calls'))
            thought = server_reasoning(delta)
            if thought is not None:
                self.reasoning = (self.reasoning or []) + [thought]
        if raw.get('finish_reason') is not None:
            self.finish = raw['finish_reason']
        return bool(text)

    def _add_tool_calls(self, pieces: Any) -> None:
        """``delta.tool_calls``: the first piece of a call has its id and name, the others more
        of its arguments (a JSON string streamed in parts)."""
        for piece in pieces if isinstance(pieces, list) else ():
            if not isinstance(piece, dict):
                continue
            slot = self.tool_calls.setdefault(int(piece.get('index') or 0),
                                              {'type': 'function', 'function': {'name': '', 'arguments': ''}})
            if piece.get('id'):
                slot['id'] = piece['id']
            function = piece.get('function') or {}
            slot['function']['name'] += function.get('name') or ''
            slot['function']['arguments'] += function.get('arguments') or ''

    def output(self, turn_prompt: Optional[List[int]] = None, sent_prompt: Optional[List[int]] = None) -> RolloutOutput:
        """What was received, as one rollout output (only this call's tokens); in token mode
        ``turn_prompt`` is the turn's prompt (reported as ``prompt_token_ids``), ``sent_prompt``
        the ids sent (the turn's prompt and the prefix), which the server's must equal."""
        with self._lock:
            ids, items, text = list(self.ids), list(self.items), ''.join(self.texts)
            calls = message_tool_calls([self.tool_calls[k] for k in sorted(self.tool_calls)])
            reasoning = ''.join(self.reasoning) if self.reasoning is not None else None
            finish, usage, served = self.finish, dict(self.usage), self.prompt_ids
            has_ids, has_logprobs = self.has_ids, self.has_logprobs
        if self.token_mode and not has_ids:
            raise BackendError(f'{self.where}: the server streamed no token ids for a token prompt; token mode needs '
                               "vLLM >= 0.10.2 (return_token_ids) or --return-tokens-as-token-ids; else prompt_mode='chat'")
        if sent_prompt is not None and served is not None and list(served) != list(sent_prompt):
            raise BackendError(f'{self.where}: the server generated from {len(served)} prompt ids that are not the '
                               f'{len(sent_prompt)} ids sent')
        if finish not in ('stop', 'length', None):
            finish = 'stop'  # 'tool_calls', 'eos', ...: the model stopped by itself
        choice = ChatCompletionResponseChoice(
            index=0, message=ChatMessage(role='assistant', content=text, tool_calls=calls, reasoning_content=reasoning),
            finish_reason=finish,
            logprobs={'content': items} if has_logprobs else None,  # [] too: a cut before the first token
            token_ids=ids if has_ids else None)
        prompt = len(turn_prompt) if turn_prompt is not None else int(usage.get('prompt_tokens') or 0)
        response = ChatCompletionResponse(
            model=self.model, choices=[choice],
            usage=UsageInfo(prompt_tokens=prompt, completion_tokens=len(ids), total_tokens=prompt + len(ids)),
            prompt_token_ids=list(turn_prompt) if turn_prompt is not None else served)
        if self.id:
            response.id = str(self.id)
        return RolloutOutput(response=response)

    def fetch(self) -> Any:
        """The backend's ``_send`` fetch for this stream: a broken connection after the first
        chunk fails the request (a retry would stream the tokens again)."""

        async def fetch(client: Any, method: str, url: str, body: Optional[Dict[str, Any]],
                        headers: Optional[Dict[str, str]] = None) -> Any:
            try:
                return await client.stream(method, url, body, self.feed, headers=headers)
            except (TimedOut, Unreachable) as exc:
                if self.started:
                    raise BackendError(f'{self.where}: the stream from {url} broke after {len(self.ids)} token(s): '
                                       f'{exc}') from exc
                raise

        return fetch


async def _on_server(backend: Any, request: Any, options: Any, seed: Optional[int], prompt: Optional[List[int]],
                     reply: StreamedReply) -> None:
    """The streamed HTTP request, on the backend's private loop (it fills ``reply``)."""
    model = await backend._resolve_model()
    await backend._one(request, options, model, seed, prompt, reply=reply)


async def streamed_acall(backend: Any, request: Any, request_config: Any) -> List[RolloutOutput]:
    """One resumable single-request call (``OpenAIBackend.acall`` with ``resumable=True``), on
    the caller's loop: the stream runs on the backend's loop (:func:`~mtflow.backends.resumable.bridged`);
    the token record is planned and committed here, so a cut call never commits a turn."""
    if backend._runner is None:
        raise BackendError('openai backend: used after close()')
    prefix = current_prefix()
    options = resumed_options(request_config, backend.default_max_tokens, prefix)
    where = f'request {getattr(request, "uuid", None)!r}'
    reply = StreamedReply(where, backend.prompter is not None, prefix)
    plan = sent = turn_prompt = None
    if backend.prompter is not None:
        refuse_images(request, 'a token prompt (/v1/completions)', 'use prompt_mode chat')
        plan = backend.prompter.plan(request)
        turn_prompt = plan.ids
        sent = list(plan.ids) + (prefix.ids if prefix is not None else [])
    t0 = time.perf_counter()
    on_server = _on_server(backend, request, options, sampling_seeds([request], options, backend.seed)[0], sent, reply)
    await bridged(on_server, backend._runner.loop, lambda: (reply.finish is not None, reply.output(turn_prompt)))
    out = reply.output(turn_prompt, sent)
    if plan is not None:
        whole = merged_output(prefix, [out])[0] if prefix is not None else out
        commit_outputs(backend.prompter, [request], [plan], [whole])
    backend._record([out], time.perf_counter() - t0)
    return [out]
