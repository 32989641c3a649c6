"""Streamed answers: what a growing reply can send now, token by token, in any wire format.

A backend that streams (HF through a streamer, vLLM's async engine, an OpenAI-compatible server,
the scripted model) hands each streaming call's text as it grows to a :class:`TextFeed`
(:class:`mtflow.backends.streaming.TextSinks`, keyed by the session's request). The server's
:class:`Pump` turns each new text into the format's events through a writer
(:class:`ChatStream`, :class:`~mtflow.gateway.messages_api.MessagesStream`,
:class:`~mtflow.gateway.responses_api.ResponsesStream`): reasoning and content deltas as they
come, then, once the turn is generated, what was held back, the tool calls, the finish and the
usage. A backend that does not stream gives the whole text at the end: the same events, in one
delta.

What goes out before the end must be a prefix of what the whole reply gives, so the streamed
text equals the text a non-streaming client gets. :class:`SafeText` holds back what is not yet
known: the start of a marker still being written (``<thi``, ``<tool_c``, a stop string's head),
everything from the first tool-call start on (the parser reads the call at the end), trailing
whitespace (dropped before a call), an incomplete UTF-8 character. A parser whose call starts
are unknown holds the whole content of a call that offers tools; a reasoning format that is read
whole (gpt-oss's harmony channels) holds the whole reply. Should a reply still disagree
with what was sent (a reasoning parser that rereads earlier text), the stream sends nothing more
but the end, and the gateway counts it (``stream_mismatches``) and warns.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mtflow.declarative.parsers import glm, hermes, kimi, llama, minimax, mistral, qwen3_coder
from mtflow.gateway.thinking import Thinking
from mtflow.gateway.wire import Reply, WireError, arguments_text, openai_error

__all__ = ['TextFeed', 'SafeText', 'Pump', 'ChatStream', 'call_starts', 'safe_text', 'sse']

log = logging.getLogger('mtflow.gateway')

#: what starts a tool call in each built-in format (a parser may declare its own ``call_starts``);
#: harmony and ReAct are not here: their calls are read from the whole text, so a stream holds them
_CALL_STARTS: Dict[str, Tuple[str, ...]] = {
    'hermes': (hermes.OPEN, ),
    'qwen3_coder': (qwen3_coder.OPEN, '<function='),  # the parser reads a bare <function=...> too
    'glm45': (glm.OPEN, ),
    'kimi_k2': (kimi.SECTION_BEGIN, kimi.CALL_BEGIN),
    'minimax_m2': (minimax.OPEN, ),
    'deepseek_v32': ('<｜DSML', '<|DSML'),
    'llama3_json': (llama.PYTHON_TAG, '{'),
    'pythonic': ('[', ),
    'mistral': (mistral.MARK, ),
    'deepseek': ('<｜tool', '<|tool'),
    'json': ('{', '['),
}
#: what starts a call only at the start of a reply: Mistral's marker-less JSON list (a backend that
#: skipped the special tokens), read as calls only there
_LEADING_CALLS: Dict[str, Tuple[str, ...]] = {'mistral': ('[', '{')}


def call_starts(parser: Any) -> Optional[Tuple[str, ...]]:
    """The strings that start a tool call in ``parser``'s format; ``None``: unknown (a stream
    then holds the content of a call that offers tools until the end)."""
    own = getattr(parser, 'call_starts', None)
    if own is not None:
        return tuple(own)
    return _CALL_STARTS.get(getattr(parser, 'name', ''))


def sse(data: Any, event: Optional[str] = None) -> bytes:
    """One server-sent event (``data`` as JSON, or a string as it is)."""
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f'event: {event}\n' if event else '').encode() + f'data: {body}\n\n'.encode()


class TextFeed:
    """A streaming call's text so far, pushed from the backend's thread (:meth:`push`, the
    cumulative text) and awaited on the server's loop (:meth:`next`). Pushes coalesce: a slow
    reader gets the latest text, never a backlog."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.text = ''
        self._event = asyncio.Event()
        self._lock = threading.Lock()
        self._scheduled = False

    def push(self, text: str) -> None:
        with self._lock:
            self.text = text
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the server's loop is gone: nobody reads
            pass

    def _wake(self) -> None:
        with self._lock:
            self._scheduled = False
        self._event.set()

    async def next(self) -> str:
        await self._event.wait()
        self._event.clear()
        with self._lock:
            return self.text


