"""Stand-ins with ``vllm.LLM``'s and ``vllm.SamplingParams``' signatures, so the vLLM backend's
translation is tested without vLLM (which needs CUDA here).

``FakeLLM.generate`` and ``FakeLLM.chat`` take exactly vLLM's parameters (an unknown keyword
fails as it would against vLLM) and really generate, greedily, with a tiny transformers model;
``chat`` renders conversations the way vLLM's does (the tokenizer's chat template with
``add_generation_prompt``/``continue_final_message``/``tools``/``chat_template_kwargs``, then
``encode(add_special_tokens=False)``). ``generate`` takes token prompts only (vLLM's
``TokensPrompt``: ``{'prompt_token_ids': [...]}``); a text prompt is an error here, since vLLM
would tokenize it again. ``forced`` makes the model emit given id sequences (one per generated
completion, in order) instead of its greedy choice, to provoke a sampled split that re-tokenizing
would change. Outputs have the shape of vLLM's ``RequestOutput``, ``CompletionOutput`` and
``Logprob``. Every call and every ``SamplingParams`` is recorded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Union

from mtflow.core.images import from_content_parts


@dataclass
class SamplingParams:
    """``vllm.SamplingParams``' constructor fields (vLLM 0.8-0.11) with its defaults."""
    n: int = 1
    best_of: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    bad_words: Optional[List[str]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: Optional[Any] = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: Optional[int] = None
    output_kind: Any = None
    guided_decoding: Any = None
    logit_bias: Optional[Dict[int, float]] = None
    allowed_token_ids: Optional[List[int]] = None
    extra_args: Optional[Dict[str, Any]] = None


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[Dict[int, Logprob]]]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    prompt_logprobs: Any
    outputs: List[CompletionOutput]
    finished: bool = True
    num_cached_tokens: Optional[int] = None


