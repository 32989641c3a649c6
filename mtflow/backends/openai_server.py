"""OpenAI-compatible server backend: ``/v1/chat/completions`` on ``vllm serve``, ``swift deploy``,
sglang, or any server that speaks the protocol.

One ``rollout_fn`` call sends one HTTP request per live request, concurrently (asyncio + httpx),
at most ``max_connections`` at a time, each with a timeout, and retries a request on connection
errors, timeouts, 429 and 5xx with exponential backoff (``Retry-After`` honoured), up to
``max_retries`` times; a request that still fails fails the call with an error that names the
request uuid, the status and the server's message. Other 4xx answers are not retried.

The HTTP client runs on a private event loop in a background thread, so the backend is a plain
synchronous ``rollout_fn`` that works from any thread (the executor's driver, a trainer, a
notebook with its own running loop). For ``Executor(..., mode='async')``,
``backend.async_rollout_fn()`` is ``backend.acall``: each single-request call is awaited from the
driver's loop while its HTTP request runs on the private loop, so a reply arrives in its
request's state machine the moment the server sends it.

What is sent depends on ``flavor`` (what the server understands beyond OpenAI's fields):

=========  ==================================================================================
flavor     extras
=========  ==================================================================================
vllm       ``top_k``, ``min_p``, ``repetition_penalty``, ``chat_template_kwargs``,
           ``return_token_ids`` (token ids of the completion, vLLM >= 0.10.2), and on a
           continuation ``continue_final_message: true, add_generation_prompt: false``
sglang     as vllm, without ``return_token_ids``
swift      ``top_k``, ``repetition_penalty``, ``return_details`` (ms-swift's deploy returns the
           token ids then); a trailing assistant message is continued by ms-swift's template
openai     nothing: OpenAI's own API rejects unknown fields; continuation turns are an error
=========  ==================================================================================

Token ids come from ``choices[0].token_ids`` when the server returns them, else from logprob
tokens written as ``token_id:<n>`` (``vllm serve --return-tokens-as-token-ids``), else ``None``.
Logprobs are passed through in OpenAI's shape. ``extra_body`` is merged into every request.

**Exact ids** (``prompt_mode``). Through ``/v1/chat/completions`` the server renders and
tokenizes the whole conversation again every turn, so the model is not guaranteed the ids it
sampled. ``prompt_mode='tokens'`` (the default for flavor ``vllm`` when a ``tokenizer`` is given)
builds each prompt locally as the HF and vLLM backends do (:mod:`mtflow.backends.tokens`: the
previous prompt + the sampled ids + the template's delta) and sends it as a token prompt to
``/v1/completions`` (``"prompt": [ids]``, which vLLM's server accepts), with
``return_token_ids``; ``response.prompt_token_ids`` is the prompt sent. ``prompt_mode='chat'``,
or ``'auto'`` without a tokenizer or with another flavor, uses chat completions and warns once
that exact ids cannot be guaranteed.

**Resumable** (``resumable=True``): single-request async calls are streamed (SSE) so that a
stream's ``on_update='resume'`` can cut them at a weight update and continue each from its
exact ids (:mod:`mtflow.backends.openai_stream`). A request a gateway's streaming call listens to
(:mod:`mtflow.backends.text_sinks`) is streamed the same way, its text handed on as it comes.

**Sessions** (``session_header``, default ``X-Session-ID``): every HTTP request names its
request's session (the request's uuid), so that mtflow can be the client of a gateway that
records sessions (``mtflow gateway``, verifiers' interception server) or sit behind a sticky
router, and two mtflow processes never share one session.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import warnings
from typing import Any, Dict, List, Optional, Tuple

from mtflow.backends.base import (Backend, BackendError, PreflightProblem, SamplingOptions, sampling_seeds,
                                  flag_option, prepare_chat)
from mtflow.backends.chat_templates import resolve_chat_template
from mtflow.backends.http_client import (RETRY_STATUS, TimedOut, Unreachable, choose_client, error_message, make_client,
                                         retry_after)
from mtflow.backends.openai_stream import (StreamedReply, completion_items, message_tool_calls, server_reasoning,
                                           stream_body, streamed_acall, token_ids_from_logprobs)
from mtflow.backends.images import aserving_the_others, image_refusal, openai_messages
from mtflow.backends.loop_thread import LoopThread
from mtflow.backends.routing import Router, cached_tokens_of, watch_health
from mtflow.backends.server_check import options_problems
from mtflow.backends.server_template import CHAT_MODE_STRIPS, ServerFacts
from mtflow.backends.server_metrics import ServerMetrics
from mtflow.backends.tokens import TokenPrompter, commit_outputs
from mtflow.core.protocol import (ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage, RolloutOutput, UsageInfo)

__all__ = ['OpenAIBackend', 'build_body', 'build_completion_body', 'parse_choice', 'parse_completion', 'FLAVORS']

FLAVORS = ('vllm', 'sglang', 'swift', 'openai')
#: the server asked when neither base_url, urls nor MTFLOW_OPENAI_BASE_URL says
DEFAULT_BASE_URL = 'http://127.0.0.1:8000/v1'
#: the header that names each request's session (``session_header``); verifiers' and mtflow's gateways read it
SESSION_HEADER = 'X-Session-ID'


def build_body(request: Any, options: SamplingOptions, model: str, flavor: str = 'vllm',
               extra_body: Optional[Dict[str, Any]] = None, seed: Optional[int] = None) -> Dict[str, Any]:
    """The JSON body of ``/v1/chat/completions`` for one request; ``seed``: its own sampling
    seed (the backend sends :func:`~mtflow.backends.base.sampling_seeds`': with one seed for all,
    a server samples every copy of a repeated prompt identically), default the request config's."""
    chat = prepare_chat(request)
    body = _sampling_body(model, options, seed, messages=openai_messages(request, chat.messages))
    if options.logprobs:
        body['logprobs'] = True
        if options.top_logprobs:
            body['top_logprobs'] = options.top_logprobs
    if chat.tools:
        body['tools'] = chat.tools
    if flavor in ('vllm', 'sglang', 'swift'):
        if options.top_k:
            body['top_k'] = options.top_k
        if options.repetition_penalty != 1.0:
            body['repetition_penalty'] = options.repetition_penalty
    if flavor in ('vllm', 'sglang'):
        if options.min_p:
            body['min_p'] = options.min_p
        if chat.chat_template_kwargs:
            body['chat_template_kwargs'] = chat.chat_template_kwargs
        if chat.continuation:
            body['continue_final_message'] = True
            body['add_generation_prompt'] = False
    if flavor == 'vllm':
        body['return_token_ids'] = True
    elif flavor == 'swift':
        body['return_details'] = True
    elif flavor == 'openai' and chat.continuation:
        raise BackendError(f'request {getattr(request, "uuid", None)!r}: continuing an assistant message needs a '
                           "server with continue_final_message (flavor 'vllm' or 'sglang'), not flavor 'openai'")
    if extra_body:
        body.update(extra_body)
    return body


