"""Request, response and output models with ms-swift's names, fields and constructor keywords.

ms-swift declares these as dataclasses (and ``RolloutOutput`` as a pydantic model) in
``swift.infer_engine.protocol``. mtflow re-declares them as pydantic models so that code written
against ms-swift (``RolloutInferRequest(messages=..., uuid=...)``,
``ChatCompletionResponseChoice(index=0, message=..., finish_reason='stop', token_ids=[...])``)
builds them unchanged, without importing ms-swift. ``from_attributes`` is on everywhere, so a
field typed with one of these models also accepts ms-swift's dataclass instances (or any object
with the same attributes) and converts them field by field.

The executor itself never requires these classes: it reads requests, responses and outputs by
attribute (duck typing), so ms-swift's own objects pass through it untouched.
"""
from __future__ import annotations

import time
import uuid as _uuid
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

Message = Dict[str, Any]
Messages = List[Message]
Tool = Dict[str, Any]

__all__ = [
    'Message', 'Messages', 'Tool', 'RequestConfig', 'RolloutInferRequest', 'Function', 'ChatCompletionMessageToolCall',
    'ChatMessage', 'UsageInfo', 'ChatCompletionResponseChoice', 'ChatCompletionResponse', 'RolloutOutput',
    'extract_logprobs', 'generated_tokens', 'make_choice', 'make_response'
]


def _random_uuid() -> str:
    return _uuid.uuid4().hex


class _Model(BaseModel):
    # validate_assignment stays off: the executor assigns fields on hot paths.
    model_config = ConfigDict(from_attributes=True, arbitrary_types_allowed=True, extra='allow')


class RequestConfig(_Model):
    """Sampling parameters for one ``rollout_fn`` call (ms-swift's ``RequestConfig``)."""
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    num_beams: int = 1
    stop: Optional[List[str]] = Field(default_factory=list)
    seed: Optional[int] = None
    stream: bool = False
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    n: int = 1
    best_of: Optional[int] = None
    presence_penalty: float = 0.
    frequency_penalty: float = 0.
    length_penalty: float = 1.
    return_details: bool = False
    structured_outputs_regex: Optional[str] = None

    @field_validator('stop', mode='after')
    @classmethod
    def _stop_none_is_empty(cls, v: Optional[List[str]]) -> List[str]:
        return [] if v is None else v


class RolloutInferRequest(_Model):
    """One conversation to roll out (ms-swift's ``RolloutInferRequest``).

    ``messages`` is a list of ``{'role', 'content'}`` dicts and is mutated in place by the
    executor, exactly as ms-swift's loop does. ``token_record`` is mtflow's own: the backend's
    exact-id history of this request (see ``mtflow.accounting.token_record``).
    """
    messages: Messages
    images: List[Any] = Field(default_factory=list)
    audios: List[str] = Field(default_factory=list)
    videos: List[str] = Field(default_factory=list)
    tools: Optional[List[Tool]] = None
    objects: Dict[str, Any] = Field(default_factory=dict)
    chat_template_kwargs: Dict[str, Any] = Field(default_factory=dict)
    data_dict: Dict[str, Any] = Field(default_factory=dict)
    uuid: Optional[str] = None
    #: the exact token ids of the turns so far (:class:`mtflow.accounting.token_record.TokenRecord`), kept
    #: by backends that generate from ids; never dumped, copied with the request
    token_record: Optional[Any] = Field(default=None, exclude=True, repr=False)

    @field_validator('images', 'audios', 'videos', mode='before')
    @classmethod
    def _single_to_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class Function(_Model):
    name: str
    arguments: Optional[Union[str, Any]] = None


class ChatCompletionMessageToolCall(_Model):
    function: Function
    type: str = 'function'
    id: str = Field(default_factory=lambda: f'toolcall-{_random_uuid()}')


class ChatMessage(_Model):
    role: str = 'assistant'
    content: Any = None
    tool_calls: Optional[List[ChatCompletionMessageToolCall]] = None
    reasoning_content: Optional[str] = None


