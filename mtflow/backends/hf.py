"""Hugging Face transformers backend: batched ``generate`` on CPU or GPU.

Each call renders every request with the tokenizer's chat template (the request's tools and
``chat_template_kwargs`` included; a continuation turn continues the last assistant message
with ``continue_final_message=True``), left-pads the prompts into micro-batches, runs one
``model.generate`` per micro-batch and returns, per request:

* ``token_ids``: the sampled tokens, up to and including the EOS token or the token that
  completed a stop string (as vLLM reports them: these are the tokens a trainer must score);
* ``content``: the decoded text of those tokens, cut *before* a stop string (OpenAI semantics)
  and without the EOS token, and without the other special tokens unless ``skip_special_tokens=False``
  (a parser that reads them: gpt-oss's harmony, Kimi-K2's sections; ``mtflow run`` sets it);
* ``logprobs`` (when the request config asks): the log-probability of each sampled token under
  the model's raw distribution (``logprobs_mode='raw'``, vLLM's default) or under the
  distribution actually sampled from, after temperature/top-k/top-p (``'processed'``);
* ``finish_reason``: ``'stop'`` (EOS or a stop string) or ``'length'`` (``max_tokens`` reached).

Stop strings are matched on the generated text only (never on the prompt), by a stopping
criterion that decodes the tail of each row; rows finish independently.

Prompts are token-in/token-out (:mod:`mtflow.backends.tokens`): turn 1 is rendered with the
chat template once; every later turn is generated from the previous prompt + the ids sampled at
the previous turn + the template's delta for what was appended, so the model is conditioned on
exactly the ids it sampled, and ``response.prompt_token_ids`` is that prompt. ``exact_ids=False``
renders every turn from text instead (the old behaviour, for comparison).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from mtflow.backends.base import (Backend, BackendError, SamplingOptions, build_output, context_length_of,
                                  flag_option, prepare_chat, sampling_seeds)
from mtflow.backends.chat_templates import resolve_chat_template
from mtflow.backends.cpu_threads import CpuThreads
from mtflow.backends.hf_resume import ChunkedRollout
from mtflow.backends.hf_sampling import RowSampler, row_seeds
from mtflow.backends.models import load_model
from mtflow.backends.text_sinks import Sink
from mtflow.backends.tokens import TokenPrompter, commit_outputs
from mtflow.backends.images import serving_the_others
from mtflow.backends.vision import VisionPrompter, generate_with_images, image_refusals

__all__ = ['HFBackend', 'render_prompt']


def render_prompt(tokenizer: Any, request: Any, chat_template: Optional[str] = None) -> List[int]:
    """The prompt token ids of ``request``: its chat rendered with the tokenizer's template
    (or ``chat_template``), with a generation prompt, or continuing the last assistant message."""
    chat = prepare_chat(request)
    kwargs: Dict[str, Any] = dict(chat.chat_template_kwargs)
    if chat.tools:
        kwargs['tools'] = chat.tools
    if chat_template is not None:
        kwargs['chat_template'] = chat_template
    try:
        text = tokenizer.apply_chat_template(
            chat.messages,
            tokenize=False,
            add_generation_prompt=not chat.continuation,
            continue_final_message=chat.continuation,
            **kwargs)
    except Exception as exc:
        raise BackendError(f'request {getattr(request, "uuid", None)!r}: the chat template failed: {exc}') from exc
    return tokenizer(text, add_special_tokens=False)['input_ids']


class _StopOnStrings:
    """A ``StoppingCriteria`` that ends a row when its *generated* text contains a stop string.

    Decodes only the last few generated tokens of each row (enough to hold the longest stop
    string), so its cost per step does not grow with the generation."""

    def __init__(self, tokenizer: Any, stop: Sequence[str], prompt_len: int, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.prompt_len = prompt_len
        self.skip_special_tokens = skip_special_tokens
        # a token is at least one byte; a character at most four
        self.window = 4 * max(len(s) for s in stop) + 2

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        gen = input_ids[:, self.prompt_len:]
        tail = gen[:, -self.window:].tolist()
        texts = self.tokenizer.batch_decode(tail, skip_special_tokens=self.skip_special_tokens)
        done = [any(s in t for s in self.stop) for t in texts]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class _RowStreamer:
    """``generate``'s streamer for a batch: each listened-to row's text so far, decoded as the
    row's output will be, to its sink after every step (transformers' own streamers take one row)."""

    def __init__(self, backend: 'HFBackend', prompts: List[List[int]], sinks: Sequence[Optional[Sink]]) -> None:
        self.backend, self.prompts, self.sinks = backend, prompts, list(sinks)
        self.rows: List[List[int]] = [[] for _ in prompts]
        self.done = [sink is None for sink in self.sinks]
        self.prompt_seen = False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:  # the first call hands the prompts
            self.prompt_seen = True
            return
        step = value.reshape(len(self.rows), -1).tolist()
        eos = self.backend.eos_ids
        for row, ids in enumerate(step):
            if self.done[row]:
                continue
            for t in ids:
                if t in eos:
                    self.done[row] = True
                    break
                self.rows[row].append(t)
            self.sinks[row](self.backend._decode(self.rows[row], self.prompts[row]))

    def end(self) -> None:
        pass


def _cpu_threads(threads: Union[int, str, None]) -> CpuThreads:
    """The backend's CPU thread count (:class:`~mtflow.backends.cpu_threads.CpuThreads`); a wrong
    ``threads`` is a :class:`BackendError`."""
    try:
        return CpuThreads(threads)
    except ValueError as exc:
        raise BackendError(f'hf backend: {exc}') from None


class HFBackend(Backend):
    """``rollout_fn`` over a transformers causal LM.

    Args:
        model: a loaded ``PreTrainedModel``, or what :func:`mtflow.backends.models.load_model`
            accepts (``'embedded'``, a local directory, a ``.gguf`` file, a hub id in the cache).
        tokenizer: the tokenizer (required when ``model`` is an object).
        max_batch_size: requests per ``generate`` call; larger calls are split.
        default_max_tokens: used when the request config has no ``max_tokens``.
        logprobs_mode: ``'raw'`` (the model's distribution) or ``'processed'`` (after
            temperature, top-k, top-p: the distribution sampled from).
        chat_template: overrides the tokenizer's template: a file, Jinja text or a bundled name (the
            run says which it used and checks it before the first turn, ``docs/declarative.md``).
        seed: the sampling seed of requests whose request config has none. Each request samples
            from its own generator, seeded from the seed and the request
            (:func:`mtflow.core.seeds.sampling_seed`): the same request samples the same tokens
            whatever batch it is in (:mod:`mtflow.backends.hf_sampling`). Also seeds torch once,
            when the backend is built. Without any seed, each request's generator is seeded from
            torch's global one.
        exact_ids: generate each turn from the exact ids of the turns before it (default); ``False``
            re-renders the conversation as text every turn.
        prefix_policy: for turns the template does not render prefix-stably (it strips earlier
            ``<think>``): ``'exact'`` keeps the exact ids, ``'rerender'`` renders from text and
            records that the prompt does not extend the previous one.
        device, dtype: where and how to load ``model`` when it is given by name.
        processor: a vision-language model's ``AutoProcessor``: requests with images are
            generated with their pixel values, their placeholders expanded as the processor
            does (:mod:`mtflow.backends.vision`); without one, a request with images fails alone (its
            output is the error naming it) and the call's other requests are generated.
        resumable, resume_chunk: ``async_rollout_fn()`` generates each single-request call in
            chunks of ``resume_chunk`` tokens, so a stream's ``on_update='resume'`` can cut it
            between chunks and continue it from its exact ids (:mod:`mtflow.backends.hf_resume`).
        threads: torch's thread count on CPU: ``'auto'`` (default) uses, for each generate, the
            cores no other process is running on (at least one; ``OMP_NUM_THREADS`` wins), so a
            loaded machine costs this backend its share of the cores rather than spinning OpenMP
            workers; an int fixes it; ``None`` leaves torch's setting alone
            (:mod:`mtflow.backends.cpu_threads`).
        skip_special_tokens: decode replies without the tokenizer's special tokens (default, as
            vLLM); ``False`` keeps them in the text (the EOS that ended a reply aside), for a parser
            that reads them (:meth:`keep_special_tokens`; ``mtflow run`` sets it for such a parser).
    """
    name = 'hf'
    streams_text = True

    def __init__(self,
                 model: Any = 'embedded',
                 tokenizer: Any = None,
                 *,
                 max_batch_size: int = 16,
                 default_max_tokens: int = 256,
                 logprobs_mode: str = 'raw',
                 chat_template: Optional[str] = None,
                 seed: Optional[int] = None,
                 device: Optional[str] = None,
                 dtype: Optional[str] = None,
                 exact_ids: bool = True,
                 prefix_policy: str = 'exact',
                 processor: Any = None,
                 resumable: bool = False,
                 resume_chunk: int = 16,
                 threads: Union[int, str, None] = 'auto',
                 skip_special_tokens: bool = True) -> None:
        super().__init__()
        self.cpu_threads = _cpu_threads(threads)
        import torch

        if not isinstance(resume_chunk, int) or isinstance(resume_chunk, bool) or resume_chunk < 1:
            raise BackendError(f'hf backend: resume_chunk must be a positive int, not {resume_chunk!r}')
        self.resumable, self.resume_chunk = bool(resumable), resume_chunk
        self.skip_special_tokens = flag_option(skip_special_tokens, 'hf backend: skip_special_tokens')

        if logprobs_mode not in ('raw', 'processed'):
            raise BackendError(f"hf backend: logprobs_mode must be 'raw' or 'processed', not {logprobs_mode!r}")
        template = resolve_chat_template(chat_template, where='hf backend: chat_template')  # before the model loads
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise BackendError(f'hf backend: max_batch_size must be a positive int, not {max_batch_size!r}')
        self.load_info: Dict[str, Any] = {}
        if isinstance(model, (str, type(None))):
            loaded = load_model(model or 'embedded', device=device, dtype=dtype)
            model, tokenizer, self.load_info = loaded.model, tokenizer or loaded.tokenizer, loaded.info
            self.model_name = loaded.name
        else:
            tokenizer = tokenizer if tokenizer is not None or processor is None else processor.tokenizer
            if tokenizer is None:
                raise BackendError('hf backend: a model object needs its tokenizer (tokenizer=...)')
            self.model_name = getattr(getattr(model, 'config', None), '_name_or_path', '') or type(model).__name__
            if device is not None:
                model = model.to(device)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.default_max_tokens = default_max_tokens
        self.logprobs_mode = logprobs_mode
        self.chat_template = template.text
        self.prompter = TokenPrompter(tokenizer, template, policy=prefix_policy, exact=exact_ids) \
            if processor is None else VisionPrompter(processor, template, policy=prefix_policy, exact=exact_ids)
        #: the model's context in tokens (its config's ``max_position_embeddings``; context budgets read it)
        self.context_length = context_length_of(getattr(model, 'config', None), 'max_position_embeddings')
        self.eos_ids = self._eos_ids()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.seed = seed
        if seed is not None:
            torch.manual_seed(seed)

    def async_rollout_fn(self, **options: Any) -> Any:
        """As :meth:`Backend.async_rollout_fn`; with ``resumable=True`` the chunked, resumable
        one (:class:`~mtflow.backends.hf_resume.ChunkedRollout`; close it when done)."""
        if not self.resumable:
            return super().async_rollout_fn(**options)
        batcher = {k: v for k, v in options.items() if k in ('max_wait_s', 'settle_s', 'max_delay_s') and v is not None}
        return ChunkedRollout(self, self.resume_chunk, **batcher)

    def keep_special_tokens(self) -> Optional[str]:
        """Decode replies with their special tokens from now on (see ``skip_special_tokens``)."""
        self.skip_special_tokens = False
        return None

    def count_prompt_tokens(self, request: Any) -> int:
        """The exact length of the prompt ``request``'s next turn would send (context budgets)."""
        return len(self.prompter.plan(request).ids)

    def _eos_ids(self) -> List[int]:
        ids: List[int] = []
        gen_eos = getattr(getattr(self.model, 'generation_config', None), 'eos_token_id', None)
        for value in (self.tokenizer.eos_token_id, gen_eos):
            if value is None:
                continue
            for v in (value if isinstance(value, (list, tuple)) else [value]):
                if v not in ids:
                    ids.append(int(v))
        if not ids:
            raise BackendError('hf backend: the tokenizer and the model define no EOS token')
        return ids

    # ---- one call ------------------------------------------------------------------------------
    def generate(self, requests: List[Any], options: SamplingOptions) -> List[Any]:
        refusals = image_refusals(self.prompter, requests, 'the hf backend without a processor',
                                  'give processor= (AutoProcessor) for a vision-language model')
        if any(refusals):  # only the requests with images fail; the call's others are generated
            return serving_the_others(requests, refusals, lambda others: self.generate(others, options))
        plans = [self.prompter.plan(r) for r in requests]
        seeds = sampling_seeds(requests, options, self.seed)
        if any(getattr(r, 'images', None) for r in requests):
            outputs = generate_with_images(self, requests, plans, options, seeds)
        else:
            outputs = self.generate_ids([p.ids for p in plans], options, seeds,
                                        sinks=[self.text_sinks.get(r) for r in requests])
        commit_outputs(self.prompter, requests, plans, outputs)
        return outputs

    def generate_ids(self, prompts: List[List[int]], options: SamplingOptions,
                     seeds: Optional[Sequence[Optional[int]]] = None,
                     sinks: Optional[Sequence[Optional[Sink]]] = None) -> List[Any]:
        """Generate from token prompts as they are (one output per prompt, in order); ``seeds``:
        each prompt's sampling seed (:func:`~mtflow.backends.base.sampling_seeds`; ``None``: drawn);
        ``sinks``: each prompt's text sink, if someone listens (:mod:`.text_sinks`)."""
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # similar lengths pad less
        outputs: List[Any] = [None] * len(prompts)
        seeds = row_seeds(seeds, len(prompts)) if not options.greedy else None
        for start in range(0, len(order), self.max_batch_size):
            idx = order[start:start + self.max_batch_size]
            batch_seeds = [seeds[i] for i in idx] if seeds is not None else None
            batch_sinks = [sinks[i] for i in idx] if sinks is not None and any(sinks[i] for i in idx) else None
            for i, out in zip(idx, self._generate_batch([prompts[i] for i in idx], options, seeds=batch_seeds,
                                                        sinks=batch_sinks)):
                outputs[i] = out
        return outputs

    def _generation_kwargs(self, options: SamplingOptions, sampler: Optional[RowSampler]) -> Dict[str, Any]:
        """``generate``'s arguments: greedy steps, and for a sampled turn the last logits
        processor ``sampler``, which samples each row with its own generator and leaves the greedy
        step only its token (:mod:`mtflow.backends.hf_sampling`; its warpers replace
        ``generate``'s, which a greedy ``generate`` does not apply)."""
        from transformers import GenerationConfig, LogitsProcessorList

        cfg: Dict[str, Any] = dict(
            max_new_tokens=options.max_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            num_beams=1,
            num_return_sequences=1,
            do_sample=False,
            # generation_config.json of a model may set them; they only apply to do_sample
            temperature=None, top_p=None, top_k=None,
            repetition_penalty=options.repetition_penalty,
            return_dict_in_generate=True,
        )
        if options.logprobs and self.logprobs_mode == 'raw':
            cfg['output_logits'] = True
        elif options.logprobs and sampler is None:  # greedy, processed: the scores after the processors
            cfg['output_scores'] = True
        kwargs: Dict[str, Any] = {'generation_config': GenerationConfig(**cfg)}
        if sampler is not None:
            kwargs['logits_processor'] = LogitsProcessorList([sampler])
        return kwargs

    def _generate_batch(self, prompts: List[List[int]], options: SamplingOptions,
                        inputs: Optional[Dict[str, Any]] = None, seeds: Optional[Sequence[int]] = None,
                        sinks: Optional[Sequence[Optional[Sink]]] = None) -> List[Any]:
        """One ``generate`` over ``prompts`` (left-padded); ``seeds``: each row's sampling seed
        (a sampled turn; ``None``: drawn from torch's generator); ``sinks``: each row's text sink."""
        import torch

        width = max(len(p) for p in prompts)
        device = self.model.device
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            input_ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[row, width - len(p):] = 1
        sampler = None
        if not options.greedy:
            sampler = RowSampler(row_seeds(seeds, len(prompts)), options.temperature, options.top_k, options.top_p,
                                 options.min_p, keep=options.logprobs and self.logprobs_mode == 'processed')
        kwargs = self._generation_kwargs(options, sampler)
        if options.stop:
            from transformers import StoppingCriteriaList

            kwargs['stopping_criteria'] = StoppingCriteriaList([_StopOnStrings(self.tokenizer, options.stop, width,
                                                                               self.skip_special_tokens)])
        if getattr(device, 'type', device) == 'cpu':
            self.cpu_threads.apply()
        if sinks is not None:
            kwargs['streamer'] = _RowStreamer(self, prompts, sinks)
        with torch.inference_mode():
            more = {k: v.to(device) if hasattr(v, 'to') else v for k, v in (inputs or {}).items()}  # images
            out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device), **more,
                                      **kwargs)
        generated = out.sequences[:, width:].cpu()
        steps = out.logits if self.logprobs_mode == 'raw' else (sampler.steps if sampler is not None else out.scores)
        logprob_rows, top_rows = self._sampled_logprobs(generated, steps, options) if options.logprobs else (None, None)
        results = []
        for row, prompt in enumerate(prompts):
            ids, text, reason = self._finish_row(generated[row].tolist(), prompt, options)
            lps = tokens = top = None
            if logprob_rows is not None:
                lps = logprob_rows[row][:len(ids)]
                tokens = self.tokenizer.batch_decode([[t] for t in ids])
                top = [t for t in top_rows[row][:len(ids)]] if top_rows is not None else None
            results.append(
                build_output(
                    text,
                    ids,
                    reason,
                    logprobs=lps,
                    tokens=tokens,
                    top_logprobs=top,
                    model=self.model_name,
                    prompt_tokens=len(prompt),
                    prompt_token_ids=list(prompt)))
        return results

    def _sampled_logprobs(self, generated: Any, steps: Sequence[Any],
                          options: SamplingOptions) -> Tuple[List[List[float]], Optional[List[List[list]]]]:
        """Per row, the logprob of each sampled token (and the top alternatives when asked)."""
        import torch

        n = generated.shape[1]
        values = torch.empty((generated.shape[0], n), dtype=torch.float32)
        tops: Optional[List[List[list]]] = [[] for _ in range(generated.shape[0])] if options.top_logprobs else None
        for t in range(n):
            logp = torch.log_softmax(steps[t].float(), dim=-1).cpu()
            values[:, t] = logp.gather(1, generated[:, t:t + 1]).squeeze(1)
            if tops is not None:
                top_v, top_i = logp.topk(options.top_logprobs, dim=-1)
                for row in range(generated.shape[0]):
                    ids = top_i[row].tolist()
                    toks = self.tokenizer.batch_decode([[i] for i in ids])
                    tops[row].append([{'token': tk, 'logprob': float(v)} for tk, v in zip(toks, top_v[row].tolist())])
        return values.tolist(), tops

    def _finish_row(self, tokens: List[int], prompt: List[int], options: SamplingOptions) -> Tuple[List[int], str, str]:
        """Cut one row's generated tokens where it really ended; its text and finish reason."""
        eos_at = next((i for i, t in enumerate(tokens) if t in self.eos_ids), None)
        body = tokens if eos_at is None else tokens[:eos_at]
        if options.stop:
            cut = self._stop_cut(body, prompt, options.stop)
            if cut is not None:
                k, text = cut
                return tokens[:k], text, 'stop'
        if eos_at is not None:
            return tokens[:eos_at + 1], self._decode(body, prompt), 'stop'
        return tokens, self._decode(tokens, prompt), 'length'

    def _decode(self, ids: List[int], prompt: List[int]) -> str:
        """Decode generated ids as a continuation of the prompt (tokenizers that drop a leading
        space when decoding a sequence on its own get it right this way)."""
        tok, skip = self.tokenizer, self.skip_special_tokens
        ctx = prompt[-4:]
        if not ctx:
            return tok.decode(ids, skip_special_tokens=skip)
        head = tok.decode(ctx, skip_special_tokens=skip)
        full = tok.decode(ctx + ids, skip_special_tokens=skip)
        if full.startswith(head) and '\ufffd' not in head:
            return full[len(head):]
        return tok.decode(ids, skip_special_tokens=skip)

    def _stop_cut(self, body: List[int], prompt: List[int], stop: Sequence[str]) -> Optional[Tuple[int, str]]:
        """The fewest tokens whose text contains a stop string, and the text before it."""
        text = self._decode(body, prompt)
        if not any(s in text for s in stop):
            return None
        lo, hi = 1, len(body)
        while lo < hi:  # smallest k with a stop string in decode(body[:k])
            mid = (lo + hi) // 2
            if any(s in self._decode(body[:mid], prompt) for s in stop):
                hi = mid
            else:
                lo = mid + 1
        text = self._decode(body[:lo], prompt)
        stop_at = min(text.find(s) for s in stop if s in text)
        return lo, text[:stop_at]

    def describe(self) -> str:
        device = getattr(self.model, 'device', 'cpu')
        return f'hf ({self.model_name} on {device})'

