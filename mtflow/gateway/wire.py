"""What the gateway's three wire formats share: a call in mtflow's terms, a reply, the errors.

The formats themselves are one module each: OpenAI chat completions (:mod:`.chat_api`),
Anthropic messages (:mod:`.messages_api`) and the OpenAI Responses API (:mod:`.responses_api`).
Each validates a request body with pydantic models (extra keys allowed, as the servers allow
them) and turns it into a :class:`Call`: mtflow's own conversation, the *canonical* messages
every call of a session is compared in (``{'role', 'content'}`` dicts; a tool result keeps its
``tool_call_id``; text parts joined; an image part is an ``<image>`` placeholder in the text and
its data URL in :attr:`Call.images`, in order). An assistant message the gateway itself
returned becomes the exact text the model sampled (the session's :class:`Returned` map, keyed by
what the client got: its text without the reasoning, its tool calls' ids, names and arguments),
so a client that sends the history back unchanged, with or without the thinking, extends the
model's own ids; any other assistant message is its text plus its tool calls written in the
parser's format (:meth:`mtflow.declarative.parsers.ToolCallParser.render_calls`).

Out: the model's text is split into reasoning (:mod:`.thinking`), content and tool calls
(:func:`split_calls`), the :class:`Reply` each format writes as a whole response or as
server-sent events (:mod:`.streaming`).

What the gateway cannot honour it refuses, naming the field: a ``response_format`` (or the
Responses API's ``text.format``) other than text, an image that is not a data URL. A
``tool_choice`` is honoured: ``none`` takes no calls out of the reply; ``required`` (Anthropic's
``any``) and a named function are checked, and a reply that does not make the call is answered
with a 400 that says so (:func:`unmet_tool_choice`).
Every problem is a :class:`WireError` with the HTTP status and the field it names.
"""
from __future__ import annotations

import json
import time
import uuid as _uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from pydantic import BaseModel, ConfigDict, ValidationError

from mtflow.core.images import IMAGE_TOKEN
from mtflow.declarative.parsers import parse_calls
from mtflow.declarative.parsers.base import take_out_calls
from mtflow.declarative.tool_calls import server_calls

__all__ = ['WireError', 'Loose', 'Call', 'Reply', 'Returned', 'validated', 'validation_message', 'content_of',
           'sampling', 'tool_choice_of', 'refuse_format', 'split_calls', 'structured_calls', 'arguments_text', 'loads_or_text',
           'openai_error', 'anthropic_error', 'call_id', 'AssistantTurn', 'logprob_items', 'unmet_tool_choice']


