"""What every backend shares: the ``rollout_fn`` shape, request preparation, sampling options.

A backend is a callable ``backend(requests, request_config) -> outputs`` (the executor's
``rollout_fn``) with one output per request, in order. Each output's ``response.choices[0]``
carries the completion text, ``token_ids`` of the sampled tokens, per-token ``logprobs``
(``{'content': [{'token', 'logprob'}, ...]}`` when the request config asks for them) and a
``finish_reason`` of ``'stop'`` or ``'length'``.

Every backend turns a request into a chat the same way (:func:`prepare_chat`), so that a
scheduler behaves alike on all of them:

* a trailing assistant message whose content is ``None`` is a placeholder and is dropped (the
  executor drops it too when it applies the output);
* if the last message is then an assistant message, the turn is a *continuation*: the model
  continues that message (no new generation prompt; transformers' and vLLM's
  ``continue_final_message``);
* the request's ``tools`` and ``chat_template_kwargs`` go to the chat template.

Sampling parameters come from :class:`mtflow.RequestConfig` through :func:`sampling_options`,
which checks them once and names the field that is wrong.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from mtflow.backends.batcher import DynamicBatcher
from mtflow.backends.text_sinks import TextSinks
from mtflow.core.errors import MtflowError
from mtflow.core.protocol import RequestConfig, RolloutOutput, make_choice, make_response
from mtflow.core.seeds import sampling_seed

__all__ = [
    'context_length_of', 'BackendError', 'Backend', 'BackendStats', 'Chat', 'SamplingOptions', 'prepare_chat', 'sampling_options',
    'build_output', 'sampling_seeds', 'PreflightProblem', 'SamplingError', 'Reports', 'reports_of', 'flag_option'
]


class BackendError(MtflowError):
    """A backend cannot be built or cannot serve a call (bad option, model that cannot load,
    server that keeps failing). The message names the backend and what to fix."""


def flag_option(value: Any, where: str) -> bool:
    """A backend's true/false option, refused in one line naming it when it is anything else (YAML's
    ``"false"``, quoted, is a string that ``bool()`` would read as true)."""
    if not isinstance(value, bool):
        raise BackendError(f'{where} must be true or false, not {type(value).__name__} {value!r:.40}')
    return value


def context_length_of(config: Any, *names: str) -> Optional[int]:
    """The first of ``names`` on ``config`` (a model config, an engine's ``model_config``) that
    is a positive int: the context length a backend reports (``None`` when it has none)."""
    for name in names:
        value = getattr(config, name, None) if config is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclass
class Chat:
    """One request, ready for a chat template."""
    messages: List[Dict[str, Any]]
    continuation: bool
    tools: Optional[List[Dict[str, Any]]] = None
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)


def _as_dict(message: Any) -> Dict[str, Any]:
    if isinstance(message, dict):
        return dict(message)
    dump = getattr(message, 'model_dump', None)
    if dump is not None:  # a pydantic ChatMessage
        return {k: v for k, v in dump().items() if v is not None or k == 'content'}
    return {'role': getattr(message, 'role'), 'content': getattr(message, 'content', None)}


def prepare_chat(request: Any) -> Chat:
    """The messages to render for ``request`` (copied: the request is never modified), and
    whether the model must continue the last assistant message."""
    messages = [_as_dict(m) for m in request.messages]
    if messages and messages[-1].get('role') == 'assistant' and messages[-1].get('content') is None:
        messages.pop()
    continuation = bool(messages) and messages[-1].get('role') == 'assistant'
    if not messages:
        raise BackendError(f'request {getattr(request, "uuid", None)!r} has no messages')
    tools = getattr(request, 'tools', None) or None
    kwargs = dict(getattr(request, 'chat_template_kwargs', None) or {})
    return Chat(messages, continuation, tools, kwargs)


@dataclass(frozen=True)
class SamplingOptions:
    """:class:`RequestConfig` reduced to what a backend needs, with defaults applied.

    ``temperature == 0`` means greedy decoding. ``top_k`` of ``None``, ``0`` or ``-1`` and
    ``top_p`` of ``None`` or ``1`` mean no truncation. ``max_tokens`` of ``None`` takes the
    backend's default."""
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: Sequence[str] = ()
    seed: Optional[int] = None
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class SamplingError(BackendError):
    """A sampling value outside what the engines take; ``field`` is its ``request_config`` key
    (``temperature``) and ``why`` the rest (``must be >= 0 (got -1.0)``), so that a run config
    names the key's own line."""

    def __init__(self, field: str, why: str) -> None:
        self.field, self.why = field, why
        super().__init__(f'request_config.{field} {why}')


def sampling_options(request_config: Any, default_max_tokens: int) -> SamplingOptions:
    """Check ``request_config`` (a :class:`RequestConfig`, an ms-swift one, a dict or ``None``)
    and return the options every backend reads. Raises :class:`SamplingError` naming the field:
    the one rule for sampling values (``mtflow run`` checks a run config's with it before the
    backend loads)."""
    if request_config is None:
        request_config = RequestConfig()
    elif isinstance(request_config, dict):
        request_config = RequestConfig(**request_config)

    def get(name: str, default: Any = None) -> Any:
        value = getattr(request_config, name, default)
        return default if value is None else value

    def number(name: str, default: float, ok: Any, bound: str) -> float:
        value = float(get(name, default))
        if not ok(value):
            raise SamplingError(name, f'must be {bound} (got {value})')
        return value

    n = get('n', 1)
    if n != 1:
        raise SamplingError('n', f'must be 1 for multi-turn rollouts (got {n}); repeat the request in the dataset '
                            '(num_generations) for several samples')
    if get('num_beams', 1) not in (1, None):
        raise SamplingError('num_beams', f'must be 1 (got {get("num_beams")}): beam search is not sampling')
    max_tokens = get('max_tokens', default_max_tokens)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise SamplingError('max_tokens', f'must be a positive int (got {max_tokens!r})')
    temperature = number('temperature', 1.0, lambda v: v >= 0, '>= 0')
    top_p = number('top_p', 1.0, lambda v: 0 < v <= 1, 'in (0, 1]')
    top_k = int(get('top_k', 0))
    if top_k < -1:
        raise SamplingError('top_k', f'must be >= -1 (-1 and 0: off; got {top_k})')
    top_k = 0 if top_k < 0 else top_k
    stop = get('stop', []) or []
    if isinstance(stop, str):
        stop = [stop]
    if any(not isinstance(s, str) or not s for s in stop):
        raise SamplingError('stop', f'must be a list of non-empty strings (got {stop!r}): an empty one stops every '
                            'generation at once')
    top_logprobs = int(get('top_logprobs', 0) or 0)
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=number('min_p', 0.0, lambda v: 0 <= v <= 1, 'in [0, 1]'),
        repetition_penalty=number('repetition_penalty', 1.0, lambda v: v > 0, '> 0'),
        presence_penalty=number('presence_penalty', 0.0, lambda v: -2 <= v <= 2, 'in [-2, 2]'),
        frequency_penalty=number('frequency_penalty', 0.0, lambda v: -2 <= v <= 2, 'in [-2, 2]'),
        stop=tuple(stop),
        seed=get('seed', None),
        logprobs=bool(get('logprobs', False)) or top_logprobs > 0,
        top_logprobs=top_logprobs)