def _sampling_body(model: str, options: SamplingOptions, seed: Optional[int], **prompt: Any) -> Dict[str, Any]:
    """The fields both endpoints share: the prompt (``messages`` or ``prompt``) and the OpenAI
    sampling options; ``seed``, else the request config's."""
    body: Dict[str, Any] = {
        'model': model,
        **prompt,
        'max_tokens': options.max_tokens,
        'temperature': options.temperature,
        'top_p': options.top_p,
        'n': 1,
        'stream': False,
    }
    if options.stop:
        body['stop'] = list(options.stop)
    seed = options.seed if seed is None else seed
    if seed is not None:
        body['seed'] = seed
    if options.presence_penalty:
        body['presence_penalty'] = options.presence_penalty
    if options.frequency_penalty:
        body['frequency_penalty'] = options.frequency_penalty
    return body


def build_completion_body(prompt_ids: List[int], options: SamplingOptions, model: str, flavor: str = 'vllm',
                          extra_body: Optional[Dict[str, Any]] = None, seed: Optional[int] = None,
                          skip_special_tokens: bool = True) -> Dict[str, Any]:
    """The JSON body of ``/v1/completions`` with a token prompt (token mode); ``seed`` as
    :func:`build_body`'s; ``skip_special_tokens=False``: the reply's text keeps them (vLLM's field)."""
    body = _sampling_body(model, options, seed, prompt=list(prompt_ids))
    if not skip_special_tokens:
        body['skip_special_tokens'] = False
    if options.logprobs:
        body['logprobs'] = options.top_logprobs or 0  # completions API: the number of alternatives
    if options.top_k:
        body['top_k'] = options.top_k
    if options.repetition_penalty != 1.0:
        body['repetition_penalty'] = options.repetition_penalty
    if options.min_p:
        body['min_p'] = options.min_p
    body['return_token_ids'] = True
    if extra_body:
        body.update(extra_body)
    return body


