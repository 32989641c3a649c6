"""The wire formats the gateway speaks: OpenAI chat completions and Anthropic messages, in and out.

In: a request body is validated with pydantic models (extra keys allowed, as the servers allow
them) and turned into mtflow's own conversation, the *canonical* messages every call of a session
is compared in: ``{'role', 'content'}`` dicts (a tool result keeps its ``tool_call_id``), text
parts joined, an Anthropic ``system`` and ``tool_result`` blocks as system and tool messages. An
assistant message the gateway itself returned becomes the exact text the model sampled (the
session's :class:`Returned` map, keyed by what the client got: its text and its tool calls' ids,
names and arguments), so a client that sends the history back unchanged extends the model's own
ids; any other assistant message is its text plus its tool calls written in the parser's format
(:meth:`mtflow.declarative.parsers.ToolCallParser.render_calls`).

Out: the model's text is split by the tool-call parser into content and ``tool_calls`` (OpenAI)
or ``tool_use`` blocks (Anthropic), as a whole response or as server-sent events.

Every problem is a :class:`WireError` with the HTTP status and the field it names.
"""
from __future__ import annotations

import json
import time
import uuid as _uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mtflow.declarative.parsers import parse_calls
from mtflow.declarative.parsers.base import take_out_calls

__all__ = ['WireError', 'Call', 'Reply', 'Returned', 'parse_openai', 'parse_anthropic', 'openai_response',
           'openai_chunks', 'anthropic_response', 'anthropic_events', 'openai_error', 'anthropic_error',
           'split_calls', 'validation_message']