@dataclass
class BackendStats:
    """Counters a backend keeps across calls (the ``mtflow run`` summary reads them)."""
    calls: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    generate_s: float = 0.0

    def add(self, requests: int, prompt_tokens: int, completion_tokens: int, seconds: float) -> None:
        self.calls += 1
        self.requests += requests
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.generate_s += seconds


def sampling_seeds(requests: Sequence[Any], options: SamplingOptions, default: Optional[int] = None) -> List[Optional[int]]:
    """Each request's sampling seed for this call: from the request config's ``seed``, else
    ``default`` (the backend's own ``seed``), and the request itself
    (:func:`mtflow.core.seeds.sampling_seed`), never its place in the call: the same request
    samples the same tokens in a batch of 1 or 16, in lockstep or async. ``None`` each when
    neither seed is set."""
    base = options.seed if options.seed is not None else default
    return [sampling_seed(base, r, i) for i, r in enumerate(requests)]


def build_output(text: str,
                 token_ids: Optional[List[int]],
                 finish_reason: Optional[str],
                 *,
                 logprobs: Optional[List[float]] = None,
                 tokens: Optional[List[str]] = None,
                 top_logprobs: Optional[List[List[Dict[str, Any]]]] = None,
                 model: str = 'mtflow',
                 prompt_tokens: int = 0,
                 prompt_token_ids: Optional[List[int]] = None) -> RolloutOutput:
    """One rollout output in the shape the executor reads (``output.response.choices[0]``)."""
    choice = make_choice(text, token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason, tokens=tokens)
    if top_logprobs is not None and choice.logprobs is not None:
        for item, top in zip(choice.logprobs['content'], top_logprobs):
            item['top_logprobs'] = top
    response = make_response(choice, model=model, prompt_tokens=prompt_tokens)
    if prompt_token_ids is not None:
        response.prompt_token_ids = prompt_token_ids
    return RolloutOutput(response=response)


