"""The wire formats the gateway serves, in one table: how each reads a call, answers it whole,
streams it, says an error, and names a response.

=============  ===============================  =================================================
format         request                          module
=============  ===============================  =================================================
``openai``     ``POST /v1/chat/completions``    :mod:`.chat_api`
``responses``  ``POST /v1/responses``           :mod:`.responses_api`
``anthropic``  ``POST /v1/messages``            :mod:`.messages_api`
=============  ===============================  =================================================
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Callable, Dict

from mtflow.gateway.chat_api import chat_response, chat_stream, parse_chat
from mtflow.gateway.messages_api import MessagesStream, messages_response, parse_messages
from mtflow.gateway.responses_api import ResponseIds, ResponsesStream, ResponseStore, parse_responses, response_object
from mtflow.gateway.wire import anthropic_error, openai_error

__all__ = ['Format', 'FORMATS']


@dataclass(frozen=True)
class Format:
    """One wire format: ``parse(body, returned, render_calls, previous) -> Call``, ``answer(reply,
    call, model, rid) -> body``, ``writer(call, model, rid)`` (a stream writer, :mod:`.streaming`),
    ``error(WireError) -> body``, ``new_id() -> rid``."""
    parse: Callable[..., Any]
    answer: Callable[..., Dict[str, Any]]
    writer: Callable[..., Any]
    error: Callable[..., Dict[str, Any]]
    new_id: Callable[[], str]


FORMATS: Dict[str, Format] = {
    'openai': Format(lambda body, returned, render, previous: parse_chat(body, returned, render), chat_response,
                     chat_stream, openai_error, lambda: 'chatcmpl-' + secrets.token_hex(12)),
    'responses': Format(parse_responses, lambda reply, call, model, rid: response_object(reply, call, model,
                                                                                         ResponseIds(rid)),
                        lambda call, model, rid: ResponsesStream(call, model, ResponseIds(rid)), openai_error,
                        ResponseStore.new_id),
    'anthropic': Format(lambda body, returned, render, previous: parse_messages(body, returned, render),
                        messages_response, lambda call, model, rid: MessagesStream(model, rid), anthropic_error,
                        lambda: 'msg_' + secrets.token_hex(12)),
}