def parse_completion(data: Dict[str, Any], prompt_ids: List[int], where: str) -> RolloutOutput:
    """A server's text completion for a token prompt (JSON) as a rollout output, checked: the
    server must return the sampled ids and, if it reports the prompt ids, the ones sent."""
    choices = data.get('choices') if isinstance(data, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise BackendError(f'{where}: the server answered without choices: {json.dumps(data)[:200]}')
    raw = choices[0]
    reason = raw.get('finish_reason')
    if reason not in ('stop', 'length', None):
        reason = 'stop'
    content = completion_items(raw.get('logprobs'))
    logprobs = {'content': content} if content is not None else None
    token_ids = raw.get('token_ids')
    if token_ids is None:
        token_ids = token_ids_from_logprobs(logprobs)
    if token_ids is None:
        raise BackendError(f'{where}: the server returned no token ids for a token prompt; token mode needs '
                           "vLLM >= 0.10.2 (return_token_ids) or --return-tokens-as-token-ids; else prompt_mode='chat'")
    served_prompt = raw.get('prompt_token_ids', data.get('prompt_token_ids'))
    if served_prompt is not None and list(served_prompt) != list(prompt_ids):
        raise BackendError(f'{where}: the server generated from {len(served_prompt)} prompt ids that are not the '
                           f'{len(prompt_ids)} ids sent')
    choice = ChatCompletionResponseChoice(
        index=0,
        message=ChatMessage(role='assistant', content=raw.get('text') or ''),
        finish_reason=reason,
        logprobs=logprobs,
        token_ids=[int(t) for t in token_ids])
    usage = data.get('usage') or {}
    completion = int(usage.get('completion_tokens') or len(token_ids))
    response = ChatCompletionResponse(
        model=str(data.get('model') or ''),
        choices=[choice],
        usage=UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=completion,
                        total_tokens=len(prompt_ids) + completion),
        prompt_token_ids=list(prompt_ids))
    if data.get('id'):
        response.id = str(data['id'])
    return RolloutOutput(response=response)


def parse_choice(data: Dict[str, Any], where: str) -> RolloutOutput:
    """A server's chat completion (JSON) as a rollout output; ``where`` names the request in errors."""
    choices = data.get('choices') if isinstance(data, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise BackendError(f'{where}: the server answered without choices: {json.dumps(data)[:200]}')
    raw = choices[0]
    message = raw.get('message') or {}
    content = message.get('content')
    if content is None:
        content = ''
    reason = raw.get('finish_reason')
    if reason not in ('stop', 'length', None):
        reason = 'stop'  # 'tool_calls', 'eos', 'abort', ...: the model stopped by itself
    logprobs = raw.get('logprobs')
    if logprobs is not None and not isinstance(logprobs, dict):
        logprobs = None
    token_ids = raw.get('token_ids')
    if token_ids is None:
        token_ids = token_ids_from_logprobs(logprobs)
    choice = ChatCompletionResponseChoice(
        index=0,
        message=ChatMessage(role='assistant', content=content, tool_calls=message_tool_calls(message.get('tool_calls')),
                            reasoning_content=server_reasoning(message)),
        finish_reason=reason,
        logprobs=logprobs,
        token_ids=list(token_ids) if token_ids is not None else None)
    usage = data.get('usage') or {}
    completion = usage.get('completion_tokens')
    if completion is None:
        completion = len(token_ids or ())
    prompt = int(usage.get('prompt_tokens') or 0)
    response = ChatCompletionResponse(
        model=str(data.get('model') or ''),
        choices=[choice],
        usage=UsageInfo(prompt_tokens=prompt, completion_tokens=int(completion), total_tokens=prompt + int(completion)),
        prompt_token_ids=data.get('prompt_token_ids'))
    if data.get('id'):
        response.id = str(data['id'])
    return RolloutOutput(response=response)


def chat_mode_strips(options: Dict[str, Any]) -> Optional[str]:
    """Before the backend is built (``mtflow validate``): :data:`CHAT_MODE_STRIPS` when ``options``
    make a chat-mode backend whose server does not return the calls structured, else ``None``."""
    tokenizer = options.get('tokenizer')
    try:
        mode = _resolve_prompt_mode(options.get('prompt_mode', 'auto'), tokenizer, options.get('flavor', 'vllm'))
    except BackendError:
        return None  # the options' own check says what is wrong
    return CHAT_MODE_STRIPS if mode == 'chat' and options.get('server_tool_calls') is not True else None


def _preflight(cls: type, model: Optional[str], options: Dict[str, Any]) -> List[PreflightProblem]:
    """:meth:`Backend.preflight` of the OpenAI backend: each server answers ``GET /models`` and
    lists ``model`` (:mod:`mtflow.backends.server_check`)."""
    return options_problems(model, options, DEFAULT_BASE_URL)


def _session_header(name: Any) -> Optional[str]:
    """The ``session_header`` option: an HTTP header name (RFC 9110's token), or ``None``."""
    if name is not None and (not isinstance(name, str) or not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name)):
        raise BackendError(f'openai backend: session_header must be an HTTP header name (e.g. X-Session-ID) or null, '
                           f'not {name!r}')
    return name