class WireError(Exception):
    """A request the gateway refuses: ``status`` (400, 401, 404, 409, 413, ...), the message, and
    the field or session it names (``code``: a short machine-readable reason)."""

    def __init__(self, status: int, message: str, code: str = 'invalid_request_error',
                 param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class Loose(BaseModel):
    """A request model that keeps the keys it does not name (servers accept them too)."""
    model_config = ConfigDict(extra='allow')


def validation_message(exc: ValidationError) -> Tuple[str, str]:
    """``(message, field)`` of pydantic's first error: ``messages.2.role: Input should be ...``."""
    err = exc.errors()[0]
    where = '.'.join(str(p) for p in err.get('loc', ())) or 'body'
    return f'{where}: {err.get("msg", "invalid")}', where


def validated(model: type, body: Any) -> Any:
    """``body`` as ``model``, or a 400 naming the first wrong field."""
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
    specs), the sampling the client asked for, and how to answer (``api``, ``stream``).

    ``images``: the images of the messages, in placeholder order (data URLs; the gateway stores
    each in the run directory and puts its reference here); ``tool_choice``: ``auto``, ``none``
    (calls are then not taken out of the text), ``required`` or ``function:<name>`` (checked);
    ``logprobs``: ``None`` when not asked, else how many alternatives per token (0: the sampled
    token's only); ``echo``: what a Responses answer repeats of its request;
    ``previous_response_id``: the stored response it continues."""
    messages: List[Dict[str, Any]]
    tools: Optional[List[Dict[str, Any]]]
    sampling: Dict[str, Any]
    api: str  # 'openai' | 'anthropic' | 'responses'
    stream: bool = False
    model: str = ''
    include_usage: bool = False
    images: List[Any] = field(default_factory=list)
    tool_choice: str = 'auto'
    logprobs: Optional[int] = None
    echo: Dict[str, Any] = field(default_factory=dict)
    previous_response_id: Optional[str] = None
    arrived: float = field(default_factory=time.perf_counter)


@dataclass
class Reply:
    """The model's answer to one call, in wire terms: its reasoning, the text before and around
    the calls, the calls ``(id, name, arguments)`` and the finish reason; ``raw``: the text the
    model sampled; ``logprobs``: per sampled token ``{token, logprob, bytes, top_logprobs}`` (when
    the backend gave them)."""
    raw: str
    content: str
    calls: List[Tuple[str, str, Any]]
    finish_reason: Optional[str]
    prompt_tokens: int
    completion_tokens: int
    turn: int
    reasoning: str = ''
    logprobs: Optional[List[Dict[str, Any]]] = None


class Returned:
    """What the gateway returned to one session's client, by what the client saw: an assistant
    message sent back unchanged is the model's exact text again (see the module docstring)."""
    __slots__ = ('_by_key', )

    def __init__(self) -> None:
        self._by_key: Dict[str, str] = {}

    @staticmethod
    def key(content: Optional[str], calls: Sequence[Tuple[str, str, Any]]) -> str:
        shown = [[i, n, a if not isinstance(a, str) else loads_or_text(a)] for i, n, a in calls]
        return json.dumps([content or '', shown], sort_keys=True, ensure_ascii=False)

    def add(self, reply: Reply) -> None:
        self._by_key[self.key(reply.content, reply.calls)] = reply.raw
        if reply.calls and reply.content:  # clients often drop the text beside the calls
            self._by_key.setdefault(self.key(None, reply.calls), reply.raw)

    def raw(self, content: Optional[str], calls: Sequence[Tuple[str, str, Any]]) -> Optional[str]:
        return self._by_key.get(self.key(content, calls))


class AssistantTurn:
    """A client's assistant message (its text and its calls) as the model's exact text when the
    gateway returned it, else its text and its calls in the model's format (``render_calls``)."""

    def __init__(self, returned: Returned, render_calls: Any) -> None:
        self.returned, self.render_calls = returned, render_calls

    def message(self, text: str, calls: List[Tuple[str, str, Any]]) -> Dict[str, Any]:
        raw = self.returned.raw(text, calls)
        if raw is None and text == '':
            raw = self.returned.raw(None, calls)
        if raw is not None:
            return {'role': 'assistant', 'content': raw}
        if calls:
            written = self.render_calls([(n, loads_or_text(a) if isinstance(a, str) else a) for _, n, a in calls])
            text = f'{text}\n{written}' if text else written
        return {'role': 'assistant', 'content': text}


def loads_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text


def arguments_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def call_id(session: str, turn: int, k: int) -> str:
    """A tool call's id, unique to its session and turn."""
    return f'call_{session[-12:]}_{turn}_{k}_{_uuid.uuid4().hex[:8]}'


# ---- content -----------------------------------------------------------------------------------
_TEXT_PARTS = ('text', 'input_text', 'output_text')


def _image_url(part: Dict[str, Any], kind: str, where: str) -> str:
    """The data URL of an image part (OpenAI ``image_url``, the Responses API's ``input_image``,
    Anthropic's ``image``); anything but an inline image is refused."""
    if kind == 'image':  # Anthropic: {"source": {"type": "base64", "media_type", "data"}}
        source = part.get('source') if isinstance(part.get('source'), dict) else {}
        if source.get('type') == 'base64' and isinstance(source.get('data'), str):
            return f'data:{source.get("media_type") or "image/png"};base64,{source["data"]}'
        url = source.get('url') if source.get('type') == 'url' else None
    else:
        url = part.get('image_url')
        url = url.get('url') if isinstance(url, dict) else url
        if kind == 'input_image' and url is None and part.get('file_id'):
            raise WireError(400, f'{where}: an image by file_id is not served by the gateway (send a data URL)',
                            param=where)
    if isinstance(url, str) and url.startswith('data:'):
        return url
    shown = url[:60] if isinstance(url, str) else url
    raise WireError(400, f'{where}: the gateway takes inline images only (a data:image/...;base64 URL), not '
                    f'{shown!r}: remote images are not fetched', param=where)


def content_of(content: Any, where: str) -> Tuple[str, List[str]]:
    """A message content as ``(text, images)``: a string, or parts: text joined, each image an
    ``<image>`` placeholder at its place and its data URL in ``images`` (anything else refused)."""
    if content is None:
        return '', []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise WireError(400, f'{where}: must be a string or a list of parts', param=where)
    texts: List[str] = []
    images: List[str] = []
    for k, part in enumerate(content):
        kind = part.get('type') if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get('text'), str):
            texts.append(part['text'])
        elif kind in ('image_url', 'input_image', 'image'):
            images.append(_image_url(part, kind, f'{where}.{k}'))
            texts.append(IMAGE_TOKEN)
        else:
            raise WireError(400, f'{where}.{k}: content of type {kind!r} is not supported by the gateway (text and '
                            'images)', param=f'{where}.{k}')
    return ''.join(texts), images