class WireError(Exception):
    """A request the gateway refuses: ``status`` (400, 401, 404, 409, 413, ...), the message, and
    the field or session it names (``code``: a short machine-readable reason)."""

    def __init__(self, status: int, message: str, code: str = 'invalid_request_error',
                 param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


# ---- request models -------------------------------------------------------------------------------
class _Loose(BaseModel):
    model_config = ConfigDict(extra='allow')


class _Function(_Loose):
    name: str
    arguments: Union[str, Dict[str, Any]] = ''


class _ToolCall(_Loose):
    id: str = ''
    type: str = 'function'
    function: _Function


class _OpenAIMessage(_Loose):
    role: Literal['system', 'developer', 'user', 'assistant', 'tool']
    content: Union[str, List[Dict[str, Any]], None] = None
    name: Optional[str] = None
    tool_calls: Optional[List[_ToolCall]] = None
    tool_call_id: Optional[str] = None


class _OpenAIRequest(_Loose):
    model: str = ''
    messages: List[_OpenAIMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: Optional[Dict[str, Any]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    n: Optional[int] = 1
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, List[str], None] = None
    logprobs: Optional[bool] = None


class _AnthropicMessage(_Loose):
    role: Literal['user', 'assistant']
    content: Union[str, List[Dict[str, Any]]]


class _AnthropicRequest(_Loose):
    model: str = ''
    messages: List[_AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: Union[str, List[Dict[str, Any]], None] = None
    tools: Optional[List[Dict[str, Any]]] = None
    stream: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop_sequences: Optional[List[str]] = None


def validation_message(exc: ValidationError) -> Tuple[str, str]:
    """``(message, field)`` of pydantic's first error: ``messages.2.role: Input should be ...``."""
    err = exc.errors()[0]
    where = '.'.join(str(p) for p in err.get('loc', ())) or 'body'
    return f'{where}: {err.get("msg", "invalid")}', where


def _validated(model: type, body: Any) -> Any:
    if not isinstance(body, dict):
        raise WireError(400, f'the body must be a JSON object, not {type(body).__name__}', param='body')
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, where = validation_message(exc)
        raise WireError(400, message, param=where) from None


# ---- what one call hands the session -----------------------------------------------------------
@dataclass
class Call:
    """One model call of a session, parsed: the canonical messages and tools (OpenAI function
    specs), the sampling the client asked for, and how to answer (``api``, ``stream``)."""
    messages: List[Dict[str, Any]]
    tools: Optional[List[Dict[str, Any]]]
    sampling: Dict[str, Any]
    api: str  # 'openai' | 'anthropic'
    stream: bool = False
    model: str = ''
    include_usage: bool = False
    arrived: float = field(default_factory=time.perf_counter)


@dataclass
class Reply:
    """The model's answer to one call, in wire terms: the text before and around the calls, the
    calls ``(id, name, arguments)`` and the finish reason; ``raw``: the text the model sampled."""
    raw: str
    content: str
    calls: List[Tuple[str, str, Any]]
    finish_reason: Optional[str]
    prompt_tokens: int
    completion_tokens: int
    turn: int


class Returned:
    """What the gateway returned to one session's client, by what the client saw: an assistant
    message sent back unchanged is the model's exact text again (see the module docstring)."""
    __slots__ = ('_by_key', )

    def __init__(self) -> None:
        self._by_key: Dict[str, str] = {}

    @staticmethod
    def key(content: Optional[str], calls: Sequence[Tuple[str, str, Any]]) -> str:
        shown = [[i, n, a if not isinstance(a, str) else _loads_or_text(a)] for i, n, a in calls]
        return json.dumps([content or '', shown], sort_keys=True, ensure_ascii=False)

    def add(self, reply: Reply) -> None:
        self._by_key[self.key(reply.content, reply.calls)] = reply.raw
        if reply.calls and reply.content:  # clients often drop the text beside the calls
            self._by_key.setdefault(self.key(None, reply.calls), reply.raw)

    def raw(self, content: Optional[str], calls: Sequence[Tuple[str, str, Any]]) -> Optional[str]:
        return self._by_key.get(self.key(content, calls))


def _loads_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text


def _text_of(content: Any, where: str) -> str:
    """A message content as text: a string, or text parts joined (anything else refused)."""
    if content is None:
        return ''
    if isinstance(content, str):
        return content
    parts = []
    for k, part in enumerate(content):
        kind = part.get('type') if isinstance(part, dict) else None
        if kind in ('text', 'input_text', 'output_text') and isinstance(part.get('text'), str):
            parts.append(part['text'])
        else:
            raise WireError(400, f'{where}.{k}: content of type {kind!r} is not supported by the gateway (text only)',
                            param=f'{where}.{k}')
    return ''.join(parts)


def _sampling(max_tokens: Optional[int], temperature: Optional[float], top_p: Optional[float],
              seed: Optional[int], stop: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if max_tokens is not None:
        out['max_tokens'] = max_tokens
    if temperature is not None:
        out['temperature'] = temperature
    if top_p is not None:
        out['top_p'] = top_p
    if seed is not None:
        out['seed'] = seed
    if stop:
        out['stop'] = [stop] if isinstance(stop, str) else list(stop)
    return out


# ---- OpenAI in ------------------------------------------------------------------------------------
def parse_openai(body: Any, returned: Returned, render_calls: Any) -> Call:
    """An OpenAI ``/v1/chat/completions`` body as a :class:`Call` (``returned``: the session's
    answers so far; ``render_calls``: the parser's writer for tool calls the gateway did not make)."""
    req = _validated(_OpenAIRequest, body)
    if req.n not in (None, 1):
        raise WireError(400, f'n: must be 1 (got {req.n}): each sample of an episode is its own session', param='n')
    messages = []
    for k, m in enumerate(req.messages):
        where = f'messages.{k}'
        text = _text_of(m.content, f'{where}.content')
        if m.role == 'assistant':
            calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
            messages.append(_assistant(text, calls, returned, render_calls))
        elif m.role == 'tool':
            messages.append({'role': 'tool', 'content': text, 'tool_call_id': m.tool_call_id or ''})
        else:
            messages.append({'role': 'system' if m.role == 'developer' else m.role, 'content': text})
    tools = [_openai_tool(t, k) for k, t in enumerate(req.tools)] if req.tools else None
    include_usage = bool((req.stream_options or {}).get('include_usage'))
    return Call(messages, tools, _sampling(req.max_completion_tokens or req.max_tokens, req.temperature, req.top_p,
                                           req.seed, req.stop), 'openai', req.stream, req.model, include_usage)


def _openai_tool(tool: Dict[str, Any], k: int) -> Dict[str, Any]:
    function = tool.get('function') if isinstance(tool, dict) else None
    if tool.get('type', 'function') != 'function' or not isinstance(function, dict) or \
            not isinstance(function.get('name'), str):
        raise WireError(400, f'tools.{k}: a tool must be {{"type": "function", "function": {{"name": ...}}}}',
                        param=f'tools.{k}')
    return {'type': 'function', 'function': function}


def _assistant(text: str, calls: List[Tuple[str, str, Any]], returned: Returned, render_calls: Any) -> Dict[str, Any]:
    """A client's assistant message as the model's exact text when the gateway returned it, else
    its text and its calls in the model's format."""
    raw = returned.raw(text, calls)
    if raw is None and text == '':
        raw = returned.raw(None, calls)
    if raw is not None:
        return {'role': 'assistant', 'content': raw}
    if calls:
        written = render_calls([(n, _loads_or_text(a) if isinstance(a, str) else a) for _, n, a in calls])
        text = f'{text}\n{written}' if text else written
    return {'role': 'assistant', 'content': text}


# ---- Anthropic in ---------------------------------------------------------------------------------
def parse_anthropic(body: Any, returned: Returned, render_calls: Any) -> Call:
    """An Anthropic ``/v1/messages`` body as a :class:`Call` (see :func:`parse_openai`)."""
    req = _validated(_AnthropicRequest, body)
    messages: List[Dict[str, Any]] = []
    if req.system:
        messages.append({'role': 'system', 'content': _text_of(req.system, 'system')})
    for k, m in enumerate(req.messages):
        where = f'messages.{k}.content'
        blocks = [{'type': 'text', 'text': m.content}] if isinstance(m.content, str) else m.content
        if m.role == 'assistant':
            text, calls = [], []
            for j, b in enumerate(blocks):
                kind = b.get('type') if isinstance(b, dict) else None
                if kind == 'text':
                    text.append(str(b.get('text', '')))
                elif kind == 'tool_use':
                    calls.append((str(b.get('id', '')), str(b.get('name', '')), b.get('input') or {}))
                elif kind in ('thinking', 'redacted_thinking'):
                    continue  # the model's text holds its reasoning: the raw text is found by the rest
                else:
                    raise WireError(400, f'{where}.{j}: block of type {kind!r} is not supported in an assistant '
                                    'message', param=f'{where}.{j}')
            messages.append(_assistant(''.join(text), calls, returned, render_calls))
            continue
        text = []
        for j, b in enumerate(blocks):
            kind = b.get('type') if isinstance(b, dict) else None
            if kind == 'tool_result':
                content = b.get('content')
                result = _text_of(content, f'{where}.{j}.content') if not isinstance(content, str) else content
                messages.append({'role': 'tool', 'content': result, 'tool_call_id': str(b.get('tool_use_id', ''))})
            elif kind == 'text':
                text.append(str(b.get('text', '')))
            else:
                raise WireError(400, f'{where}.{j}: content of type {kind!r} is not supported by the gateway (text '
                                'and tool_result only)', param=f'{where}.{j}')
        if text or not any(b.get('type') == 'tool_result' for b in blocks if isinstance(b, dict)):
            messages.append({'role': 'user', 'content': ''.join(text)})
    tools = None
    if req.tools:
        tools = []
        for k, t in enumerate(req.tools):
            if not isinstance(t.get('name'), str):
                raise WireError(400, f'tools.{k}.name: required', param=f'tools.{k}.name')
            tools.append({'type': 'function', 'function': {'name': t['name'], 'description': t.get('description', ''),
                                                           'parameters': t.get('input_schema') or {}}})
    return Call(messages, tools, _sampling(req.max_tokens, req.temperature, req.top_p, None, req.stop_sequences),
                'anthropic', req.stream, req.model)


# ---- the model's text out -------------------------------------------------------------------------
def split_calls(text: str, parser: Any, turn: int, session: str,
                tools: Optional[Sequence[Dict[str, Any]]] = None) -> Tuple[str, List[Tuple[str, str, Any]]]:
    """``(content, calls)`` of the model's text: each well-formed, complete call taken out of the
    text as ``(id, name, arguments)`` (ids unique to this session and turn; the XML formats' text
    values typed by the client's ``tools``); a malformed or truncated call stays in the text (the
    client sees what the model wrote)."""
    if parser is None or not text:
        return text, []
    try:
        found = parse_calls(parser, text, tools)
    except Exception:  # a parser that fails on odd text: the text goes out as it is
        return text, []
    taken = [(k, c) for k, c in enumerate(found) if c.error is None and c.complete and c.name]
    calls = [(f'call_{session[-12:]}_{turn}_{k}_{_uuid.uuid4().hex[:8]}', c.name, c.arguments) for k, c in taken]
    return (take_out_calls(parser, text, [c for _, c in taken]) if calls else text), calls


def _arguments_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


_OPENAI_FINISH = {'stop': 'stop', 'length': 'length', None: 'stop'}
_ANTHROPIC_STOP = {'stop': 'end_turn', 'length': 'max_tokens', None: 'end_turn'}


def _usage(reply: Reply) -> Dict[str, int]:
    return {'prompt_tokens': reply.prompt_tokens, 'completion_tokens': reply.completion_tokens,
            'total_tokens': reply.prompt_tokens + reply.completion_tokens}


def openai_response(reply: Reply, model: str, rid: str) -> Dict[str, Any]:
    message: Dict[str, Any] = {'role': 'assistant', 'content': reply.content if reply.content or not reply.calls
                               else None}
    if reply.calls:
        message['tool_calls'] = [{'id': i, 'type': 'function', 'function': {'name': n, 'arguments': _arguments_text(a)}}
                                 for i, n, a in reply.calls]
    finish = 'tool_calls' if reply.calls else _OPENAI_FINISH.get(reply.finish_reason, 'stop')
    return {'id': rid, 'object': 'chat.completion', 'created': int(time.time()), 'model': model,
            'choices': [{'index': 0, 'message': message, 'finish_reason': finish, 'logprobs': None}],
            'usage': _usage(reply)}


def openai_chunks(reply: Reply, model: str, rid: str, include_usage: bool) -> List[Dict[str, Any]]:
    """The server-sent chunks of one reply (the whole output is known when they are sent: the
    content in one delta, each tool call in one)."""
    created = int(time.time())

    def chunk(delta: Dict[str, Any], finish: Optional[str] = None) -> Dict[str, Any]:
        return {'id': rid, 'object': 'chat.completion.chunk', 'created': created, 'model': model,
                'choices': [{'index': 0, 'delta': delta, 'finish_reason': finish, 'logprobs': None}]}

    out = [chunk({'role': 'assistant', 'content': ''})]
    if reply.content:
        out.append(chunk({'content': reply.content}))
    for k, (i, n, a) in enumerate(reply.calls):
        out.append(chunk({'tool_calls': [{'index': k, 'id': i, 'type': 'function',
                                          'function': {'name': n, 'arguments': _arguments_text(a)}}]}))
    out.append(chunk({}, 'tool_calls' if reply.calls else _OPENAI_FINISH.get(reply.finish_reason, 'stop')))
    if include_usage:
        out.append({'id': rid, 'object': 'chat.completion.chunk', 'created': created, 'model': model, 'choices': [],
                    'usage': _usage(reply)})
    return out


def _anthropic_blocks(reply: Reply) -> List[Dict[str, Any]]:
    blocks: List[Dict[str, Any]] = [{'type': 'text', 'text': reply.content}] if reply.content or not reply.calls else []
    for i, n, a in reply.calls:
        args = _loads_or_text(a) if isinstance(a, str) else a
        blocks.append({'type': 'tool_use', 'id': i, 'name': n, 'input': args if isinstance(args, dict) else {}})
    return blocks


def anthropic_response(reply: Reply, model: str, rid: str) -> Dict[str, Any]:
    stop = 'tool_use' if reply.calls else _ANTHROPIC_STOP.get(reply.finish_reason, 'end_turn')
    return {'id': rid, 'type': 'message', 'role': 'assistant', 'model': model, 'content': _anthropic_blocks(reply),
            'stop_reason': stop, 'stop_sequence': None,
            'usage': {'input_tokens': reply.prompt_tokens, 'output_tokens': reply.completion_tokens}}


def anthropic_events(reply: Reply, model: str, rid: str) -> List[Tuple[str, Dict[str, Any]]]:
    """``(event, data)`` of Anthropic's message stream for one reply."""
    message = anthropic_response(reply, model, rid)
    start = dict(message, content=[], stop_reason=None, usage={'input_tokens': reply.prompt_tokens, 'output_tokens': 0})
    events: List[Tuple[str, Dict[str, Any]]] = [('message_start', {'type': 'message_start', 'message': start})]
    for k, block in enumerate(message['content']):
        if block['type'] == 'text':
            events.append(('content_block_start', {'type': 'content_block_start', 'index': k,
                                                   'content_block': {'type': 'text', 'text': ''}}))
            events.append(('content_block_delta', {'type': 'content_block_delta', 'index': k,
                                                   'delta': {'type': 'text_delta', 'text': block['text']}}))
        else:
            events.append(('content_block_start', {'type': 'content_block_start', 'index': k, 'content_block': {
                'type': 'tool_use', 'id': block['id'], 'name': block['name'], 'input': {}}}))
            events.append(('content_block_delta', {'type': 'content_block_delta', 'index': k, 'delta': {
                'type': 'input_json_delta', 'partial_json': json.dumps(block['input'], ensure_ascii=False)}}))
        events.append(('content_block_stop', {'type': 'content_block_stop', 'index': k}))
    events.append(('message_delta', {'type': 'message_delta', 'delta': {'stop_reason': message['stop_reason'],
                                                                        'stop_sequence': None},
                                     'usage': {'output_tokens': reply.completion_tokens}}))
    events.append(('message_stop', {'type': 'message_stop'}))
    return events


# ---- errors -------------------------------------------------------------------------------------
def openai_error(err: WireError) -> Dict[str, Any]:
    return {'error': {'message': err.message, 'type': 'invalid_request_error' if err.status < 500 else 'server_error',
                      'param': err.param, 'code': err.code}}


_ANTHROPIC_TYPES = {400: 'invalid_request_error', 401: 'authentication_error', 403: 'permission_error',
                    404: 'not_found_error', 409: 'invalid_request_error', 413: 'request_too_large'}


def anthropic_error(err: WireError) -> Dict[str, Any]:
    return {'type': 'error', 'error': {'type': _ANTHROPIC_TYPES.get(err.status, 'api_error'), 'message': err.message}}
