"""The OpenAI Responses API (``POST /v1/responses``), in and out (see :mod:`.wire`).

In: ``instructions`` (the first system message), ``input`` (a string, or items: messages with
text and image parts, an assistant's ``message``/``function_call`` items as one assistant turn,
``function_call_output`` items as tool messages, ``reasoning`` items skipped: the model's own text
holds its reasoning and is found again with the rest), the function tools (``{"type":
"function", "name", "parameters"}``), ``tool_choice`` (as :func:`.wire.tool_choice_of` says), ``text.format``
(text only), ``max_output_tokens``, ``top_logprobs`` and ``include:
["message.output_text.logprobs"]``, and ``previous_response_id``: the conversation the gateway
kept for that response (:class:`ResponseStore`, while its session is open and the call did not
say ``store: false``), which the new items extend. Tools of other types (hosted ones such as
``web_search``, Codex's ``namespace`` groups) cannot be offered to a model through a tool-call
parser: they are left out, said once in the gateway's log and in the ``x-mtflow-warning``
header.

Out: a ``reasoning`` item (the model's thinking, as ``reasoning_text``), a ``message`` item
(``output_text``, with its logprobs when asked), a ``function_call`` item per call; ``status``
``incomplete`` (``max_output_tokens``) when the reply was cut; streamed as the API's typed events
(:class:`ResponsesStream`).
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple, Union

from pydantic import Field, field_validator

from mtflow.gateway.streaming import sse
from mtflow.gateway.wire import (AssistantTurn, Call, Loose, Reply, Returned, WireError, arguments_text, content_of,
                                 logprob_items, refuse_format, sampling, tool_choice_of, validated)

__all__ = ['parse_responses', 'response_object', 'ResponsesStream', 'ResponseStore', 'ResponseIds',
           'LOGPROBS_INCLUDE']

#: the ``include`` value that asks for the output text's logprobs
LOGPROBS_INCLUDE = 'message.output_text.logprobs'


class _Request(Loose):
    model: str = ''
    input: Union[str, List[Dict[str, Any]]]  # checked by _input_kind, which names the wrong item
    instructions: Optional[str] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    stream: bool = False
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    include: Optional[List[str]] = None
    text: Optional[Dict[str, Any]] = None
    previous_response_id: Optional[str] = None
    store: Optional[bool] = None
    background: Optional[bool] = None
    conversation: Any = None

    @field_validator('input', mode='before')
    @classmethod
    def _input_kind(cls, value: Any) -> Any:
        if not isinstance(value, (str, list)):  # else pydantic names a union member ('input.str')
            raise ValueError(f'a string or a list of input items, not {type(value).__name__}')
        for k, item in enumerate(value if isinstance(value, list) else ()):
            if not isinstance(item, dict):
                raise ValueError(f'item {k} is {type(item).__name__}: each input item is an object '
                                 '({"role": ..., "content": ...} or {"type": ...})')
        return value


def _tools(tools: List[Any], dropped: List[str]) -> Optional[List[Dict[str, Any]]]:
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise WireError(400, f'tools.{k}: must be an object', param=f'tools.{k}')
        if tool.get('type') != 'function':
            dropped.append(str(tool.get('name') or tool.get('type')))
            continue
        if not isinstance(tool.get('name'), str):
            raise WireError(400, f'tools.{k}.name: a function tool needs its name', param=f'tools.{k}.name')
        function = {'name': tool['name'], 'description': tool.get('description') or '',
                    'parameters': tool.get('parameters') or {}}
        out.append({'type': 'function', 'function': function})
    return out or None


class _Turns:
    """The input items as canonical messages: an assistant's ``message`` and ``function_call``
    items (after its ``reasoning`` item) are one assistant turn."""

    def __init__(self, turn: AssistantTurn) -> None:
        self.turn = turn
        self.messages: List[Dict[str, Any]] = []
        self.images: List[str] = []
        self.text: List[str] = []
        self.calls: List[Tuple[str, str, Any]] = []
        self.open = False

    def flush(self) -> None:
        if self.open:
            self.messages.append(self.turn.message(''.join(self.text), self.calls))
        self.text, self.calls, self.open = [], [], False

    def add(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise WireError(400, f'{where}: an input item must be an object', param=where)
        kind = item.get('type') or ('message' if 'role' in item else None)
        if kind == 'reasoning':
            if self.text or self.calls:  # a new assistant turn begins
                self.flush()
            self.open = True
        elif kind == 'message' and item.get('role') == 'assistant':
            text, _ = content_of(_refusals(item.get('content')), f'{where}.content')
            if self.calls:
                self.flush()
            self.text.append(text)
            self.open = True
        elif kind == 'function_call':
            for key in ('call_id', 'name'):
                if not isinstance(item.get(key), str):
                    raise WireError(400, f'{where}.{key}: required', param=f'{where}.{key}')
            self.calls.append((item['call_id'], item['name'], item.get('arguments') or ''))
            self.open = True
        elif kind == 'message':
            self.flush()
            role = item.get('role')
            if role not in ('user', 'system', 'developer'):
                raise WireError(400, f'{where}.role: {role!r} is not a role (user, assistant, system, developer)',
                                param=f'{where}.role')
            text, seen = content_of(item.get('content'), f'{where}.content')
            self.images += seen
            self.messages.append({'role': 'system' if role == 'developer' else role, 'content': text})
        elif kind == 'function_call_output':
            if not isinstance(item.get('call_id'), str):  # the tool message would answer no call
                raise WireError(400, f'{where}.call_id: required', param=f'{where}.call_id')
            self.flush()
            output, seen = content_of(item.get('output'), f'{where}.output')
            self.images += seen
            self.messages.append({'role': 'tool', 'content': output, 'tool_call_id': str(item.get('call_id', ''))})
        else:
            raise WireError(400, f'{where}.type: input items of type {kind!r} are not served by the gateway (messages, '
                            'function_call, function_call_output, reasoning)', param=f'{where}.type')


def _refusals(content: Any) -> Any:
    """An assistant message's content with its ``refusal`` parts as text."""
    if not isinstance(content, list):
        return content
    return [{'type': 'output_text', 'text': p.get('refusal', '')} if isinstance(p, dict) and p.get('type') == 'refusal'
            else p for p in content]