@dataclass
class FakeLLM:
    model: Any
    tokenizer: Any
    calls: List[Dict[str, Any]] = field(default_factory=list)
    finish_reason_override: Optional[str] = None
    forced: List[List[int]] = field(default_factory=list)
    #: the engine's context, as vLLM reports it (``llm.llm_engine.model_config.max_model_len``)
    max_model_len: Optional[int] = None
    #: a prefix cache of this block size (``None``: outputs carry no ``num_cached_tokens``, as an
    #: engine that does not count): a prompt's cached tokens are the whole blocks it shares with an
    #: earlier prompt, at least one token left to compute, as vLLM's prefix cache counts them
    block_size: Optional[int] = None
    seen: List[List[int]] = field(default_factory=list)
    #: a Qwen2-VL ``AutoProcessor``: a token prompt's images are expanded as vLLM 0.32 does it, each
    #: image's first placeholder token (``<|image_pad|>``) replaced by the image's pads, any pads
    #: after it kept (so a prompt sent with 4 pads runs with 7), and the expanded ids are the
    #: output's ``prompt_token_ids``
    processor: Any = None

    @property
    def llm_engine(self) -> Any:
        return SimpleNamespace(model_config=SimpleNamespace(max_model_len=self.max_model_len),
                               vllm_config=SimpleNamespace(cache_config=SimpleNamespace(block_size=self.block_size)))

    def _cached(self, prompt: List[int]) -> Optional[int]:
        if self.block_size is None:
            return None
        best = 0
        for old in self.seen:
            n = 0
            while n < min(len(old), len(prompt)) and old[n] == prompt[n]:
                n += 1
            best = max(best, n)
        self.seen.append(list(prompt))
        return min(best, len(prompt) - 1) // self.block_size * self.block_size

    def get_tokenizer(self, lora_request: Any = None) -> Any:
        return self.tokenizer

    def generate(self, prompts: Any, sampling_params: Any = None, use_tqdm: bool = True, lora_request: Any = None,
                 priority: Optional[List[int]] = None) -> List[RequestOutput]:
        if isinstance(prompts, dict):
            prompts = [prompts]
        for p in prompts:
            assert isinstance(p, dict) and set(p) - {'multi_modal_data'} == {'prompt_token_ids'}, \
                f'not a token prompt: {p!r}'
            # vLLM's multimodal token prompt: {'image': [PIL images]}, recorded in ``calls`` (the
            # tiny model generates from the ids, pads included, without the pixels)
            assert set(p.get('multi_modal_data') or {}) <= {'image'}, p
            assert all(isinstance(t, int) for t in p['prompt_token_ids']), 'prompt_token_ids must be ints'
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        assert len(params) == len(prompts), 'vLLM pairs a list of SamplingParams one by one with the prompts'
        self.calls.append({'method': 'generate', 'prompts': prompts, 'params': params, 'use_tqdm': use_tqdm})
        ran = [self._expand(p) for p in prompts]
        outs = [self._one(i, ids, sp) for i, (ids, sp) in enumerate(zip(ran, params))]
        for o, ids in zip(outs, ran):
            o.num_cached_tokens = self._cached(ids)
        return outs

    def _expand(self, prompt: Dict[str, Any]) -> List[int]:
        ids = list(prompt['prompt_token_ids'])
        images = (prompt.get('multi_modal_data') or {}).get('image') or []
        if not images or self.processor is None:
            return ids
        pad = self.processor.image_token_id
        merge = self.processor.image_processor.merge_size
        grids = self.processor.image_processor(images=list(images), return_tensors='pt')['image_grid_thw']
        counts = [int(g.prod()) // merge**2 for g in grids]
        out: List[int] = []
        for t in ids:  # the first pad of each image is its placeholder; any pads after it stay
            out.extend([pad] * counts.pop(0) if t == pad and counts else [t])
        return out

    def chat(self, messages: Any, sampling_params: Any = None, use_tqdm: bool = True, lora_request: Any = None,
             chat_template: Optional[str] = None, chat_template_content_format: str = 'auto',
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: Optional[List[Dict[str, Any]]] = None, chat_template_kwargs: Optional[Dict[str, Any]] = None,
             mm_processor_kwargs: Optional[Dict[str, Any]] = None) -> List[RequestOutput]:
        assert not (add_generation_prompt and continue_final_message), 'vLLM rejects both at once'
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        kwargs = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message, tools=tools)
        kwargs.update(chat_template_kwargs or {})
        prompts = []
        for conv in conversations:
            if any(isinstance(m.get('content'), list) for m in conv):
                # image content parts (vLLM's multimodal chat): recorded in ``calls``; the tiny
                # text model sees each image's <image> placeholder as text
                conv, _ = from_content_parts(conv)
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, **kwargs)
            prompts.append({'prompt_token_ids': self.tokenizer.encode(text, add_special_tokens=False)})
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        assert len(params) == len(prompts), 'vLLM pairs a list of SamplingParams one by one with the conversations'
        self.calls.append({'method': 'chat', 'conversations': conversations, **kwargs,
                           'chat_template_kwargs': chat_template_kwargs, 'params': params})
        return [self._one(i, p['prompt_token_ids'], sp) for i, (p, sp) in enumerate(zip(prompts, params))]

    def _one(self, index: int, prompt: List[int], sp: SamplingParams) -> RequestOutput:
        import torch

        eos = self.tokenizer.eos_token_id
        ids: List[int] = []
        steps: List[Dict[int, Logprob]] = []
        reason = 'length'
        forced = self.forced.pop(0) if self.forced else None
        with torch.no_grad():
            for k in range(sp.max_tokens if forced is None else min(sp.max_tokens, len(forced))):
                logits = self.model(torch.tensor([prompt + ids])).logits[0, -1].float()
                logp = torch.log_softmax(logits, -1)
                token = int(logp.argmax()) if forced is None else forced[k]
                if sp.logprobs is not None:
                    entry = {token: Logprob(float(logp[token]), 1, self.tokenizer.decode([token]))}
                    if sp.logprobs:
                        vals, idx = logp.topk(sp.logprobs)
                        for r, (v, t) in enumerate(zip(vals.tolist(), idx.tolist()), 1):
                            entry.setdefault(int(t), Logprob(v, r, self.tokenizer.decode([t])))
                    steps.append(entry)
                ids.append(token)
                if token == eos:
                    reason = 'stop'
                    break
        shown = ids[:-1] if reason == 'stop' and ids and ids[-1] == eos else ids  # vLLM leaves the stop token out
        text = self.tokenizer.decode(shown, skip_special_tokens=sp.skip_special_tokens)
        out = CompletionOutput(0, text, ids, None, steps if sp.logprobs is not None else None,
                               self.finish_reason_override or reason)
        return RequestOutput(str(index), None, list(prompt), None, [out])


