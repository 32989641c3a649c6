"""vLLM backend: a colocated ``vllm.LLM`` as ``rollout_fn``.

Two ways to turn requests into engine calls (``prompt_mode``):

* ``'tokens'`` (default): token-in/token-out, exactly as the HF backend
  (:mod:`mtflow.backends.tokens`): turn 1 is rendered once with the engine's tokenizer and chat
  template (its ``tools`` and ``chat_template_kwargs`` included), every later turn is the
  previous prompt + the sampled ids + the template's delta, and the whole turn goes to **one**
  ``LLM.generate`` call as token prompts (``{'prompt_token_ids': ...}``, vLLM's
  ``TokensPrompt``), each with its own ``SamplingParams``. Mixed batches (new turns and
  continuations, different tools) stay one engine batch.
* ``'chat'``: ``LLM.chat`` renders the messages itself (re-tokenizing the whole conversation
  every turn, so exact ids are not guaranteed; a warning says so once); since its ``tools``,
  ``add_generation_prompt`` and ``continue_final_message`` apply to a whole call, requests are
  grouped by those and each group is one ``chat`` call (results are put back in request order).

``RequestConfig`` becomes ``SamplingParams`` (:func:`sampling_kwargs`): ``n=1``, ``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``min_p``, penalties, ``stop``, ``seed`` (each request's own,
from the seed and the request: :func:`mtflow.core.seeds.sampling_seed`), and ``logprobs`` (0 = only the sampled token, k = also the top k). Engine outputs become choices
(:func:`choice_from_completion`): the text, the sampled ``token_ids``, per-token logprobs in
OpenAI's shape, and ``finish_reason`` ``'stop'`` or ``'length'``.

``vllm`` is imported only when the backend builds its own engine; pass an ``LLM`` object (or
anything with its methods) as ``model`` to share an engine with a trainer. ``model='embedded'``
serves the converted copy of the embedded SmolLM2 (``mtflow.backends.models``).

**Async engine** (``engine='async'``, or an ``AsyncLLM``/``AsyncLLMEngine`` object as ``model``):
every request is its own ``AsyncLLM.generate(prompt, sampling_params, request_id)`` stream, so
vLLM's continuous batching schedules requests as they come and each one's output is handed to
its state machine the moment that request finishes (``Executor(..., mode='async')`` with
``backend.async_rollout_fn()``). The engine lives on a private event loop of the backend
(``AsyncLLM`` belongs to the loop it first runs on); a lockstep call sends the turn's requests
as concurrent streams and waits for all. Token prompts only (``AsyncLLM`` has no ``chat``). A
cancelled call (interrupt, deadline) aborts its vLLM requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import os
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from mtflow.backends.base import (Backend, BackendError, SamplingOptions, build_output, sampling_seeds,
                                  context_length_of, flag_option, prepare_chat)
from mtflow.backends.images import aserving_the_others, image_refusal, openai_messages, serving_the_others
from mtflow.backends.chat_templates import resolve_chat_template
from mtflow.backends.loop_thread import LoopThread
from mtflow.backends.models import EMBEDDED_NAMES, embedded_model_dir
from mtflow.backends.tokens import TokenPrompter, commit_outputs
from mtflow.backends.vllm_defaults import choose_engine_kwargs
from mtflow.backends.vllm_logs import engine_process_env, logging_config_file
from mtflow.backends.vllm_resume import resumable_acall, snapshot
from mtflow.backends.vision import NO_PROCESSOR_FOR_TOKENS, VisionPrompter, check_engine_prompt, image_refusals, token_prompt

__all__ = ['VLLMBackend', 'sampling_kwargs', 'choice_from_completion']


def sampling_kwargs(options: SamplingOptions) -> Dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one request."""
    kwargs: Dict[str, Any] = dict(
        n=1,
        max_tokens=options.max_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k if options.top_k > 0 else -1,
        min_p=options.min_p,
        repetition_penalty=options.repetition_penalty,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        stop=list(options.stop) or None,
        seed=options.seed,
        logprobs=(options.top_logprobs or 0) if options.logprobs else None,
        skip_special_tokens=True,
        include_stop_str_in_output=False,
    )
    return kwargs