def parse_responses(body: Any, returned: Returned, render_calls: Any,
                    previous: Optional[Tuple[List[Dict[str, Any]], List[Any]]] = None) -> Call:
    """A ``/v1/responses`` body as a :class:`Call`; ``previous``: the stored conversation (and
    its images) of its ``previous_response_id``, which the input extends."""
    req = validated(_Request, body)
    if req.background:
        raise WireError(400, 'background: responses run in the foreground at the gateway', param='background')
    if req.conversation is not None:
        raise WireError(400, 'conversation: the Conversations API is not served by the gateway; send the items, or '
                        'previous_response_id', param='conversation')
    if req.previous_response_id and previous is None:
        raise WireError(404, f'previous_response_id: no response {req.previous_response_id!r} is kept (its session '
                        'ended, or it was made with store: false); send the whole input', code='previous_response_not_found',
                        param='previous_response_id')
    fmt = (req.text or {}).get('format')
    refuse_format(fmt.get('type') if isinstance(fmt, dict) else None, 'text.format.type')
    turns = _Turns(AssistantTurn(returned, render_calls))
    items = [{'type': 'message', 'role': 'user', 'content': req.input}] if isinstance(req.input, str) else req.input
    for k, item in enumerate(items):
        turns.add(item, f'input.{k}')
    turns.flush()
    head = [{'role': 'system', 'content': req.instructions}] if req.instructions else []
    before, images = previous if previous is not None else ([], [])
    dropped: List[str] = []
    tools = _tools(req.tools, dropped) if req.tools else None
    wants = LOGPROBS_INCLUDE in (req.include or ()) or bool(req.top_logprobs)
    echo = {'instructions': req.instructions, 'tools': req.tools or [], 'tool_choice': req.tool_choice or 'auto',
            'store': req.store is not False, 'temperature': req.temperature, 'top_p': req.top_p,
            'max_output_tokens': req.max_output_tokens, 'previous_response_id': req.previous_response_id,
            'parallel_tool_calls': body.get('parallel_tool_calls', True), 'text': req.text or {'format': {'type': 'text'}},
            'reasoning': body.get('reasoning'), 'metadata': body.get('metadata') or {}, 'dropped_tools': dropped,
            'prefix': len(head)}
    return Call(head + list(before) + turns.messages, tools,
                sampling(req.max_output_tokens, req.temperature, req.top_p, None, None), 'responses', req.stream,
                req.model, images=list(images) + turns.images, tool_choice=tool_choice_of(req.tool_choice),
                logprobs=(req.top_logprobs or 0) if wants else None, echo=echo,
                previous_response_id=req.previous_response_id)