@dataclass
class FakeAsyncLLM:
    """A stand-in with ``vllm.v1.engine.async_llm.AsyncLLM``'s methods and signatures:
    ``generate(prompt, sampling_params, request_id, ...)`` is an async generator that yields
    cumulative ``RequestOutput``s (vLLM's default ``output_kind``), one per generated token,
    ``finished=True`` on the last; ``abort``/``get_tokenizer`` are coroutines. Like the real engine
    it belongs to the first event loop it runs on (a call from another loop fails), and it counts
    the streams in flight. ``delay_per_token`` (seconds, for request ids containing a key) makes a
    request slow without blocking the loop; ``hold`` (a ``threading.Event`` per key) keeps such a
    request from finishing until the test sets it."""
    model: Any
    tokenizer: Any
    delay_per_token: Dict[str, float] = field(default_factory=dict)
    hold: Dict[str, Any] = field(default_factory=dict)
    requests: List[Dict[str, Any]] = field(default_factory=list)
    aborted: List[str] = field(default_factory=list)
    finished_order: List[str] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    _loop: Any = None
    #: the engine's context, as vLLM's ``AsyncLLM.model_config.max_model_len`` reports it
    max_model_len: Optional[int] = None

    @property
    def model_config(self) -> Any:
        return SimpleNamespace(max_model_len=self.max_model_len)

    def _check_loop(self) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        assert loop is self._loop, 'AsyncLLM is bound to the event loop it first ran on'

    async def get_tokenizer(self, lora_request: Any = None) -> Any:
        return self.tokenizer

    async def abort(self, request_id: Union[str, List[str]]) -> None:
        self.aborted.extend([request_id] if isinstance(request_id, str) else list(request_id))

    def shutdown(self) -> None:
        pass

    async def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str, lora_request: Any = None,
                       tokenization_kwargs: Optional[Dict[str, Any]] = None, trace_headers: Any = None,
                       priority: int = 0, data_parallel_rank: Optional[int] = None):
        import asyncio

        self._check_loop()
        assert isinstance(prompt, dict) and 'prompt_token_ids' in prompt, 'a TokensPrompt'
        self.requests.append({'request_id': request_id, 'prompt': prompt, 'params': sampling_params})
        full = FakeLLM(self.model, self.tokenizer)._one(0, prompt['prompt_token_ids'], sampling_params)
        done = full.outputs[0]
        delay = next((d for k, d in self.delay_per_token.items() if k in request_id), 0.0)
        gate = next((g for k, g in self.hold.items() if k in request_id), None)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for n in range(1, len(done.token_ids) + 1):
                await asyncio.sleep(delay)
                last = n == len(done.token_ids)
                while last and gate is not None and not gate.is_set():
                    await asyncio.sleep(0.005)
                ids = done.token_ids[:n]
                text = done.text if last else self.tokenizer.decode(ids, skip_special_tokens=True)
                out = CompletionOutput(0, text, list(ids), None,
                                       None if done.logprobs is None else done.logprobs[:n],
                                       done.finish_reason if last else None)
                if last:
                    self.finished_order.append(request_id)
                yield RequestOutput(request_id, None, list(prompt['prompt_token_ids']), None, [out], finished=last)
        finally:
            self.in_flight -= 1