def _load_error_text(exc: BaseException, limit: int = 600) -> str:
    """One line for an engine that failed to start.

    vLLM's messages put the cause after a header line (pydantic: ``1 validation error for
    ModelConfig`` then ``Value error, User-specified max_model_len ...``), so the whole text is
    kept, on one line and capped. When the engine core died in its own process the exception only
    says so; the cause is in the log that process printed, which the message points to."""
    text = ' '.join(str(exc).split())
    if len(text) > limit:
        text = text[:limit - 3] + '...'
    if 'initialization failed' in text.lower():
        text += " (the cause is in vLLM's log above, e.g. on CPU: not enough free RAM for gpu_memory_utilization; " \
                "pass engine_kwargs={'kv_cache_memory_bytes': ...})"
    return f'{type(exc).__name__}: {text}'


def _logprob_value(entry: Any) -> float:
    return float(entry.logprob if hasattr(entry, 'logprob') else entry)


def choice_from_completion(completion: Any, prompt_token_ids: Optional[List[int]], options: SamplingOptions,
                           model: str, tokenizer: Any = None) -> Any:
    """One engine ``CompletionOutput`` as a rollout output."""
    ids = [int(t) for t in (completion.token_ids or [])]
    reason = completion.finish_reason
    if reason not in ('stop', 'length'):
        if reason in ('abort', 'error'):
            raise BackendError(f'vllm finished a request with reason {reason!r}')
        reason = 'stop' if reason is not None else None
    lps = tokens = top = None
    if options.logprobs:
        steps = completion.logprobs
        if steps is None or len(steps) < len(ids):
            raise BackendError(f'vllm returned logprobs for {0 if steps is None else len(steps)} of {len(ids)} tokens')
        lps, tokens, top = [], [], [] if options.top_logprobs else None
        for token_id, step in zip(ids, steps):
            entry = step[token_id]
            lps.append(_logprob_value(entry))
            text = getattr(entry, 'decoded_token', None)
            if text is None and tokenizer is not None:
                text = tokenizer.decode([token_id])
            tokens.append(text or '')
            if top is not None:
                ranked = sorted(step.items(), key=lambda kv: (getattr(kv[1], 'rank', None) or 10**9,
                                                              -_logprob_value(kv[1])))
                alts = [(tid, e) for tid, e in ranked][:options.top_logprobs]
                top.append([{'token': getattr(e, 'decoded_token', None) or '', 'logprob': _logprob_value(e)}
                            for _, e in alts])
    return build_output(
        completion.text,
        ids,
        reason,
        logprobs=lps,
        tokens=tokens,
        top_logprobs=top,
        model=model,
        prompt_tokens=len(prompt_token_ids or ()),
        prompt_token_ids=list(prompt_token_ids) if prompt_token_ids is not None else None)