def sampling(max_tokens: Optional[int], temperature: Optional[float], top_p: Optional[float],
             seed: Optional[int], stop: Any) -> Dict[str, Any]:
    """The sampling a call asked for, by mtflow's names (only what it gave)."""
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


# ---- what the gateway honours or refuses ---------------------------------------------------------
def tool_choice_of(value: Any, where: str = 'tool_choice') -> str:
    """Any format's ``tool_choice`` (a string, or an object with a ``type``) as ``auto``, ``none``,
    ``required`` or ``function:<name>``. The gateway samples the model as it is: ``none`` is
    honoured by taking no calls out of the reply; ``required`` and a named function by checking
    the reply (:func:`unmet_tool_choice`)."""
    if value is None:
        return 'auto'
    kind = value if isinstance(value, str) else value.get('type') if isinstance(value, dict) else None
    if kind in ('auto', 'none'):
        return kind
    if kind in ('required', 'any'):
        return 'required'
    if kind in ('function', 'tool') and isinstance(value, dict):
        name = value.get('name') or (value.get('function') or {}).get('name')
        if isinstance(name, str) and name:
            return f'function:{name}'
    raise WireError(400, f'{where}: {value!r:.80} is not a tool_choice the gateway honours (auto, none, required, or '
                    'one function by name)', code='unsupported_tool_choice', param=where)


def unmet_tool_choice(call: Any, reply: 'Reply') -> Optional[WireError]:
    """The error a call gets when its reply does not make the call its ``tool_choice`` asked for
    (the reply stays in the trajectory: it is what the model sampled)."""
    choice = getattr(call, 'tool_choice', 'auto')
    if choice == 'required' and not reply.calls:
        wanted = 'a tool call'
    elif choice.startswith('function:') and choice[9:] not in [n for _, n, _ in reply.calls]:
        wanted = f'a call of {choice[9:]!r}'
    else:
        return None
    return WireError(400, f'tool_choice asked for {wanted} and the model\'s reply (turn {reply.turn}) made none: the '
                     'gateway samples the model as it is and cannot force a call (the reply is in the trajectory)',
                     code='tool_choice_unmet', param='tool_choice')