class UsageInfo(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChatCompletionResponseChoice(_Model):
    """One sampled completion: text, finish reason, and optionally token ids and logprobs.

    ``logprobs`` follows the OpenAI shape ``{'content': [{'token', 'logprob', ...}, ...]}``.
    """
    index: int = 0
    message: ChatMessage
    finish_reason: Literal['stop', 'length', None] = None
    logprobs: Optional[Dict[str, Any]] = None
    token_ids: Optional[List[int]] = None


class ChatCompletionResponse(_Model):
    model: str = ''
    choices: List[ChatCompletionResponseChoice]
    usage: Optional[UsageInfo] = None
    id: str = Field(default_factory=lambda: f'chatcmpl-{_random_uuid()}')
    object: str = 'chat.completion'
    created: int = Field(default_factory=lambda: int(time.time()))
    prompt_token_ids: Optional[List[int]] = None
    prompt_logprobs: Optional[List[Any]] = None


class RolloutOutput(_Model):
    """A finished trajectory (ms-swift's ``RolloutOutput``): the last response, the full messages
    and the per-turn token segments, loss masks and logprobs."""
    response: Optional[ChatCompletionResponse] = None
    messages: Optional[Messages] = None
    response_token_ids: List[List[int]] = Field(default_factory=list)
    response_loss_mask: List[List[int]] = Field(default_factory=list)
    rollout_infos: Dict[str, Any] = Field(default_factory=dict)
    rollout_logprobs: List[List[float]] = Field(default_factory=list)
    prompt_logprobs: Optional[List[Any]] = None

    @field_validator('response_token_ids', 'response_loss_mask', 'rollout_logprobs', mode='before')
    @classmethod
    def _wrap_flat_list(cls, v: Any) -> Any:
        # ms-swift accepts one flat segment and wraps it; so do we.
        if isinstance(v, list) and v and isinstance(v[0], (int, float)):
            return [v]
        return v


def extract_logprobs(choice: Any) -> List[float]:
    """The per-token logprob values of a choice, ``[]`` when it carries none (contract rule)."""
    logprobs = choice.logprobs
    if logprobs is None:
        return []
    content = logprobs.get('content') if isinstance(logprobs, dict) else None
    if content is None:
        return []
    return [item['logprob'] for item in content]


def generated_tokens(response: Any, choice: Any) -> int:
    """How many tokens the model generated for ``choice``: its ids when it carries them, else the
    response's ``usage.completion_tokens`` (a server in chat mode returns text and usage, no ids),
    else 0. The one count behind the trace's ``tokens``, the summary and a context budget."""
    ids = getattr(choice, 'token_ids', None)
    if ids:
        return len(ids)
    tokens = getattr(getattr(response, 'usage', None), 'completion_tokens', None)
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else 0


def make_choice(content: str,
                token_ids: Optional[List[int]] = None,
                logprobs: Optional[List[float]] = None,
                finish_reason: Optional[str] = 'stop',
                tokens: Optional[List[str]] = None) -> ChatCompletionResponseChoice:
    """Build a choice from plain values: the shape every backend returns."""
    lp = None
    if logprobs is not None:
        toks = tokens if tokens is not None else [''] * len(logprobs)
        lp = {'content': [{'token': t, 'logprob': float(v)} for t, v in zip(toks, logprobs)]}
    return ChatCompletionResponseChoice(
        index=0,
        message=ChatMessage(role='assistant', content=content),
        finish_reason=finish_reason,
        logprobs=lp,
        token_ids=None if token_ids is None else list(token_ids))


def make_response(choice: ChatCompletionResponseChoice,
                  model: str = 'mtflow',
                  prompt_tokens: int = 0) -> ChatCompletionResponse:
    completion_tokens = len(choice.token_ids or ())
    return ChatCompletionResponse(
        model=model,
        choices=[choice],
        usage=UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens))


class OutputBuilder:
    """Builds outputs of one pydantic output class from values the executor has already checked,
    without running pydantic's validation again (validating every token id, mask value and
    message of every output costs more than the rest of the driver).

    It builds exactly what ``cls(**fields)`` builds for such values: the same field values,
    the messages copied one level (as validation copies them), ``fields_set`` as given. Anything
    it cannot vouch for (another kind of class, validators it does not know, a response of
    another type, unusual messages or infos) makes :meth:`build` return ``None``: the caller
    then validates as usual."""

    #: field validators known to be no-ops for checked values (ms-swift's and mtflow's wrap a flat list)
    KNOWN_VALIDATORS = frozenset(('_wrap_flat_list', ))
    FIELDS = ('response', 'messages', 'response_token_ids', 'response_loss_mask', 'rollout_infos', 'rollout_logprobs')

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.ok = False
        fields = getattr(cls, '__pydantic_fields__', None)
        decorators = getattr(cls, '__pydantic_decorators__', None)
        if not fields or decorators is None or getattr(cls, '__pydantic_root_model__', True):
            return
        if decorators.model_validators or decorators.root_validators or set(
                decorators.field_validators) - self.KNOWN_VALIDATORS:
            return
        self.post_init = bool(getattr(cls, '__pydantic_post_init__', None))  # run, as validation runs it
        if any(f.alias is not None or f.validation_alias is not None for f in fields.values()):
            return
        if not set(self.FIELDS) <= set(fields):
            return
        response = fields['response'].annotation
        args = [a for a in getattr(response, '__args__', ()) if a is not type(None)]
        self.response_cls = args[0] if len(args) == 1 else response
        if self.response_cls is Any:
            self.response_cls = object
        self.response_required = fields['response'].is_required()
        if not isinstance(self.response_cls, type) or getattr(self.response_cls, '__origin__', None) is not None:
            return
        try:
            isinstance(None, self.response_cls)
        except TypeError:
            return
        others = [(name, f) for name, f in fields.items() if name not in self.FIELDS]
        if any(f.is_required() for _, f in others):
            return
        # defaults: immutable ones once, factories per output
        self.constants = {n: f.default for n, f in others
                          if f.default_factory is None and isinstance(f.default, (type(None), str, int, float, bool, tuple))}
        self.factories = [(n, f) for n, f in others if n not in self.constants]
        self.extra = {} if cls.model_config.get('extra') == 'allow' else None
        self.ok = True

    def build(self, fields: Dict[str, Any]) -> Optional[Any]:
        if not self.ok:
            return None
        response = fields['response']
        if response is None:
            if self.response_required:
                return None
        elif not isinstance(response, self.response_cls):
            return None
        messages = fields['messages']
        if messages is not None:
            if messages.__class__ is not list:
                return None
            copied = []
            for m in messages:
                if m.__class__ is not dict:
                    return None
                copied.append(m.copy())
            messages = copied
        infos = fields['rollout_infos']
        if infos.__class__ is not dict or not all(k.__class__ is str for k in infos):
            return None
        values = dict(fields)
        values['messages'] = messages
        values.update(self.constants)
        for name, f in self.factories:
            values[name] = f.get_default(call_default_factory=True)
        obj = self.cls.__new__(self.cls)
        object.__setattr__(obj, '__dict__', values)
        object.__setattr__(obj, '__pydantic_fields_set__', set(fields))
        object.__setattr__(obj, '__pydantic_extra__', None if self.extra is None else {})
        object.__setattr__(obj, '__pydantic_private__', None)
        if self.post_init:
            obj.model_post_init(None)
        return obj