class VLLMBackend(Backend):
    """``rollout_fn`` over a ``vllm.LLM``.

    Args:
        model: an ``LLM`` object (shared with a trainer), or a model for a new ``LLM``: a local
            directory, a hub id, or ``'embedded'``.
        prompt_mode: ``'tokens'`` (render with the tokenizer, one ``generate`` call per turn) or
            ``'chat'`` (``LLM.chat``, one call per group of alike requests).
        chat_template: overrides the tokenizer's template (both modes).
        default_max_tokens: used when the request config has no ``max_tokens``.
        engine_kwargs: keyword arguments for a new ``vllm.LLM`` (``gpu_memory_utilization``,
            ``max_model_len``, ``tensor_parallel_size``, ``dtype``, ``enforce_eager``, ...).
        sampling_params_cls: the class built from :func:`sampling_kwargs` (default
            ``vllm.SamplingParams``; tests pass their own).
        seed: the engine's seed, and the sampling seed of requests whose config has none: each
            request samples with a seed of its own from it and the request
            (:func:`mtflow.core.seeds.sampling_seed`), so two runs with the same seed and data
            sample the same tokens whatever the batches, concurrency or mode.
        exact_ids, prefix_policy: token mode, as the HF backend (``exact_ids=False`` re-renders
            every turn from text).
        engine: ``'llm'`` (``vllm.LLM``), ``'async'`` (``AsyncLLM``: one stream per request) or
            ``'auto'`` (default: ``'async'`` for an object whose ``generate`` is an async
            generator, else ``'llm'``).
        processor: a vision-language model's ``AutoProcessor``: token prompts of requests with
            images carry ``multi_modal_data`` and the image pads expanded as the processor does
            (:mod:`mtflow.backends.vision`); without one, a token-mode request with images fails alone.
        resumable: the async engine's single-request calls can be cut at a weight update and
            continued from their exact ids (a stream's ``on_update='resume'``,
            :mod:`mtflow.backends.vllm_resume`).
        skip_special_tokens: ``SamplingParams.skip_special_tokens`` (default ``True``); ``False``
            keeps them in the reply's text (vLLM leaves out the stop token that ended it), for a
            parser that reads them (:meth:`keep_special_tokens`; ``mtflow run`` sets it).
    """
    name = 'vllm'

    def __init__(self,
                 model: Any = 'embedded',
                 *,
                 prompt_mode: str = 'tokens',
                 chat_template: Optional[str] = None,
                 default_max_tokens: int = 256,
                 engine_kwargs: Optional[Dict[str, Any]] = None,
                 sampling_params_cls: Optional[Callable[..., Any]] = None,
                 seed: Optional[int] = None,
                 exact_ids: bool = True,
                 prefix_policy: str = 'exact',
                 engine: str = 'auto',
                 processor: Any = None,
                 resumable: bool = False,
                 skip_special_tokens: bool = True) -> None:
        super().__init__()
        self.resumable, self.skip_special_tokens = bool(resumable), flag_option(skip_special_tokens,
                                                                                'vllm backend: skip_special_tokens')
        template = resolve_chat_template(chat_template, where='vllm backend: chat_template')  # before the engine starts
        given = not (isinstance(model, str) or model is None)
        self.is_async = _wants_async_engine(model, given, prompt_mode, engine)
        if resumable and not self.is_async:
            raise BackendError("vllm backend: resumable=True needs the async engine (engine='async' or an AsyncLLM): "
                               'vllm.LLM runs a batch to its end and cannot hand back a cut generation')
        self._runner, self._closed = None, False  # the async engine's private loop (a LoopThread)
        self._owns_engine = not given
        #: the logging config file the engine's processes read (deleted on close)
        self._log_config_path: Optional[str] = None
        self._request_ids = itertools.count()
        #: the load report: the engine's dtype and prefix-cache block size, and where each came from
        self.load_info: Dict[str, Any] = {}
        #: vLLM's own count of prompt tokens served from its prefix cache (the run summary's block)
        self.prefix_cache = PrefixCacheTally()
        if self.is_async:
            self._runner = LoopThread('mtflow-vllm-async')
        if self.is_async and not given:
            self.llm, self.model_name, sampling_params_cls = self._build_async_engine(
                model, engine_kwargs, seed, sampling_params_cls)
        elif not given:
            self.llm, self.model_name, sampling_params_cls, self.load_info, self._log_config_path = _build_llm_engine(
                model, engine_kwargs, seed, sampling_params_cls)
        else:
            self.llm, self.model_name = model, _served_model_name(model)
            if sampling_params_cls is None:
                sampling_params_cls = _vllm_sampling_params()
        self.sampling_params_cls, self.prompt_mode = sampling_params_cls, prompt_mode
        self.chat_template, self.default_max_tokens = template.text, default_max_tokens
        tokenizer = self.llm.get_tokenizer()
        if inspect.isawaitable(tokenizer):  # AsyncLLM.get_tokenizer is a coroutine
            tokenizer = self._runner.run(_awaited(tokenizer))
        self.tokenizer = tokenizer
        self.seed = seed
        self.prompter = TokenPrompter(self.tokenizer, template, policy=prefix_policy, exact=exact_ids) \
            if processor is None else VisionPrompter(processor, template, policy=prefix_policy, exact=exact_ids)
        #: the engine's ``max_model_len`` (context budgets read it)
        self.context_length = _max_model_len(self.llm)
        if prompt_mode == 'chat':
            warnings.warn("vllm backend: prompt_mode='chat' re-renders and re-tokenizes the conversation every "
                          "turn, so the model is not guaranteed the exact ids it sampled; use prompt_mode='tokens'",
                          stacklevel=2)

    def count_prompt_tokens(self, request: Any) -> int:
        """The exact length of the prompt ``request``'s next turn would send (context budgets)."""
        return len(self.prompter.plan(request).ids)

    def keep_special_tokens(self) -> Optional[str]:
        """Decode replies with their special tokens from now on (``skip_special_tokens=False``)."""
        self.skip_special_tokens = False
        return None

    def _build_async_engine(self, model: Optional[str], engine_kwargs: Optional[Dict[str, Any]], seed: Optional[int],
                            sampling_params_cls: Any) -> Tuple[Any, str, Any]:
        try:
            import vllm
        except ImportError as exc:
            self._runner.stop()
            raise BackendError(NEEDS_VLLM) from exc
        try:
            from vllm.v1.engine.async_llm import AsyncLLM as engine_cls
        except ImportError:  # older vLLM: the V0 engine
            engine_cls = vllm.AsyncLLMEngine
        path, name = _model_path(model)
        kwargs, self.load_info = _engine_kwargs(engine_kwargs, seed)

        async def build() -> Any:  # on the private loop: the engine binds to it
            return engine_cls.from_engine_args(vllm.AsyncEngineArgs(model=path, **kwargs))

        try:
            with _engine_start(kwargs) as self._log_config_path:
                llm = self._runner.run(build())
        except Exception as exc:
            self._runner.stop()
            raise BackendError(f'vllm cannot load model {name!r}: {_load_error_text(exc)}') from exc
        return llm, name, sampling_params_cls or vllm.SamplingParams

    def _params(self, options: SamplingOptions, seed: Optional[int]) -> Any:
        """``SamplingParams`` for one request, with its own sampling ``seed``
        (:func:`~mtflow.backends.base.sampling_seeds`: with one seed for all, vLLM would sample
        every copy of a repeated prompt, a GRPO group, identically)."""
        return self.sampling_params_cls(**dict(sampling_kwargs(options), seed=seed,
                                               skip_special_tokens=self.skip_special_tokens))

    def generate(self, requests: List[Any], options: SamplingOptions) -> List[Any]:
        if self._closed:
            raise BackendError('vllm backend: used after close()')
        if self.is_async:
            return self._live_runner().run(self._streams(requests, options, sampling_seeds(requests, options, self.seed)))
        if self.prompt_mode == 'tokens':
            return self._generate_tokens(requests, options)
        return self._generate_chat(requests, options)

    def _generate_tokens(self, requests: List[Any], options: SamplingOptions) -> List[Any]:
        refusals = image_refusals(self.prompter, requests, 'vllm token prompts', NO_PROCESSOR_FOR_TOKENS)
        if any(refusals):  # only the requests with images fail; the call's others are generated
            return serving_the_others(requests, refusals, lambda others: self._generate_tokens(others, options))
        plans = [self.prompter.plan(r) for r in requests]
        # vllm.inputs.TokensPrompt (with multi_modal_data for a request with images)
        prompts = [token_prompt(self.prompter, r, p.ids, 'vllm token prompts') for r, p in zip(requests, plans)]
        params = [self._params(options, seed) for seed in sampling_seeds(requests, options, self.seed)]
        results = self.llm.generate(prompts, params, use_tqdm=False)
        if len(results) != len(requests):
            raise BackendError(f'vllm returned {len(results)} results for {len(requests)} prompts')
        outputs: List[Any] = []
        for r, res, p, plan in zip(requests, results, prompts, plans):
            # an image prompt went with one pad per image; the engine expands them: it must run plan.ids
            mismatch = check_engine_prompt(r, plan.ids, getattr(res, 'prompt_token_ids', None),
                                           getattr(self.prompter, 'pad_id', None)) if 'multi_modal_data' in p else None
            outputs.append(mismatch or choice_from_completion(res.outputs[0], plan.ids, options, self.model_name,
                                                              self.tokenizer))
            self.prefix_cache.add(len(plan.ids), getattr(res, 'num_cached_tokens', None), plan.appended is not None)
        kept = [k for k, out in enumerate(outputs) if not isinstance(out, BaseException)]
        commit_outputs(self.prompter, [requests[k] for k in kept], [plans[k] for k in kept], [outputs[k] for k in kept])
        return outputs

    def _generate_chat(self, requests: List[Any], options: SamplingOptions) -> List[Any]:
        groups: Dict[Tuple[bool, str, str], List[int]] = {}
        chats = [prepare_chat(r) for r in requests]
        for i, chat in enumerate(chats):
            key = (chat.continuation, json.dumps(chat.tools, sort_keys=True, default=str),
                   json.dumps(chat.chat_template_kwargs, sort_keys=True, default=str))
            groups.setdefault(key, []).append(i)
        outputs: List[Any] = [None] * len(requests)
        seeds = sampling_seeds(requests, options, self.seed)
        for (continuation, _, _), idx in groups.items():
            params = [self._params(options, seeds[i]) for i in idx]
            group_chat = chats[idx[0]]  # the group's requests share tools and template kwargs
            results = self.llm.chat(
                [openai_messages(requests[i], chats[i].messages) for i in idx],
                sampling_params=params,
                use_tqdm=False,
                chat_template=self.chat_template,
                add_generation_prompt=not continuation,
                continue_final_message=continuation,
                tools=group_chat.tools,
                chat_template_kwargs=group_chat.chat_template_kwargs or None)
            if len(results) != len(idx):
                raise BackendError(f'vllm returned {len(results)} results for {len(idx)} conversations')
            for i, res in zip(idx, results):
                outputs[i] = choice_from_completion(res.outputs[0], getattr(res, 'prompt_token_ids', None), options,
                                                    self.model_name, self.tokenizer)
        return outputs

    # ---- the async engine --------------------------------------------------------------------------
    @property
    def native_async(self) -> bool:  # type: ignore[override]
        return self.is_async

    @property
    def streams_text(self) -> bool:  # type: ignore[override]
        """The async engine streams each request's text to its sink (:mod:`.text_sinks`)."""
        return self.is_async

    def _live_runner(self) -> Any:
        if self._runner is None:
            raise BackendError('vllm backend: used after close()')
        return self._runner

    async def agenerate(self, requests: List[Any], options: SamplingOptions) -> List[Any]:
        """An async-mode call (usually one request), awaitable from any loop: one engine stream per
        request on the backend's loop, each with its own sampling seed."""
        if not self.is_async:
            return await super().agenerate(requests, options)
        seeds = sampling_seeds(requests, options, self.seed)
        return await self._live_runner().wrap(self._streams(requests, options, seeds))

    async def acall(self, requests: List[Any], request_config: Any = None) -> List[Any]:
        """As :meth:`Backend.acall`; with ``resumable=True`` a single request can be cut and
        resumed (:mod:`mtflow.backends.vllm_resume`)."""
        if self.resumable and len(requests) == 1:
            return await resumable_acall(self, requests[0], request_config, choice_from_completion)
        return await super().acall(requests, request_config)

    async def _streams(self, requests: List[Any], options: SamplingOptions, seeds: List[Optional[int]]) -> List[Any]:
        async def stream(going: List[int]) -> List[Any]:
            plans = [self.prompter.plan(requests[k]) for k in going]  # exact ids from each request's token record
            sent = list(await asyncio.gather(*(self._stream(requests[k], p, options, seeds[k])
                                               for k, p in zip(going, plans))))
            commit_outputs(self.prompter, [requests[k] for k in going], plans, sent)
            return sent

        # a request with images fails alone (its output is the error naming it); the others stream
        return await aserving_the_others([image_refusal(r, "vllm's async engine", 'use the LLM engine (engine: llm) '
                                                        'for requests with images') for r in requests], stream)

    async def _stream(self, request: Any, plan: Any, options: SamplingOptions, seed: Optional[int],
                      prefix_ids: Optional[List[int]] = None, progress: Optional[Dict[str, Any]] = None) -> Any:
        """One request's stream: consumed as vLLM produces it; its last (cumulative) output is the
        request's output. Cancelled: the vLLM request is aborted. A resumed call continues after
        ``prefix_ids`` (appended to the prompt) and notes each output in ``progress``."""
        prompt = plan.ids + list(prefix_ids or ())
        request_id = f'mtflow-{getattr(request, "uuid", None) or "request"}-{next(self._request_ids)}'
        last = None
        sink = self.text_sinks.get(request)  # a gateway's streaming call listens
        try:
            async for out in self.llm.generate(await self._engine_input(prompt), self._params(options, seed),
                                               request_id):
                last = out
                if progress is not None:
                    progress['last'] = snapshot(out)
                if sink is not None and out.outputs:
                    sink(out.outputs[0].text)
        except (asyncio.CancelledError, GeneratorExit):
            abort = getattr(self.llm, 'abort', None)
            if abort is not None:
                result = abort(request_id)
                if inspect.isawaitable(result):
                    await asyncio.shield(_awaited(result))
            raise
        if last is None or not last.outputs:
            raise BackendError(f'vllm stream {request_id} ended without an output')
        if getattr(last, 'finished', True) is False:
            raise BackendError(f'vllm stream {request_id} ended before the request finished')
        self.prefix_cache.add(len(prompt), getattr(last, 'num_cached_tokens', None), plan.appended is not None)
        return choice_from_completion(last.outputs[0], plan.ids, options, self.model_name, self.tokenizer)

    async def _engine_input(self, ids: List[int]) -> Any:
        """A token prompt as ``AsyncLLM.generate`` wants it: rendered by the engine's own
        ``Renderer`` (``parse_model_prompt`` then ``render_cmpl_async``, the path vLLM's
        ``generate`` docstring gives), as ``LLM.generate`` does for its prompts. vLLM 0.32
        deprecates raw prompts there ("Passing raw prompts to InputProcessor is deprecated").
        An engine without a renderer (an older vLLM, a stand-in) gets the raw ``TokensPrompt``."""
        renderer = getattr(self.llm, 'renderer', None)
        render = getattr(renderer, 'render_cmpl_async', None)
        if render is None:
            return {'prompt_token_ids': ids}
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        parsed = parse_model_prompt(self.llm.model_config, {'prompt_token_ids': ids})
        (engine_input,) = await render([parsed], renderer.default_cmpl_tok_params)
        return engine_input

    def close(self) -> None:
        """Shut down an engine this backend built (its engine process stops now, not when the
        interpreter exits), and the async engine's loop thread. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        runner, self._runner = self._runner, None
        if self._owns_engine:
            try:
                if self.is_async and runner is not None:
                    runner.run(_shutdown_async_engine(self.llm, SHUTDOWN_TIMEOUT_S))
                else:  # vllm.LLM has no shutdown of its own; its engine core client does
                    shutdown = getattr(self.llm, 'shutdown', None) or getattr(
                        getattr(getattr(self.llm, 'llm_engine', None), 'engine_core', None), 'shutdown', None)
                    if callable(shutdown):
                        _call_with_timeout(shutdown, SHUTDOWN_TIMEOUT_S)
            except Exception:  # pragma: no cover - closing is best effort
                pass
            self.llm = None
        _remove(self._log_config_path)
        self._log_config_path = None
        if runner is not None:
            runner.stop()

    def prefix_cache_summary(self) -> Optional[Dict[str, Any]]:
        """The prefix cache's figures for the run summary (``None`` before any output, or when
        the engine does not report cached tokens), with the engine's block size."""
        figures = self.prefix_cache.figures()
        if figures is not None:
            figures['block_size'] = _block_size(self.llm) or self.load_info.get('block_size')
        return figures

    def describe(self) -> str:
        dtype = f", {self.load_info['dtype']}" if self.load_info.get('dtype') else ''
        if self.is_async:
            return f'vllm ({self.model_name}, async engine{dtype})'
        return f'vllm ({self.model_name}, prompt_mode {self.prompt_mode}{dtype})'