class OpenAIBackend(ServerFacts, ServerMetrics, Backend):
    """``rollout_fn`` over an OpenAI-compatible chat completions server.

    Args:
        model: the served model name; ``None``: the first one ``GET /v1/models`` lists.
        base_url: the server's API root (``http://host:port/v1``); env ``MTFLOW_OPENAI_BASE_URL``.
        api_key: sent as a bearer token; default env ``OPENAI_API_KEY`` (many local servers need none).
        flavor: ``'vllm'``, ``'sglang'``, ``'swift'`` or ``'openai'`` (see the module docstring).
        max_connections: requests in flight at once.
        timeout: seconds for one HTTP request (connect, read and write).
        max_retries: retries per request after the first try (connection errors, timeouts, 429, 5xx).
        backoff: first retry delay in seconds; doubles each retry, with jitter, up to ``backoff_max``.
        default_max_tokens: used when the request config has no ``max_tokens``.
        extra_body: fields merged into every request body.
        tokenizer: a tokenizer (a loaded object, or a local path / hub id loaded with
            ``AutoTokenizer``): for schedulers that need one, and to build token prompts.
        prompt_mode: ``'tokens'`` (exact ids through ``/v1/completions``), ``'chat'``
            (``/v1/chat/completions``: the server re-renders; exact ids are not guaranteed) or
            ``'auto'``: tokens for flavor ``vllm`` with a tokenizer, else chat.
        chat_template, prefix_policy, exact_ids: token mode, as the HF backend.
        seed: the sampling seed of requests whose config has none: each request is sent a seed
            of its own from it and the request (:func:`mtflow.core.seeds.sampling_seed`), the
            same whatever the batch, concurrency or mode.
        urls: several servers of the same model (their API roots); each request's turns are
            routed among them by ``routing`` (:mod:`mtflow.backends.routing`); ``base_url`` is
            then the first.
        routing: ``'sticky_least_loaded'`` (default), ``'least_loaded'``, ``'round_robin'`` or
            ``'consistent_hash'``.
        max_in_flight_per_replica: requests one server is given at once (its ``max_num_seqs``);
            more wait in a queue. ``None``: no bound but ``max_connections``.
        weight_version: the policy weights' version (:meth:`set_weight_version` after an update):
            sticky placements are forgotten when it changes, and flavor ``vllm`` sends it as
            ``cache_salt`` so no prefix-cache block is reused across weights.
        http_client: ``'aiohttp'``, ``'httpx'`` or ``'auto'`` (aiohttp when installed: at 500
            requests in flight it costs ~1.3 ms of client CPU per request, httpx ~50 ms; ``docs/benchmarks.md``).
        health_interval_s: seconds between health checks (``GET <url>/models``) of several
            servers; a server that refused a connection is used again once it answers. 0: off.
        resumable: stream each single-request async call (SSE) so that a stream's
            ``on_update='resume'`` can cut it at a weight update and continue it from its exact
            ids (:mod:`mtflow.backends.openai_stream`); needs a server that streams.
        skip_special_tokens, server_tool_calls: :class:`~mtflow.backends.server_template.ServerFacts`
            (special tokens a parser reads: token mode asks for them, chat mode needs the server to
            return the calls structured).
        session_header: the header that names each request's session (its uuid) on every HTTP
            request, so that a gateway in front (``mtflow gateway``, verifiers' interception
            server) records each request as its own session, and a sticky router (slime's
            routing key, sglang's router) keeps its turns on one server; ``None``: not sent.
    """
    name = 'openai'
    streams_text = True
    preflight = classmethod(_preflight)

    def __init__(self,
                 model: Optional[str] = None,
                 base_url: Optional[str] = None,
                 *,
                 api_key: Optional[str] = None,
                 flavor: str = 'vllm',
                 max_connections: int = 64,
                 timeout: float = 120.0,
                 max_retries: int = 4,
                 backoff: float = 0.5,
                 backoff_max: float = 8.0,
                 default_max_tokens: int = 256,
                 extra_body: Optional[Dict[str, Any]] = None,
                 tokenizer: Any = None,
                 prompt_mode: str = 'auto',
                 chat_template: Optional[str] = None,
                 prefix_policy: str = 'exact',
                 exact_ids: bool = True,
                 seed: Optional[int] = None,
                 urls: Optional[List[str]] = None,
                 routing: str = 'sticky_least_loaded',
                 max_in_flight_per_replica: Optional[int] = None,
                 weight_version: Optional[Any] = None,
                 health_interval_s: float = 5.0,
                 http_client: str = 'auto',
                 resumable: bool = False,
                 skip_special_tokens: bool = True,
                 server_tool_calls: bool = False,
                 session_header: Optional[str] = SESSION_HEADER) -> None:
        super().__init__()
        self.skip_special_tokens = flag_option(skip_special_tokens, 'openai backend: skip_special_tokens')
        self.server_tool_calls = flag_option(server_tool_calls, 'openai backend: server_tool_calls')
        self.session_header = _session_header(session_header)
        if resumable and flavor == 'openai':
            raise BackendError("openai backend: resumable=True continues cut generations with continue_final_message "
                               "or token prompts, which flavor 'openai' cannot")
        self.resumable, self.http_client = bool(resumable), choose_client(http_client)
        _check_connection_options(flavor, max_connections, max_retries, timeout)
        template = resolve_chat_template(chat_template, where='openai backend: chat_template')
        if urls is not None and (isinstance(urls, str) or not isinstance(urls, (list, tuple))):
            raise BackendError(f'openai backend: urls must be a list of server URLs, not {urls!r}')
        self.base_url = (base_url or (urls[0] if urls else None) or os.environ.get('MTFLOW_OPENAI_BASE_URL')
                         or DEFAULT_BASE_URL).rstrip('/')
        self.router = Router(list(urls) if urls else [self.base_url], routing,
                             max_in_flight=max_in_flight_per_replica, weight_version=weight_version)
        self.health_interval_s, self._health_task = health_interval_s, None  # the task: Optional[asyncio.Future]
        self.served_model, self.model_name, self.flavor = model, model or self.base_url, flavor
        self.max_connections, self.timeout, self.max_retries = max_connections, timeout, max_retries
        self.backoff, self.backoff_max = backoff, backoff_max
        self.default_max_tokens = default_max_tokens
        self.extra_body = dict(extra_body or {})
        key = api_key if api_key is not None else os.environ.get('OPENAI_API_KEY')
        self._headers = {'Authorization': f'Bearer {key}'} if key else {}
        self._runner = LoopThread('mtflow-openai')
        self._client: Any = None
        self._sem: Optional[asyncio.Semaphore] = None
        self._model_lock: Optional[asyncio.Lock] = None
        self.retries = 0  # total retries made (for tests and the summary)
        self.tokenizer = tokenizer = _loaded_tokenizer(tokenizer)
        self.prompt_mode = prompt_mode = _resolve_prompt_mode(prompt_mode, tokenizer, flavor)
        if template.text is not None and prompt_mode == 'chat':
            self.close()  # its loop thread is started
            raise _chat_template_ignored(template)
        self.seed = seed
        self.prompter = TokenPrompter(tokenizer, template, policy=prefix_policy, exact=exact_ids) \
            if prompt_mode == 'tokens' else None
        if prompt_mode == 'chat':
            warnings.warn(f'openai backend ({self.base_url}): chat completions re-render and re-tokenize the '
                          'conversation every turn, so the model is not guaranteed the exact ids it sampled; '
                          "give tokenizer= with flavor 'vllm' for token prompts (prompt_mode='tokens')", stacklevel=2)

    # ---- the HTTP side (runs on the private loop) --------------------------------------------------
    async def _ensure_client(self) -> Any:
        if self._client is None:
            self._client = make_client(self.http_client, self._headers, self.timeout, self.max_connections)
            self._sem = asyncio.Semaphore(self.max_connections)
            if len(self.router.replicas) > 1 and self.health_interval_s > 0:
                watch = watch_health(self.router, self._probe, self.health_interval_s)
                self._health_task = asyncio.ensure_future(watch)
        return self._client

    async def _probe(self, replica: Any) -> bool:
        resp = await self._client.request('GET', replica.url + '/models', None, timeout=min(self.timeout, 5.0))
        return resp.status_code < 500

    async def _resolve_model(self) -> str:
        if self.served_model is None:
            if self._model_lock is None:  # created on the private loop, where it is used
                self._model_lock = asyncio.Lock()
            async with self._model_lock:  # concurrent first calls ask the server once
                if self.served_model is None:
                    data, _ = await self._send('GET', '/models', None, 'GET /models')
                    models = [m.get('id') for m in (data.get('data') or []) if isinstance(m, dict) and m.get('id')]
                    if not models:
                        raise BackendError(f'openai backend: {self.base_url}/models lists no model; set model=')
                    self.served_model = models[0]
                    self.model_name = models[0]
        return self.served_model

    async def _send(self, method: str, path: str, body: Optional[Dict[str, Any]], where: str,
                    key: Optional[str] = None, entry: Any = None, fetch: Any = None,
                    headers: Optional[Dict[str, str]] = None) -> Tuple[Any, Any]:
        """The server's JSON answer and the replica that gave it. A failed try is retried on
        another replica when there is one (a move, counted and noted in ``entry``), at once
        while an untried healthy replica is left, else after a backoff delay. ``fetch``: a
        streamed request (:mod:`mtflow.backends.openai_stream`); its answer is ``None`` when
        the server streamed, else the JSON it sent instead."""
        client = await self._ensure_client()
        router = self.router
        attempt = 0
        failed: set = set()
        while True:
            wait_s: Optional[float] = None
            async with self._sem:
                replica = await router.acquire(key, failed)
                url = replica.url + path
                try:
                    resp = await (fetch(client, method, url, body, headers) if fetch else
                                  client.request(method, url, body, headers=headers))
                except TimedOut:
                    resp, problem = None, f'timed out after {self.timeout} s'
                except Unreachable as exc:
                    resp, problem = None, str(exc)
                    router.mark_down(replica)
                finally:
                    await router.release(replica)
            if resp is not None:
                if resp.status_code < 400:
                    if not replica.healthy:
                        router.mark_up(replica)
                    try:
                        return (None if resp.streamed else resp.json()), replica
                    except ValueError as exc:
                        raise BackendError(f'{where}: the server answered {resp.status_code} with non-JSON: '
                                           f'{resp.text[:200]!r}') from exc
                problem = f'HTTP {resp.status_code}: {error_message(resp)}'
                if resp.status_code not in RETRY_STATUS:
                    raise BackendError(f'{where}: {url} answered {problem}')
                wait_s = retry_after(resp.headers.get('retry-after'))
            if attempt >= self.max_retries:
                raise BackendError(f'{where}: {url} failed after {attempt + 1} attempt(s): {problem}')
            failed.add(replica.index)
            attempt += 1
            self.retries += 1
            if len(router.replicas) > 1 and entry is not None:
                router.moved(entry, replica, problem[:120])
            if any(r.healthy and r.index not in failed for r in router.replicas):
                continue  # another replica is there: move at once
            delay = min(self.backoff_max, self.backoff * (2**attempt)) * (0.5 + random.random() / 2)
            if wait_s is not None:
                delay = min(max(delay, wait_s), max(self.backoff_max, wait_s))
            failed.clear()  # every replica failed once: any may serve the retry
            await asyncio.sleep(delay)

    async def _one(self, request: Any, options: SamplingOptions, model: str, seed: Optional[int],
                   prompt_ids: Optional[List[int]] = None, reply: Any = None) -> Optional[RolloutOutput]:
        """One request's HTTP request; with ``reply`` (a resumable call) it is streamed into
        ``reply`` and ``None`` is returned. A request someone listens to (:mod:`.text_sinks`) is
        streamed too, its text handed on as it comes (a server that answers in one body is read
        as such)."""
        uuid = getattr(request, 'uuid', None)
        where = f'request {uuid!r}'
        key = str(uuid) if uuid else None
        headers = {self.session_header: str(uuid)} if self.session_header and uuid else None
        sink = self.text_sinks.get(request) if reply is None else None
        if sink is not None:
            reply = StreamedReply(where, prompt_ids is not None, None, on_text=sink)
        if prompt_ids is not None:
            body = build_completion_body(prompt_ids, options, model, self.flavor, self.extra_body, seed,
                                         self.skip_special_tokens)
        else:
            body = build_body(request, options, model, self.flavor, self.extra_body, seed)
        if self.router.weight_version is not None and self.flavor == 'vllm':
            body.setdefault('cache_salt', f'weights-{self.router.weight_version}')
        entry = self.router.begin(key)
        path = '/completions' if prompt_ids is not None else '/chat/completions'
        data = None
        if reply is not None:
            data, replica = await self._send('POST', path, stream_body(body, reply.prefix, self.flavor, where), where,
                                             key, entry, reply.fetch(), headers)
            if data is None:
                self.router.served(entry, replica, len(prompt_ids or ()), None)
                return reply.output(prompt_ids, prompt_ids) if sink is not None else None
            if sink is None:
                raise BackendError(f'{where}: {replica.url} answered a streamed request (stream: true) with one JSON '
                                   'body: resumable=True needs a server that streams (SSE); else resumable=False')
        if data is None:
            data, replica = await self._send('POST', path, body, where, key, entry, headers=headers)
        out = parse_completion(data, prompt_ids, where) if prompt_ids is not None else parse_choice(data, where)
        usage = out.response.usage
        self.router.served(entry, replica, usage.prompt_tokens if usage is not None else 0, cached_tokens_of(data))
        return out

    async def _gather(self, requests: List[Any], options: SamplingOptions) -> List[RolloutOutput]:
        """All requests of one call, concurrently, in request order (on the private loop), each
        with its own sampling seed. In token mode each prompt is planned from the request's token
        record and committed afterwards."""
        model = await self._resolve_model()
        seeds = sampling_seeds(requests, options, self.seed)
        if self.prompter is None:
            return list(await asyncio.gather(*(self._one(r, options, model, s) for r, s in zip(requests, seeds))))

        async def send(going: List[int]) -> List[Any]:
            plans = [self.prompter.plan(requests[k]) for k in going]
            sent = list(await asyncio.gather(*(self._one(requests[k], options, model, seeds[k], p.ids)
                                               for k, p in zip(going, plans))))
            commit_outputs(self.prompter, [requests[k] for k in going], plans, sent)
            return sent

        # a request with images fails alone (its output is the error naming it); the call's others go on
        return await aserving_the_others([image_refusal(r, 'a token prompt (/v1/completions)', 'use prompt_mode chat')
                                          for r in requests], send)

    # ---- the rollout_fn side ------------------------------------------------------------------------
    def generate(self, requests: List[Any], options: SamplingOptions) -> List[RolloutOutput]:
        if self._runner is None:
            raise BackendError('openai backend: used after close()')
        return self._runner.run(self._gather(requests, options))

    #: async mode calls :meth:`acall` with single requests: each is its own HTTP request at once
    native_async = True

    async def agenerate(self, requests: List[Any], options: SamplingOptions) -> List[RolloutOutput]:
        """The requests of one async-mode call (usually one), awaitable from any event loop: the
        HTTP requests run on the backend's private loop, at most ``max_connections`` at a time
        across all concurrent calls."""
        if self._runner is None:
            raise BackendError('openai backend: used after close()')
        return await self._runner.wrap(self._gather(requests, options))

    async def acall(self, requests: List[Any], request_config: Any = None) -> List[RolloutOutput]:
        """As :meth:`Backend.acall`; with ``resumable=True`` a single request is streamed and
        can be cut and resumed (:mod:`mtflow.backends.openai_stream`)."""
        if self.resumable and len(requests) == 1:
            return await streamed_acall(self, requests[0], request_config)
        return await super().acall(requests, request_config)

    # ---- several servers ------------------------------------------------------------------------------
    def set_weight_version(self, version: Any) -> None:
        """Tell the router the policy's weights changed (after a weight sync): see ``weight_version``."""
        if self._runner is not None:
            self._runner.loop.call_soon_threadsafe(self.router.set_weight_version, version)

    def fork(self, parent: str, children: List[str]) -> None:
        """Request ``parent`` was forked (``docs/branching.md``): its children are routed where its
        prefix is cached (:meth:`Router.fork`, on the backend's loop, before any of their calls)."""
        if self._runner is not None:
            self._runner.loop.call_soon_threadsafe(self.router.fork, str(parent), [str(c) for c in children])
        else:
            self.router.fork(str(parent), [str(c) for c in children])

    def serving(self, uuid: str) -> List[Dict[str, Any]]:
        """Request ``uuid``'s serving log, one entry per turn (replica, prompt and cached tokens,
        moves), removed from the backend; ``mtflow run`` writes it into the trace."""
        return self.router.take(str(uuid))

    def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        if self._health_task is not None:
            runner.loop.call_soon_threadsafe(self._health_task.cancel)
        if self._client is not None:
            try:
                runner.run(self._client.close())
            except Exception:  # pragma: no cover - closing is best effort
                pass
        runner.stop()

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass

    def describe(self) -> str:
        n = len(self.router.replicas)
        where = self.base_url if n == 1 else f'{n} servers, routing {self.router.policy}'
        return f'openai ({self.model_name} at {where}, flavor {self.flavor})'


