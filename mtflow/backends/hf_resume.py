"""Resumable generations on the HF backend (``HFBackend(resumable=True)``): generation in chunks.

``model.generate`` runs a batch to its end in a thread and cannot be stopped in between, so a
resumable HF call generates its turn in chunks of ``resume_chunk`` new tokens: each chunk is one
single-request call of a :class:`~mtflow.backends.batcher.DynamicBatcher` (so the chunks of
concurrent requests still share ``generate`` batches), from the prompt plus the ids so far. The
ids, logprobs and text are kept on the caller's side after each chunk. When the driver cancels
the call (a stream's ``on_update='resume'`` at a weight update), the chunk in flight is left to
finish in its batch and dropped, and the call raises
:class:`~mtflow.engine.resume.GenerationAborted` with the chunks it had: at most
``resume_chunk - 1`` tokens of the cut chunk are lost (generated again under the new weights),
which bounds what a cut wastes. The call issued again appends ``current_prefix().ids`` to the
prompt. EOS, ``max_tokens`` and stop strings are checked on the whole turn after every chunk
with the backend's own rule (``_finish_row``), so a stop string across two chunks still stops.

A chunk boundary is a fresh prefill of the prompt and the ids so far, not a step of the same
KV cache, so a chunked turn agrees with an unchunked one to float rounding (greedy ids alike
unless two logits tie that closely). A sampled chunk draws from its request's own generator
(:mod:`mtflow.backends.hf_sampling`), seeded from the request's sampling seed and how many ids
its prompt already has, so a chunk samples alike whichever chunks share its batch.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, List, Optional

from mtflow.backends.base import BackendError, build_output, sampling_seeds
from mtflow.backends.batcher import DynamicBatcher
from mtflow.backends.resumable import resumed_options
from mtflow.backends.tokens import commit_outputs
from mtflow.core.seeds import stable_seed
from mtflow.engine.resume import GenerationAborted, current_prefix, merged_output

__all__ = ['ChunkedRollout']


@dataclasses.dataclass
class _Chunk:
    """One chunk's prompt, named by its request's uuid (the batcher tracks requests by it), and
    its sampling seed (``None``: drawn from torch's generator)."""
    uuid: Any
    ids: List[int]
    seed: Optional[int] = None


class ChunkedRollout:
    """The HF backend's async ``rollout_fn`` with ``resumable=True`` (see the module docstring)."""

    resumable = True

    def __init__(self, backend: Any, chunk: int, **batcher_options: Any) -> None:
        self.backend, self.chunk = backend, chunk
        self.__wrapped__ = backend
        self.tokenizer = backend.tokenizer
        self.stats = backend.stats
        self.batcher = DynamicBatcher(self._generate_chunks, max_batch_size=backend.max_batch_size, **batcher_options)

    def _generate_chunks(self, chunks: List[_Chunk], options: Any) -> List[Any]:
        return self.backend.generate_ids([c.ids for c in chunks], options, [c.seed for c in chunks])

    async def __call__(self, requests: List[Any], request_config: Any = None) -> List[Any]:
        if len(requests) != 1:  # a lockstep-style call: the plain path, in a thread
            return await asyncio.to_thread(self.backend, requests, request_config)
        request = requests[0]
        backend = self.backend
        if getattr(request, 'images', None):
            raise BackendError(f'request {getattr(request, "uuid", None)!r}: resumable HF generation takes text only; '
                               'use resumable=False for requests with images')
        prefix = current_prefix()
        options = resumed_options(request_config, backend.default_max_tokens, prefix)
        plan = backend.prompter.plan(request)
        prompt = list(plan.ids) + (prefix.ids if prefix is not None else [])
        ids: List[int] = []
        lps: List[float] = []
        tokens: List[str] = []
        reason: Optional[str] = None
        text: Optional[str] = None
        t0 = time.perf_counter()
        seed = sampling_seeds([request], options, backend.seed)[0]
        chunk_options = dataclasses.replace(options, stop=None, seed=None)  # the seed goes with each chunk
        try:
            while reason is None:
                n = min(self.chunk, options.max_tokens - len(ids))
                opts = dataclasses.replace(chunk_options, max_tokens=n)
                chunk_seed = None if seed is None else stable_seed(seed, len(prompt) + len(ids))
                out = (await self.batcher([_Chunk(getattr(request, 'uuid', None), prompt + ids, chunk_seed)], opts))[0]
                choice = out.response.choices[0]
                ids += list(choice.token_ids or [])
                items = (choice.logprobs or {}).get('content') or [] if options.logprobs else []
                lps += [float(i['logprob']) for i in items]
                tokens += [i.get('token', '') for i in items]
                kept, whole, end = backend._finish_row(ids, prompt, options)
                if end == 'stop' or len(ids) >= options.max_tokens or not choice.token_ids:
                    ids, reason, text = kept, end, whole
        except asyncio.CancelledError:
            raise GenerationAborted([self._output(ids, lps, tokens, None, None, plan.ids, prompt, options)]) from None
        out = self._output(ids, lps, tokens, reason, text, plan.ids, prompt, options)
        commit_outputs(backend.prompter, [request], [plan], [merged_output(prefix, [out])[0] if prefix else out])
        backend._record([out], time.perf_counter() - t0)
        return [out]

    def _output(self, ids: List[int], lps: List[float], tokens: List[str], reason: Optional[str], text: Optional[str],
                turn_prompt: List[int], prompt: List[int], options: Any) -> Any:
        """The call's output (only its own ids); ``text`` as the finish rule cut it, else decoded."""
        if text is None:
            body = ids[:-1] if ids and ids[-1] in self.backend.eos_ids else ids
            text = self.backend._decode(body, prompt)
        logprobs = lps[:len(ids)] if options.logprobs else None
        return build_output(text, list(ids), reason, logprobs=logprobs,
                            tokens=tokens[:len(ids)] if options.logprobs else None, model=self.backend.model_name,
                            prompt_tokens=len(turn_prompt), prompt_token_ids=list(turn_prompt))

    def forget(self, uuid: Any) -> None:
        forget = getattr(self.backend, 'forget', None)
        if callable(forget):
            forget(uuid)

    def close(self) -> None:
        self.batcher.close()

    def __enter__(self) -> 'ChunkedRollout':
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def describe(self) -> str:
        return f'{self.backend.describe()} + resumable chunks of {self.chunk} tokens ({self.batcher.describe()})'