class PrefixCacheTally:
    """Prompt tokens and vLLM's ``num_cached_tokens`` (the prompt tokens its prefix cache served)
    over every output, in all and for the turns that extend a request's token record (turn 1 is
    a fresh prompt: only a shared system prompt or a repeated prompt can hit)."""

    def __init__(self) -> None:
        self.prompt_tokens = self.cached_tokens = 0
        self.later_prompt_tokens = self.later_cached_tokens = 0
        self.reported = False

    def add(self, prompt_tokens: int, cached_tokens: Optional[int], extends: bool) -> None:
        if cached_tokens is None:  # an engine (or stand-in) that does not count
            return
        self.reported = True
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += int(cached_tokens)
        if extends:
            self.later_prompt_tokens += prompt_tokens
            self.later_cached_tokens += int(cached_tokens)

    def figures(self) -> Optional[Dict[str, Any]]:
        if not self.reported:
            return None
        return {'prompt_tokens': self.prompt_tokens, 'cached_tokens': self.cached_tokens,
                'hit_rate': _ratio(self.cached_tokens, self.prompt_tokens),
                'hit_rate_after_turn_1': _ratio(self.later_cached_tokens, self.later_prompt_tokens)}


def _ratio(a: int, b: int) -> Optional[float]:
    return round(a / b, 4) if b else None


