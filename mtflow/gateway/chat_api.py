"""OpenAI chat completions (``POST /v1/chat/completions``), in and out (see :mod:`.wire`).

In: the messages (a ``developer`` message is a system one; text and image parts), the function
tools, ``tool_choice`` (:func:`.wire.tool_choice_of`: ``none`` honoured, a forced call checked),
``response_format`` (text only), ``logprobs``/``top_logprobs``, the sampling, ``n=1``. Out: the
message with its ``reasoning_content``, ``content`` and ``tool_calls``, the finish reason, the
logprobs when asked, the usage; streamed as chunks (:class:`mtflow.gateway.streaming.ChatStream`).
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import Field

from mtflow.gateway.streaming import ChatStream, chat_finish, usage_of
from mtflow.gateway.wire import (AssistantTurn, Call, Loose, Reply, Returned, WireError, arguments_text, content_of,
                                 logprob_items, refuse_format, sampling, tool_choice_of, validated)

__all__ = ['parse_chat', 'chat_response', 'chat_stream']


class _Function(Loose):
    name: str
    arguments: Union[str, Dict[str, Any]] = ''


class _ToolCall(Loose):
    id: str = ''
    type: str = 'function'
    function: _Function


class _Message(Loose):
    role: Literal['system', 'developer', 'user', 'assistant', 'tool']
    content: Union[str, List[Dict[str, Any]], None] = None
    name: Optional[str] = None
    tool_calls: Optional[List[_ToolCall]] = None
    tool_call_id: Optional[str] = None


class _Request(Loose):
    model: str = ''
    messages: List[_Message] = Field(min_length=1)
    stream: bool = False
    stream_options: Optional[Dict[str, Any]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    response_format: Optional[Dict[str, Any]] = None
    n: Optional[int] = 1
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, List[str], None] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)


def function_tool(tool: Any, where: str) -> Dict[str, Any]:
    """A chat completions tool (``{"type": "function", "function": {...}}``) checked."""
    function = tool.get('function') if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get('type', 'function') != 'function' or not isinstance(function, dict) \
            or not isinstance(function.get('name'), str):
        raise WireError(400, f'{where}: a tool must be {{"type": "function", "function": {{"name": ...}}}}',
                        param=where)
    return {'type': 'function', 'function': function}


def parse_chat(body: Any, returned: Returned, render_calls: Any) -> Call:
    """A ``/v1/chat/completions`` body as a :class:`Call` (``returned``: the session's answers so
    far; ``render_calls``: the parser's writer for tool calls the gateway did not make)."""
    req = validated(_Request, body)
    if req.n not in (None, 1):
        raise WireError(400, f'n: must be 1 (got {req.n}): each sample of an episode is its own session', param='n')
    if req.response_format is not None:
        refuse_format(req.response_format.get('type'), 'response_format.type')
    if req.top_logprobs and not req.logprobs:
        raise WireError(400, 'top_logprobs: needs logprobs: true', param='top_logprobs')
    assistant = AssistantTurn(returned, render_calls)
    messages: List[Dict[str, Any]] = []
    images: List[str] = []
    for k, m in enumerate(req.messages):
        text, seen = content_of(m.content, f'messages.{k}.content')
        images += seen
        if m.role == 'assistant':
            messages.append(assistant.message(text, [(c.id, c.function.name, c.function.arguments)
                                                     for c in m.tool_calls or []]))
        elif m.role == 'tool':
            messages.append({'role': 'tool', 'content': text, 'tool_call_id': m.tool_call_id or ''})
        else:
            messages.append({'role': 'system' if m.role == 'developer' else m.role, 'content': text})
    tools = [function_tool(t, f'tools.{k}') for k, t in enumerate(req.tools)] if req.tools else None
    include_usage = bool((req.stream_options or {}).get('include_usage'))
    return Call(messages, tools, sampling(req.max_completion_tokens or req.max_tokens, req.temperature, req.top_p,
                                          req.seed, req.stop), 'openai', req.stream, req.model, include_usage,
                images=images, tool_choice=tool_choice_of(req.tool_choice),
                logprobs=(req.top_logprobs or 0) if req.logprobs else None)


def _logprobs(call: Call) -> Any:
    def of(reply: Reply) -> Optional[Dict[str, Any]]:
        return {'content': logprob_items(reply, call.logprobs or 0)} if call.logprobs is not None else None
    return of


def chat_response(reply: Reply, call: Call, model: str, rid: str) -> Dict[str, Any]:
    message: Dict[str, Any] = {'role': 'assistant', 'content': reply.content if reply.content or not reply.calls
                               else None}
    if reply.reasoning:
        message['reasoning_content'] = reply.reasoning
    if reply.calls:
        message['tool_calls'] = [{'id': i, 'type': 'function', 'function': {'name': n, 'arguments': arguments_text(a)}}
                                 for i, n, a in reply.calls]
    return {'id': rid, 'object': 'chat.completion', 'created': int(time.time()), 'model': model,
            'choices': [{'index': 0, 'message': message, 'finish_reason': chat_finish(reply),
                         'logprobs': _logprobs(call)(reply)}],
            'usage': usage_of(reply)}


def chat_stream(call: Call, model: str, rid: str) -> ChatStream:
    return ChatStream(model, rid, call.include_usage, _logprobs(call))