class ResponseIds:
    """The ids of one response and of its output items (the same in its events and its body)."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        tail = rid.split('_', 1)[-1]
        self.reasoning, self.message = f'rs_{tail}', f'msg_{tail}'

    def call(self, k: int) -> str:
        return f'fc_{self.rid.split("_", 1)[-1]}_{k}'


def _usage(reply: Reply) -> Dict[str, Any]:
    return {'input_tokens': reply.prompt_tokens, 'input_tokens_details': {'cached_tokens': 0},
            'output_tokens': reply.completion_tokens, 'output_tokens_details': {'reasoning_tokens': 0},
            'total_tokens': reply.prompt_tokens + reply.completion_tokens}


def _reasoning_item(ids: ResponseIds, text: str, status: str = 'completed') -> Dict[str, Any]:
    return {'type': 'reasoning', 'id': ids.reasoning, 'summary': [], 'status': status,
            'content': [{'type': 'reasoning_text', 'text': text}] if text else [], 'encrypted_content': None}


def _text_part(text: str, logprobs: Optional[List[Dict[str, Any]]]) -> Dict[str, Any]:
    part: Dict[str, Any] = {'type': 'output_text', 'text': text, 'annotations': []}
    if logprobs is not None:
        part['logprobs'] = logprobs
    return part


def _message_item(ids: ResponseIds, text: str, logprobs: Any, status: str = 'completed') -> Dict[str, Any]:
    return {'type': 'message', 'id': ids.message, 'status': status, 'role': 'assistant',
            'content': [_text_part(text, logprobs)] if status == 'completed' else []}


def _call_item(ids: ResponseIds, k: int, call: Tuple[str, str, Any], status: str = 'completed') -> Dict[str, Any]:
    i, n, a = call
    return {'type': 'function_call', 'id': ids.call(k), 'call_id': i, 'name': n,
            'arguments': arguments_text(a) if status == 'completed' else '', 'status': status}


def _logprobs(reply: Reply, call: Call) -> Optional[List[Dict[str, Any]]]:
    return logprob_items(reply, call.logprobs or 0) if call.logprobs is not None else None


def response_object(reply: Optional[Reply], call: Call, model: str, ids: ResponseIds,
                    created: Optional[int] = None) -> Dict[str, Any]:
    """The response (``reply`` ``None``: the one in progress, with no output yet)."""
    echo = call.echo
    output: List[Dict[str, Any]] = []
    status = 'in_progress'
    if reply is not None:
        if reply.reasoning:
            output.append(_reasoning_item(ids, reply.reasoning))
        if reply.content or not reply.calls:
            output.append(_message_item(ids, reply.content, _logprobs(reply, call)))
        output += [_call_item(ids, k, c) for k, c in enumerate(reply.calls)]
        status = 'incomplete' if reply.finish_reason == 'length' and not reply.calls else 'completed'
    return {'id': ids.rid, 'object': 'response', 'created_at': created or int(time.time()), 'status': status,
            'background': False, 'error': None,
            'incomplete_details': {'reason': 'max_output_tokens'} if status == 'incomplete' else None,
            'instructions': echo.get('instructions'), 'max_output_tokens': echo.get('max_output_tokens'),
            'model': model, 'output': output, 'parallel_tool_calls': echo.get('parallel_tool_calls', True),
            'previous_response_id': echo.get('previous_response_id'), 'reasoning': echo.get('reasoning') or {},
            'store': echo.get('store', True), 'temperature': echo.get('temperature'),
            'text': echo.get('text') or {'format': {'type': 'text'}}, 'tool_choice': echo.get('tool_choice', 'auto'),
            'tools': echo.get('tools') or [], 'top_p': echo.get('top_p'), 'truncation': 'disabled',
            'metadata': echo.get('metadata') or {}, 'usage': _usage(reply) if reply is not None else None}


class ResponsesStream:
    """The Responses API's events: ``response.created``, ``response.in_progress``, an output item
    per run of reasoning (``response.reasoning_text.delta``) or content (``response.output_text.delta``),
    each ``function_call`` item with its arguments, then ``response.completed`` (or
    ``response.incomplete``) with the whole response."""

    def __init__(self, call: Call, model: str, ids: ResponseIds) -> None:
        self.call, self.model, self.ids = call, model, ids
        self.created = int(time.time())
        self.seq = 0
        self.index = -1
        self.open: Optional[str] = None
        self.texts: Dict[str, str] = {}

    def _event(self, kind: str, **data: Any) -> bytes:
        self.seq += 1
        return sse({'type': kind, 'sequence_number': self.seq, **data}, kind)

    def start(self) -> List[bytes]:
        response = response_object(None, self.call, self.model, self.ids, self.created)
        return [self._event('response.created', response=response),
                self._event('response.in_progress', response=response)]

    def _close(self, reply: Optional[Reply] = None) -> List[bytes]:
        kind, self.open = self.open, None
        if kind is None:
            return []
        text = self.texts.get(kind, '')
        at = {'item_id': self.ids.reasoning if kind == 'reasoning' else self.ids.message,
              'output_index': self.index, 'content_index': 0}
        if kind == 'reasoning':
            return [self._event('response.reasoning_text.done', text=text, **at),
                    self._event('response.output_item.done', output_index=self.index,
                                item=_reasoning_item(self.ids, text))]
        logprobs = _logprobs(reply, self.call) if reply is not None else None
        part = _text_part(text, logprobs)
        return [self._event('response.output_text.done', text=text, logprobs=logprobs or [], **at),
                self._event('response.content_part.done', part=part, **at),
                self._event('response.output_item.done', output_index=self.index,
                            item=_message_item(self.ids, text, logprobs))]

    def _delta(self, kind: str, delta: str) -> List[bytes]:
        out: List[bytes] = []
        if self.open != kind:
            if kind in self.texts:  # a second run of the same kind: the item is done already
                return []
            out = self._close()
            self.index += 1
            self.open = kind
            self.texts[kind] = ''
            if kind == 'reasoning':
                out.append(self._event('response.output_item.added', output_index=self.index,
                                       item=_reasoning_item(self.ids, '', 'in_progress')))
            else:
                out.append(self._event('response.output_item.added', output_index=self.index,
                                       item=_message_item(self.ids, '', None, 'in_progress')))
                out.append(self._event('response.content_part.added', item_id=self.ids.message,
                                       output_index=self.index, content_index=0, part=_text_part('', None)))
        self.texts[kind] += delta
        item = self.ids.reasoning if kind == 'reasoning' else self.ids.message
        name = 'response.reasoning_text.delta' if kind == 'reasoning' else 'response.output_text.delta'
        extra = {} if kind == 'reasoning' else {'logprobs': []}
        out.append(self._event(name, item_id=item, output_index=self.index, content_index=0, delta=delta, **extra))
        return out

    def reasoning(self, delta: str) -> List[bytes]:
        return self._delta('reasoning', delta)

    def content(self, delta: str) -> List[bytes]:
        return self._delta('message', delta)

    def end(self, reply: Reply) -> List[bytes]:
        out: List[bytes] = []
        if reply.reasoning and 'reasoning' not in self.texts:
            out += self._delta('reasoning', reply.reasoning)
        if (reply.content or not reply.calls) and 'message' not in self.texts:
            out += self._delta('message', reply.content)
        out += self._close(reply)
        for k, call in enumerate(reply.calls):
            self.index += 1
            item = _call_item(self.ids, k, call)
            out.append(self._event('response.output_item.added', output_index=self.index,
                                   item=_call_item(self.ids, k, call, 'in_progress')))
            out.append(self._event('response.function_call_arguments.delta', item_id=item['id'],
                                   output_index=self.index, delta=item['arguments']))
            out.append(self._event('response.function_call_arguments.done', item_id=item['id'],
                                   output_index=self.index, arguments=item['arguments']))
            out.append(self._event('response.output_item.done', output_index=self.index, item=item))
        response = response_object(reply, self.call, self.model, self.ids, self.created)
        kind = 'response.incomplete' if response['status'] == 'incomplete' else 'response.completed'
        return out + [self._event(kind, response=response)]

    def error(self, err: WireError) -> List[bytes]:
        response = dict(response_object(None, self.call, self.model, self.ids, self.created), status='failed',
                        error={'code': err.code, 'message': err.message})
        return self._close() + [self._event('response.failed', response=response)]


class ResponseStore:
    """The conversations kept for ``previous_response_id``: by response id, the session, the
    messages the model saw through its answer (without the call's instructions) and their
    images; dropped when the session is written, and the oldest beyond ``limit``."""

    def __init__(self, limit: int = 10000) -> None:
        self.limit = limit
        self._by_id: 'OrderedDict[str, Tuple[str, List[Dict[str, Any]], List[Any]]]' = OrderedDict()
        self._of_session: Dict[str, List[str]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def new_id() -> str:
        return f'resp_{secrets.token_hex(12)}'

    def put(self, rid: str, session: str, messages: List[Dict[str, Any]], images: List[Any]) -> None:
        with self._lock:
            self._by_id[rid] = (session, messages, images)
            self._of_session.setdefault(session, []).append(rid)
            while len(self._by_id) > self.limit:
                old, (name, _, _) = self._by_id.popitem(last=False)
                ids = self._of_session.get(name)
                if ids and old in ids:
                    ids.remove(old)

    def get(self, rid: str) -> Optional[Tuple[str, List[Dict[str, Any]], List[Any]]]:
        with self._lock:
            return self._by_id.get(rid)

    def previous_of(self, body: Any) -> Optional[Tuple[str, List[Dict[str, Any]], List[Any]]]:
        """``(session, messages, images)`` kept for a request body's ``previous_response_id``."""
        rid = body.get('previous_response_id') if isinstance(body, dict) else None
        return self.get(rid) if isinstance(rid, str) else None

    def keep(self, rid: str, session: str, call: Call, reply: Reply) -> None:
        """A Responses answer's conversation, for a later ``previous_response_id`` (unless the call
        said ``store: false``): the call's messages as the client wrote them (without its
        instructions and the tools' text: ``echo['conversation']``), and the model's own answer."""
        if call.api == 'responses' and call.echo.get('store', True):
            messages = list(call.echo['conversation']) + [{'role': 'assistant', 'content': reply.raw}]
            self.put(rid, session, messages, list(call.images))

    def drop_session(self, session: str) -> None:
        with self._lock:
            for rid in self._of_session.pop(session, ()):
                self._by_id.pop(rid, None)