def _block_size(engine: Any) -> Optional[int]:
    """The KV-cache block size of a ``vllm.LLM`` or ``AsyncLLM`` (its ``cache_config``)."""
    for holder in (getattr(engine, 'llm_engine', None), engine):
        config = getattr(getattr(holder, 'vllm_config', None), 'cache_config', None) or getattr(
            holder, 'cache_config', None)
        size = getattr(config, 'block_size', None)
        if isinstance(size, int):
            return size
    return None


#: how long an engine's processes get to exit on close() before vLLM kills them (its default, 5 s,
#: is too short on a loaded CPU machine: the killed worker leaks a shared-memory block)
SHUTDOWN_TIMEOUT_S = 30.0


async def _shutdown_async_engine(llm: Any, timeout: float) -> None:
    """Shut an ``AsyncLLM`` down on its own loop: its output handler task is cancelled and awaited
    first (else it logs ``EngineDeadError`` when the engine stops, and the loop closes with the
    task pending: "Task was destroyed but it is pending!"), then the engine processes stop."""
    handler = getattr(llm, 'output_handler', None)
    if isinstance(handler, asyncio.Task) and not handler.done():
        handler.cancel()
        try:
            await handler
        except BaseException:  # noqa: BLE001 - its CancelledError (or the error it died of)
            pass
        llm.output_handler = None
    shutdown = getattr(llm, 'shutdown', None)
    if callable(shutdown):
        _call_with_timeout(shutdown, timeout)
        # AsyncLLM.__del__ calls self.shutdown() again; when the engine lives until interpreter
        # exit, vLLM's module globals are gone by then (``TypeError: 'NoneType' object is not
        # callable``). It is shut down: the instance's own no-op hides the method.
        llm.shutdown = _already_shut_down