def _loaded_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` as given, or loaded with ``AutoTokenizer`` from a local path / hub id."""
    if not isinstance(tokenizer, str):
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer)


def _chat_template_ignored(template: Any) -> BackendError:
    return BackendError(f'openai backend: chat_template ({template.describe()}) renders token prompts (prompt_mode '
                        'tokens, with a tokenizer); through chat completions the server renders with its own template '
                        '(vllm serve --chat-template): it would be ignored')


def _check_connection_options(flavor: str, max_connections: Any, max_retries: int, timeout: float) -> None:
    if flavor not in FLAVORS:
        raise BackendError(f'openai backend: flavor must be one of {", ".join(FLAVORS)}, not {flavor!r}')
    if not isinstance(max_connections, int) or max_connections < 1:
        raise BackendError(f'openai backend: max_connections must be a positive int, not {max_connections!r}')
    if max_retries < 0 or timeout <= 0:
        raise BackendError('openai backend: max_retries must be >= 0 and timeout > 0')


def _resolve_prompt_mode(prompt_mode: str, tokenizer: Any, flavor: str) -> str:
    """``'tokens'`` or ``'chat'``: ``'auto'`` takes token prompts when they can be built (a
    tokenizer) and sent (flavor ``vllm``)."""
    if prompt_mode not in ('auto', 'tokens', 'chat'):
        raise BackendError(f"openai backend: prompt_mode must be 'auto', 'tokens' or 'chat', not {prompt_mode!r}")
    if prompt_mode == 'auto':
        prompt_mode = 'tokens' if tokenizer is not None and flavor == 'vllm' else 'chat'
    if prompt_mode == 'tokens' and tokenizer is None:
        raise BackendError("openai backend: prompt_mode='tokens' needs the model's tokenizer (tokenizer=...)")
    return prompt_mode
