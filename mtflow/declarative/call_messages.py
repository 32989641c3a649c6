"""How a turn's tool calls are carried in the conversation, once the scheduler has read them: each
call gets an id, each ``tool`` message answers its call (``tool_call_id``), and the assistant
message holds the calls in one of two forms (:data:`FORMS`):

``text``    the calls stay in the assistant's ``content`` as the model wrote them (what mtflow did
            before ids; every template that renders a tool message after such a message takes it,
            and its prompt is unchanged)
``openai``  the assistant message in OpenAI's shape, as a server with a tool-call parser returns it:
            ``content`` the reply without its calls and its reasoning, ``reasoning_content`` the
            reasoning, ``tool_calls`` the calls (``arguments`` a JSON string; a malformed call's
            text as written). For the templates that take tool results only after ``tool_calls``
            (gpt-oss, MiniMax-M2, Mistral Small 3.2) and for a server that renders the prompt
            itself (chat completions: OpenAI's API requires it): each call is in the conversation
            once, as ``tool_calls``

The form is chosen once per run, by the template (``mtflow.backends.pairing``); the token record
is never changed by it: the sampled ids stay what the model sampled, and a prompt that follows an
``openai``-form message extends them (``mtflow.backends.tokens``).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, List, Optional, Sequence

from mtflow.declarative.parsers.base import ToolCall, take_out_calls

__all__ = ['FORMS', 'call_ids', 'openai_tool_call', 'openai_message']

FORMS = ('text', 'openai')


def call_ids(calls: Sequence[Optional[ToolCall]], uuid: Any, turn: int) -> List[str]:
    """An id per call: the one the model wrote (Kimi-K2's ``functions.NAME:N``, Mistral's
    ``[CALL_ID]``), else nine alphanumeric characters (Mistral's templates refuse others) drawn
    from the request, the turn and the call's place, so a replay gives the same messages."""
    out = []
    for k, call in enumerate(calls):
        own = getattr(call, 'id', None)
        out.append(own if own else hashlib.sha256(f'{uuid}:{turn}:{k}'.encode()).hexdigest()[:9])
    return out


def openai_tool_call(call_id: str, name: str, arguments: str) -> Dict[str, Any]:
    """One entry of an assistant message's ``tool_calls`` (``arguments`` a JSON string)."""
    return {'id': call_id, 'type': 'function', 'function': {'name': name, 'arguments': arguments}}


def _arguments_text(call: ToolCall) -> str:
    if call.arguments is None:  # malformed: what the model wrote (a renderer reads it as {})
        return call.raw
    return call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments, ensure_ascii=False)


def openai_message(message: Dict[str, Any], content: str, reasoning: str, parser: Any,
                   calls: Sequence[ToolCall], ids: Optional[Sequence[str]]) -> Dict[str, Any]:
    """``message`` (the assistant's, its ``content`` the reply as sampled) in the ``openai`` form:
    ``content`` (the reply's content, the reasoning taken out) without ``calls``, the reasoning as
    ``reasoning_content`` (when there is some), the calls as ``tool_calls`` with ``ids``."""
    out = {k: v for k, v in message.items() if k != 'content'}
    out['content'] = take_out_calls(parser, content, calls)
    if reasoning:
        out['reasoning_content'] = reasoning
    if calls and ids:
        out['tool_calls'] = [openai_tool_call(i, c.name, _arguments_text(c)) for c, i in zip(calls, ids)]
    return out