def _already_shut_down(*args: Any, **kwargs: Any) -> None:
    """Stands in for an engine's ``shutdown`` once mtflow has shut it down."""


def _call_with_timeout(shutdown: Callable[..., Any], timeout: float) -> None:
    try:
        shutdown(timeout=timeout)
    except TypeError:  # an older vLLM: shutdown() takes no timeout
        shutdown()


NEEDS_VLLM = "the vllm backend needs vllm (pip install 'mtflow[vllm]', on a CUDA machine)"


def _wants_async_engine(model: Any, given: bool, prompt_mode: str, engine: str) -> bool:
    """Whether the backend runs an async engine (``engine``, or what a ``given`` engine object
    is); the options that cannot go together are a :class:`BackendError`."""
    if prompt_mode not in ('tokens', 'chat'):
        raise BackendError(f"vllm backend: prompt_mode must be 'tokens' or 'chat', not {prompt_mode!r}")
    if engine not in ('auto', 'llm', 'async'):
        raise BackendError(f"vllm backend: engine must be 'auto', 'llm' or 'async', not {engine!r}")
    is_async = engine == 'async' or (engine == 'auto' and given and _is_async_engine(model))
    if is_async and prompt_mode != 'tokens':
        raise BackendError("vllm backend: the async engine takes token prompts only (prompt_mode='tokens')")
    if given and is_async and not _is_async_engine(model):
        raise BackendError(f'vllm backend: engine=\'async\' needs an AsyncLLM (an async generate), '
                           f'got {type(model).__name__}')
    return is_async