def _held_suffix(text: str, markers: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could be the start of one of ``markers``."""
    most = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), most, -1):
            if text.endswith(marker[:k]):
                most = k
                break
    return most


class SafeText:
    """``(reasoning, content)`` of a growing text that can go out now (see the module docstring).

    Args:
        thinking: the gateway's reasoning split.
        starts: what starts a tool call (:func:`call_starts`); ``None``: unknown.
        parse_calls: whether calls are taken out of this reply (a parser, and ``tool_choice`` not ``none``).
        offers_tools: the call offers tools (an unknown parser then holds the content).
        stops: the call's stop strings (the reply ends before them).
        leading: what starts a call only at the start of the content (the content is held while it starts so).
    """

    def __init__(self, thinking: Thinking, starts: Optional[Tuple[str, ...]], parse_calls: bool,
                 offers_tools: bool, stops: Sequence[str] = (), leading: Tuple[str, ...] = ()) -> None:
        self.thinking, self.stops = thinking, tuple(s for s in stops if s)
        self.starts = (starts or ()) if parse_calls else ()
        self.leading = leading if parse_calls else ()
        self.hold_content = parse_calls and starts is None and offers_tools
        self.hold_all = not thinking.streams  # a reasoning format read whole (harmony's channels)
        self.markers = tuple(thinking.markers) + self.starts + self.stops

    def __call__(self, text: str) -> Tuple[str, str]:
        if self.hold_all:
            return '', ''
        text = text.rstrip('\ufffd')  # a character whose last bytes are still to come
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                text = text[:at]
        text = text[:len(text) - _held_suffix(text, self.markers)]
        reasoning, content = self.thinking.split(text)
        if self.hold_content or (self.leading and content.lstrip().startswith(self.leading)):
            return reasoning, ''
        found = [at for at in (content.find(s) for s in self.starts) if at >= 0]
        if found:
            content = content[:min(found)]
        return reasoning, content.rstrip()


def safe_text(call: Any, thinking: Thinking, parser: Any, run_stops: Optional[Sequence[str]] = None) -> SafeText:
    """The :class:`SafeText` of one call: its tools, ``tool_choice`` and stop strings (with the run's)."""
    stops = list(call.sampling.get('stop') or ()) + list(run_stops or ())
    return SafeText(thinking, call_starts(parser), parser is not None and call.tool_choice != 'none', bool(call.tools),
                    stops, _LEADING_CALLS.get(getattr(parser, 'name', ''), ()))


class Pump:
    """One streamed answer: ``update(text)`` while the turn generates, ``finish(reply)`` at the
    end; each returns the writer's events (bytes) to send. ``diverged``: a later text disagreed
    with what was sent (the rest then goes out at the end only)."""

    def __init__(self, writer: Any, safe: SafeText) -> None:
        self.writer, self.safe = writer, safe
        self.reasoning = self.content = ''
        self.started = False
        self.diverged = False

    def _start(self) -> List[bytes]:
        if self.started:
            return []
        self.started = True
        return list(self.writer.start())

    def _send(self, reasoning: str, content: str) -> List[bytes]:
        if self.reasoning.startswith(reasoning) and self.content.startswith(content):
            return []  # nothing new: a text no further than what went out (a backend that restarted its stream)
        if not (reasoning.startswith(self.reasoning) and content.startswith(self.content)):
            self.diverged = True
            return []
        out: List[bytes] = []
        if len(reasoning) > len(self.reasoning):
            out += self.writer.reasoning(reasoning[len(self.reasoning):])
            self.reasoning = reasoning
        if len(content) > len(self.content):
            out += self.writer.content(content[len(self.content):])
            self.content = content
        return out

    def update(self, text: str) -> List[bytes]:
        if self.diverged:
            return []
        reasoning, content = self.safe(text)
        if not reasoning and not content:
            return []
        return self._start() + self._send(reasoning, content)

    def finish(self, reply: Reply) -> List[bytes]:
        out = self._start()
        if not self.diverged:
            out += self._send(reply.reasoning, reply.content)
        if self.diverged:
            log.warning('gateway: a streamed reply (turn %s) disagreed with its whole text; the client got the part '
                        'sent before it', reply.turn)
        return out + list(self.writer.end(reply))

    def error(self, err: WireError) -> List[bytes]:
        return self._start() + list(self.writer.error(err))


# ---- OpenAI chat completions ----------------------------------------------------------------------
_OPENAI_FINISH = {'stop': 'stop', 'length': 'length', None: 'stop'}


def chat_finish(reply: Reply) -> str:
    return 'tool_calls' if reply.calls else _OPENAI_FINISH.get(reply.finish_reason, 'stop')


def usage_of(reply: Reply) -> Dict[str, int]:
    return {'prompt_tokens': reply.prompt_tokens, 'completion_tokens': reply.completion_tokens,
            'total_tokens': reply.prompt_tokens + reply.completion_tokens}


class ChatStream:
    """Chat completions' chunks: the role, then ``reasoning_content`` and ``content`` deltas,
    each tool call whole, the finish (with the logprobs when asked), the usage, ``[DONE]``."""

    def __init__(self, model: str, rid: str, include_usage: bool, logprobs: Any) -> None:
        self.model, self.rid, self.include_usage, self.logprobs = model, rid, include_usage, logprobs
        self.created = int(time.time())

    def _chunk(self, delta: Dict[str, Any], finish: Optional[str] = None, logprobs: Any = None) -> bytes:
        return sse({'id': self.rid, 'object': 'chat.completion.chunk', 'created': self.created, 'model': self.model,
                    'choices': [{'index': 0, 'delta': delta, 'finish_reason': finish, 'logprobs': logprobs}]})

    def start(self) -> List[bytes]:
        return [self._chunk({'role': 'assistant', 'content': ''})]

    def reasoning(self, delta: str) -> List[bytes]:
        return [self._chunk({'reasoning_content': delta})]

    def content(self, delta: str) -> List[bytes]:
        return [self._chunk({'content': delta})]

    def end(self, reply: Reply) -> List[bytes]:
        out = [self._chunk({'tool_calls': [{'index': k, 'id': i, 'type': 'function',
                                            'function': {'name': n, 'arguments': arguments_text(a)}}]})
               for k, (i, n, a) in enumerate(reply.calls)]
        out.append(self._chunk({}, chat_finish(reply), self.logprobs(reply)))
        if self.include_usage:
            out.append(sse({'id': self.rid, 'object': 'chat.completion.chunk', 'created': self.created,
                            'model': self.model, 'choices': [], 'usage': usage_of(reply)}))
        return out + [b'data: [DONE]\n\n']

    def error(self, err: WireError) -> List[bytes]:
        return [sse(openai_error(err)), b'data: [DONE]\n\n']
