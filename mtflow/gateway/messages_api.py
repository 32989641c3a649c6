"""Anthropic messages (``POST /v1/messages``), in and out (see :mod:`.wire`).

In: ``system`` (a string or text blocks), the messages (text, image and ``tool_result`` blocks;
a ``system`` message mid-conversation, as Claude Code sends them; an assistant's ``thinking``
blocks are the model's own text, found again with the rest), the tools (``input_schema``),
``tool_choice`` (``auto``, ``none``, ``any``, ``tool``: as :func:`.wire.tool_choice_of` says),
the sampling. Out: a ``thinking`` block for the reasoning, a ``text`` block, a ``tool_use`` block
per call, the stop reason and the usage; streamed as Anthropic's events (:class:`MessagesStream`).
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import Field

from mtflow.gateway.streaming import sse
from mtflow.gateway.wire import (AssistantTurn, Call, Loose, Reply, Returned, WireError, anthropic_error, content_of,
                                 loads_or_text, sampling, tool_choice_of, validated)

__all__ = ['parse_messages', 'messages_response', 'MessagesStream']


class _Message(Loose):
    role: Literal['user', 'assistant', 'system']
    content: Union[str, List[Dict[str, Any]]]


class _Request(Loose):
    model: str = ''
    messages: List[_Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: Union[str, List[Dict[str, Any]], None] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Dict[str, Any]] = None
    stream: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop_sequences: Optional[List[str]] = None


def _assistant(blocks: List[Any], where: str, turn: AssistantTurn) -> Dict[str, Any]:
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
            raise WireError(400, f'{where}.{j}: block of type {kind!r} is not supported in an assistant message',
                            param=f'{where}.{j}')
    return turn.message(''.join(text), calls)


def _user(blocks: List[Any], where: str, messages: List[Dict[str, Any]], images: List[str]) -> None:
    text: List[str] = []
    for j, b in enumerate(blocks):
        kind = b.get('type') if isinstance(b, dict) else None
        if kind == 'tool_result':
            result, seen = content_of(b.get('content'), f'{where}.{j}.content')
            images += seen
            messages.append({'role': 'tool', 'content': result, 'tool_call_id': str(b.get('tool_use_id', ''))})
        elif kind in ('text', 'image'):
            part, seen = content_of([b], f'{where}.{j}')
            images += seen
            text.append(part)
        else:
            raise WireError(400, f'{where}.{j}: content of type {kind!r} is not supported by the gateway (text, image '
                            'and tool_result)', param=f'{where}.{j}')
    if text or not any(b.get('type') == 'tool_result' for b in blocks if isinstance(b, dict)):
        messages.append({'role': 'user', 'content': ''.join(text)})


def parse_messages(body: Any, returned: Returned, render_calls: Any) -> Call:
    """An Anthropic ``/v1/messages`` body as a :class:`Call` (see :func:`.chat_api.parse_chat`)."""
    req = validated(_Request, body)
    messages: List[Dict[str, Any]] = []
    images: List[str] = []
    if req.system:
        system, seen = content_of(req.system, 'system')
        images += seen
        messages.append({'role': 'system', 'content': system})
    turn = AssistantTurn(returned, render_calls)
    for k, m in enumerate(req.messages):
        where = f'messages.{k}.content'
        blocks = [{'type': 'text', 'text': m.content}] if isinstance(m.content, str) else m.content
        if m.role == 'assistant':
            messages.append(_assistant(blocks, where, turn))
        elif m.role == 'system':  # a system message mid-conversation (Claude Code sends them)
            text, seen = content_of(m.content, where)
            images += seen
            messages.append({'role': 'system', 'content': text})
        else:
            _user(blocks, where, messages, images)
    tools = None
    if req.tools:
        tools = []
        for k, t in enumerate(req.tools):
            if not isinstance(t.get('name'), str):
                raise WireError(400, f'tools.{k}.name: required', param=f'tools.{k}.name')
            tools.append({'type': 'function', 'function': {'name': t['name'], 'description': t.get('description', ''),
                                                           'parameters': t.get('input_schema') or {}}})
    return Call(messages, tools, sampling(req.max_tokens, req.temperature, req.top_p, None, req.stop_sequences),
                'anthropic', req.stream, req.model, images=images, tool_choice=tool_choice_of(req.tool_choice))


_STOP = {'stop': 'end_turn', 'length': 'max_tokens', None: 'end_turn'}


def _blocks(reply: Reply) -> List[Dict[str, Any]]:
    blocks: List[Dict[str, Any]] = [{'type': 'thinking', 'thinking': reply.reasoning, 'signature': ''}] \
        if reply.reasoning else []
    if reply.content or not reply.calls:
        blocks.append({'type': 'text', 'text': reply.content})
    for i, n, a in reply.calls:
        args = loads_or_text(a) if isinstance(a, str) else a
        blocks.append({'type': 'tool_use', 'id': i, 'name': n, 'input': args if isinstance(args, dict) else {}})
    return blocks


def _stop_reason(reply: Reply) -> str:
    return 'tool_use' if reply.calls else _STOP.get(reply.finish_reason, 'end_turn')


def messages_response(reply: Reply, call: Call, model: str, rid: str) -> Dict[str, Any]:
    return {'id': rid, 'type': 'message', 'role': 'assistant', 'model': model, 'content': _blocks(reply),
            'stop_reason': _stop_reason(reply), 'stop_sequence': None,
            'usage': {'input_tokens': reply.prompt_tokens, 'output_tokens': reply.completion_tokens}}


class MessagesStream:
    """Anthropic's message stream: ``message_start``, a ``thinking`` or ``text`` block opened for
    each run of reasoning or content deltas, the ``tool_use`` blocks, ``message_delta`` (stop
    reason, usage), ``message_stop``."""

    def __init__(self, model: str, rid: str) -> None:
        self.model, self.rid = model, rid
        self.index = -1
        self.open: Optional[str] = None

    def start(self) -> List[bytes]:
        message = {'id': self.rid, 'type': 'message', 'role': 'assistant', 'model': self.model, 'content': [],
                   'stop_reason': None, 'stop_sequence': None, 'usage': {'input_tokens': 0, 'output_tokens': 0}}
        return [sse({'type': 'message_start', 'message': message}, 'message_start')]

    def _close(self) -> List[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == 'thinking':
            out.append(sse({'type': 'content_block_delta', 'index': self.index,
                            'delta': {'type': 'signature_delta', 'signature': ''}}, 'content_block_delta'))
        self.open = None
        return out + [sse({'type': 'content_block_stop', 'index': self.index}, 'content_block_stop')]

    def _block(self, block: Dict[str, Any], delta: Dict[str, Any]) -> List[bytes]:
        out = []
        if self.open != block['type']:
            out = self._close()
            self.index += 1
            self.open = block['type'] if block['type'] != 'tool_use' else None
            out.append(sse({'type': 'content_block_start', 'index': self.index, 'content_block': block},
                           'content_block_start'))
        out.append(sse({'type': 'content_block_delta', 'index': self.index, 'delta': delta}, 'content_block_delta'))
        return out

    def reasoning(self, delta: str) -> List[bytes]:
        return self._block({'type': 'thinking', 'thinking': '', 'signature': ''},
                           {'type': 'thinking_delta', 'thinking': delta})

    def content(self, delta: str) -> List[bytes]:
        return self._block({'type': 'text', 'text': ''}, {'type': 'text_delta', 'text': delta})

    def end(self, reply: Reply) -> List[bytes]:
        out: List[bytes] = []
        if self.index < 0 and not reply.calls:  # an empty answer still has its text block
            out += self.content('')
        for block in _blocks(reply):
            if block['type'] != 'tool_use':
                continue
            out += self._block(dict(block, input={}), {'type': 'input_json_delta',
                                                       'partial_json': json.dumps(block['input'], ensure_ascii=False)})
            out.append(sse({'type': 'content_block_stop', 'index': self.index}, 'content_block_stop'))
        out += self._close()
        out.append(sse({'type': 'message_delta', 'delta': {'stop_reason': _stop_reason(reply), 'stop_sequence': None},
                        'usage': {'input_tokens': reply.prompt_tokens, 'output_tokens': reply.completion_tokens}},
                       'message_delta'))
        return out + [sse({'type': 'message_stop'}, 'message_stop')]

    def error(self, err: WireError) -> List[bytes]:
        return self._close() + [sse(anthropic_error(err), 'error')]