def _model_path(model: Optional[str]) -> Tuple[str, str]:
    """``(what vLLM loads, the model's name)``: the embedded model is served from its converted copy."""
    name = model or 'embedded'
    if name in EMBEDDED_NAMES:
        return str(embedded_model_dir()), 'SmolLM2-135M-Instruct'
    return name, name


def _engine_kwargs(engine_kwargs: Optional[Dict[str, Any]], seed: Optional[int]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The engine's keyword arguments (the hardware's dtype and block size filled in where the
    user left them out, :mod:`mtflow.backends.vllm_defaults`) and the load report."""
    kwargs, report = choose_engine_kwargs(engine_kwargs, _vllm_device())
    if seed is not None:
        kwargs.setdefault('seed', seed)
    return kwargs, report


def _vllm_device() -> Optional[str]:
    """vLLM's platform (``'cpu'``, ``'cuda'``, ...); ``None`` when vLLM does not say."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # pragma: no cover - an older or partial vLLM
        return None
    device = getattr(current_platform, 'device_type', None)
    return str(device) if device else None


def _build_llm_engine(model: Optional[str], engine_kwargs: Optional[Dict[str, Any]], seed: Optional[int],
                      sampling_params_cls: Any) -> Tuple[Any, str, Any, Dict[str, Any], Optional[str]]:
    """A new ``vllm.LLM`` for ``model``: ``(engine, model name, SamplingParams class, load report,
    the logging config file its processes read or None)``."""
    try:
        import vllm
    except ImportError as exc:
        raise BackendError(NEEDS_VLLM) from exc
    path, name = _model_path(model)
    kwargs, report = _engine_kwargs(engine_kwargs, seed)
    try:
        with _engine_start(kwargs) as log_config_path:
            llm = vllm.LLM(model=path, **kwargs)
    except Exception as exc:
        raise BackendError(f'vllm cannot load model {name!r}: {_load_error_text(exc)}') from exc
    return llm, name, sampling_params_cls or vllm.SamplingParams, report, log_config_path