@dataclass(frozen=True)
class PreflightProblem:
    """One finding of :meth:`Backend.preflight`. ``unreachable``: a server that does not answer
    now: ``mtflow run`` stops on it, ``mtflow validate`` warns (the server may be started later)."""
    message: str
    unreachable: bool = False
    #: the run config's key it is about (``backend_options.respond``, ``model``); None: the backend's
    key: Optional[str] = None


class Reports:
    """What a backend may tell a run besides its outputs, declared once, each with a default that
    reports nothing. :class:`Backend` has them; the run directory reads them through
    :func:`reports_of` (never by looking an attribute up), so a plain callable given as a backend
    reports nothing and a backend that reports something overrides the method that says it."""
    #: counters across calls (``summary.json``'s generation figures; ``None``: not counted)
    stats: Optional['BackendStats'] = None
    #: how the engine was loaded: ``device``, ``dtype``, ``block_size`` and why (``summary.json``'s
    #: ``engine``); a backend that loads one sets its own dict
    load_info: Dict[str, Any] = {}
    #: schedulers that count tokens read it; ``None`` when the backend has none (a class
    #: attribute, so that a backend may make it a property of its engine)
    tokenizer: Any = None
    #: what renders the prompts here (a :class:`~mtflow.backends.tokens.TokenPrompter`: its
    #: tokenizer and chat template, checked before the first turn); ``None`` when a server renders
    prompter: Any = None
    #: the model's context in tokens (``max_position_embeddings``, ``max_model_len``); ``None``: unknown
    context_length: Optional[int] = None
    #: where a server renders each prompt itself (chat completions): its template and tokenizer asked
    #: through the server (:class:`~mtflow.backends.server_template.ServerTemplate`), for the checks
    #: before the first turn; ``None``: mtflow renders (``prompter``), or the server cannot be asked
    chat_renderer: Any = None

    def describe(self) -> Optional[str]:
        """One line naming the backend and its model (the summary's ``backend``); ``None``: the
        run names it by its config."""
        return None

    def prefix_cache_summary(self) -> Optional[Dict[str, Any]]:
        """A colocated engine's prefix-cache figures (``mtflow.run.engine_figures``)."""
        return None

    def serving(self, uuid: str) -> Optional[List[Dict[str, Any]]]:
        """The serving log of request ``uuid``, one entry per turn (which server, its cached
        prompt tokens, moves off a failing one): merged into the request's trace
        (``mtflow.run.serving``)."""
        return None

    def serving_summary(self) -> Optional[Dict[str, Any]]:
        """The router's figures over several servers (``summary.json``'s ``serving``)."""
        return None

    def begin_server_metrics(self) -> None:
        """Read the servers' own counters when a run starts (their growth goes in the summary)."""

    def end_server_metrics(self) -> None:
        """Read them again when it ends (before the backend closes)."""

    def forget(self, uuid: str) -> None:
        """Request ``uuid`` is final: drop whatever is kept for it (a replayed run's records)."""

    def known_digest(self, request: Any) -> Optional[str]:
        """The prompt digest this backend already computed for ``request`` in the call just made,
        or ``None`` (the run computes it then)."""
        return None

    def close(self) -> None:
        """Release what the backend holds (connections, engines). Safe to call twice."""


#: every name :class:`Reports` declares
REPORTED = frozenset(name for name in vars(Reports) if not name.startswith('_'))


class _Plain(Reports):
    """The reports of a ``rollout_fn`` that does not subclass :class:`Reports` (a function, a
    user's own class): what it has under a declared name, else the default. The one place a
    backend's optional attributes are looked up by name."""

    def __init__(self, fn: Any) -> None:
        object.__setattr__(self, '_fn', fn)

    def __getattribute__(self, name: str) -> Any:
        if name in REPORTED:
            own = getattr(object.__getattribute__(self, '_fn'), name, None)
            if own is not None:
                return own
        return object.__getattribute__(self, name)


def reports_of(backend: Any) -> Reports:
    """``backend``'s reports: itself when it declares them (a :class:`Backend`), else what it
    has of them under their names (:class:`_Plain`)."""
    return backend if isinstance(backend, Reports) else _Plain(backend)