def refuse_format(kind: Any, where: str) -> None:
    """A structured output format (anything but text) is refused: no backend's sampling is
    constrained to a schema here."""
    if kind in (None, 'text'):
        return
    raise WireError(400, f'{where}: {kind!r} cannot be honoured: the gateway samples the model as it is and cannot '
                    'constrain its output to a format; send "text" (and check the output yourself)',
                    code='unsupported_response_format', param=where)


# ---- the model's text out -------------------------------------------------------------------------
def split_calls(text: str, parser: Any, turn: int, session: str,
                tools: Optional[Sequence[Dict[str, Any]]] = None) -> Tuple[str, List[Tuple[str, str, Any]]]:
    """``(content, calls)`` of the model's text: each well-formed, complete call taken out of the
    text as ``(id, name, arguments)`` (ids unique to this session and turn; the XML formats' text
    values typed by the client's ``tools``); a malformed or truncated call stays in the text (the
    client sees what the model wrote). With calls, the content is the text without the calls' text
    and the wrappers they leave empty (the parser's ``without_calls``), stripped: it begins with
    the text before the first call, which a stream sends as it comes (:mod:`.streaming`)."""
    if parser is None or not text:
        return text, []
    try:
        found = parse_calls(parser, text, tools)
    except Exception:  # a parser that fails on odd text: the text goes out as it is
        return text, []
    taken = [(k, c) for k, c in enumerate(found) if c.error is None and c.complete and c.name]
    calls = [(call_id(session, turn, k), c.name, c.arguments) for k, c in taken]
    # the parser takes its calls' text out, and the wrappers they leave empty (Kimi-K2's section,
    # MiniMax-M2's and DSML's blocks): one rule with a scheduler's messages (mtflow.declarative.call_messages)
    return (take_out_calls(parser, text, [c for _, c in taken]) if calls else text), calls



def structured_calls(tool_calls: List[Any], turn: int, session: str) -> List[Tuple[str, str, Any]]:
    """The calls a server behind the gateway returned structured (an ``openai`` backend in chat
    mode against ``vllm serve --enable-auto-tool-choice``, SGLang, a hosted API) as ``(id, name,
    arguments)``: the server's id where it gave one; arguments that are not a JSON object go out
    as the server wrote them (the client sees what the model wrote)."""
    calls, message_calls = server_calls(tool_calls)
    given = [(c if isinstance(c, dict) else c.model_dump()).get('id') for c in tool_calls]
    return [(str(given[k]) if given[k] else call_id(session, turn, k), call.name,
             call.arguments if call.error is None else call.raw)
            for k, (call, _) in enumerate(zip(calls, message_calls))]

# ---- errors -------------------------------------------------------------------------------------
def openai_error(err: WireError) -> Dict[str, Any]:
    return {'error': {'message': err.message, 'type': 'invalid_request_error' if err.status < 500 else 'server_error',
                      'param': err.param, 'code': err.code}}


_ANTHROPIC_TYPES = {400: 'invalid_request_error', 401: 'authentication_error', 403: 'permission_error',
                    404: 'not_found_error', 409: 'invalid_request_error', 413: 'request_too_large'}


def anthropic_error(err: WireError) -> Dict[str, Any]:
    return {'type': 'error', 'error': {'type': _ANTHROPIC_TYPES.get(err.status, 'api_error'), 'message': err.message}}


def logprob_items(reply: Reply, top: int) -> List[Dict[str, Any]]:
    """The reply's per-token logprobs in OpenAI's shape (``token``, ``logprob``, ``bytes``,
    ``top_logprobs`` cut to ``top``): every sampled token, reasoning and tool calls included."""
    def entry(item: Dict[str, Any]) -> Dict[str, Any]:
        token = str(item.get('token', ''))
        return {'token': token, 'logprob': float(item.get('logprob', 0.0)), 'bytes': list(token.encode('utf-8'))}

    return [dict(entry(item), top_logprobs=[entry(t) for t in (item.get('top_logprobs') or [])[:top]])
            for item in reply.logprobs or ()]