@contextlib.contextmanager
def _engine_start(kwargs: Dict[str, Any]) -> Iterator[Optional[str]]:
    """Around the construction of an engine the backend builds (:mod:`mtflow.backends.vllm_logs`):
    unless ``kwargs`` configure vLLM's logging themselves, a ``logging_config`` whose file adds
    the weight-dtype summary in every engine process (the file's path is yielded; removed here
    if the engine fails to start, else by ``close()``); and the workers' shutdown grace period
    in the environment the engine core inherits."""
    path = None
    if 'logging_config' not in kwargs and 'log_config_file' not in kwargs:
        try:
            from vllm.config.logging import LoggingConfig
        except Exception:  # an older vLLM: its log is left as it is
            LoggingConfig = None
        path = logging_config_file() if LoggingConfig is not None else None
        if path is not None:
            kwargs['logging_config'] = LoggingConfig(pylogging_config_file=path)
    try:
        with engine_process_env():
            yield path
    except BaseException:
        _remove(path)
        raise


def _remove(path: Optional[str]) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.remove(path)


def _served_model_name(engine: Any) -> str:
    """The model name of an engine object given by the caller (``LLM``, ``AsyncLLM`` or alike)."""
    config = getattr(getattr(engine, 'llm_engine', None), 'model_config', None) or getattr(
        engine, 'model_config', None)
    return str(getattr(config, 'model', None) or type(engine).__name__)


def _vllm_sampling_params() -> Any:
    try:
        from vllm import SamplingParams
    except ImportError as exc:
        raise BackendError('vllm backend: pass sampling_params_cls= when vllm is not importable') from exc
    return SamplingParams


def _is_async_engine(engine: Any) -> bool:
    """``AsyncLLM``/``AsyncLLMEngine``: ``generate`` is an async generator."""
    return inspect.isasyncgenfunction(getattr(engine, 'generate', None))


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _max_model_len(engine: Any) -> Optional[int]:
    """``max_model_len`` of a vLLM ``LLM`` (``llm_engine.model_config``) or ``AsyncLLM``
    (``model_config``); ``None`` when the engine does not say."""
    for holder in (getattr(getattr(engine, 'llm_engine', None), 'model_config', None),
                   getattr(engine, 'model_config', None)):
        length = context_length_of(holder, 'max_model_len')
        if length is not None:
            return length
    return None