class Backend(Reports):
    """Base class of mtflow's backends: a ``rollout_fn`` with a name, a model name, an optional
    tokenizer (schedulers that count tokens use it) and counters.

    Subclasses implement :meth:`generate`; :meth:`__call__` adds the bookkeeping every backend
    needs (an empty call returns ``[]`` at once: idle ranks call ``rollout_fn([])``)."""
    name = 'backend'
    #: whether :attr:`text_sinks` get each request's text as it is generated (:mod:`.text_sinks`)
    streams_text = False

    def __init__(self) -> None:
        self.stats = BackendStats()
        self.model_name = self.name
        #: who listens to a request's text as it grows (the gateway's streaming calls)
        self.text_sinks = TextSinks()

    def generate(self, requests: List[Any], options: SamplingOptions) -> List[RolloutOutput]:  # pragma: no cover
        raise NotImplementedError

    @classmethod
    def preflight(cls, model: Optional[str], options: Dict[str, Any]) -> List['PreflightProblem']:
        """What is wrong with building this backend from ``model`` and ``options`` that can be
        found cheaply before it is built (``mtflow validate``, the start of ``mtflow run``): a
        server that does not answer, a model it does not serve. The default finds nothing (an
        engine's problems show when it loads)."""
        return []

    #: used when the request config has no ``max_tokens``
    default_max_tokens = 256

    def keep_special_tokens(self) -> Optional[str]:
        """Return replies with their special tokens in the text from now on (a parser reads markers
        that are special tokens of the model's tokenizer: gpt-oss's harmony, Kimi-K2's sections);
        ``None`` when done (or when this backend's text keeps them anyway), else why it cannot, for
        the one-line refusal of the run (``mtflow.backends.pairing``)."""
        return (f'the {self.name} backend cannot return replies with their special tokens (it has no '
                'skip_special_tokens option)')

    def __call__(self, requests: List[Any], request_config: Any = None) -> List[RolloutOutput]:
        if not requests:
            return []
        options = sampling_options(request_config, self.default_max_tokens)
        t0 = time.perf_counter()
        outputs = self.generate(list(requests), options)
        seconds = time.perf_counter() - t0
        self._record(outputs, seconds)
        return outputs

    def _record(self, outputs: List[Any], seconds: float) -> None:
        prompt = completion = served = 0
        for out in outputs:
            if isinstance(out, BaseException):  # a request the backend could not serve (it fails alone)
                continue
            served += 1
            usage = out.response.usage if out.response is not None else None
            if usage is not None:
                prompt += usage.prompt_tokens
                completion += usage.completion_tokens
        self.stats.add(served, prompt, completion, seconds)

    # ---- async mode -------------------------------------------------------------------------------
    #: whether :meth:`agenerate` serves requests concurrently on its own (servers, async engines);
    #: the others are batch engines and get a :class:`~mtflow.backends.batcher.DynamicBatcher`
    native_async = False

    async def agenerate(self, requests: List[Any], options: SamplingOptions) -> List[RolloutOutput]:
        """Native async generation, awaitable from any event loop (``native_async`` backends)."""
        raise NotImplementedError(f'{type(self).__name__} has no native async path; use async_rollout_fn()')

    async def acall(self, requests: List[Any], request_config: Any = None) -> List[RolloutOutput]:
        """``await backend.acall(requests, config)``: :meth:`__call__` for ``native_async``
        backends, with the same checks and counters (``stats.generate_s`` then sums overlapping
        calls)."""
        if not requests:
            return []
        options = sampling_options(request_config, self.default_max_tokens)
        t0 = time.perf_counter()
        outputs = await self.agenerate(list(requests), options)
        self._record(outputs, time.perf_counter() - t0)
        return outputs

    def async_rollout_fn(self, *, max_batch_size: Optional[int] = None, max_wait_s: float = 0.005,
                         settle_s: float = 0.05, max_delay_s: float = 1.0,
                         settle_fraction: Optional[float] = None) -> Any:
        """The ``rollout_fn`` for ``Executor(..., mode='async')``: :meth:`acall` when the backend
        serves single requests concurrently itself, else a dynamic batcher that groups the
        concurrent single-request calls into batch calls of this backend (``max_batch_size``:
        default the backend's own, else 16; ``settle_s``, ``max_delay_s``: how it waits for the
        last batch's requests to come back, see :class:`DynamicBatcher`; ``settle_fraction``: that
        wait at most this fraction of the last batch's time). Close a batcher when done (it is a
        context manager)."""
        if self.native_async:
            return self.acall
        size = max_batch_size or getattr(self, 'max_batch_size', None) or 16
        return DynamicBatcher(self, max_batch_size=size, max_wait_s=max_wait_s, settle_s=settle_s,
                              max_delay_s=max_delay_s, settle_fraction=settle_fraction)

    def __enter__(self) -> 'Backend':
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def describe(self) -> str:
        return f'{self.name} ({self.model_name})'
