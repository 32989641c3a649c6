"""Resumable generations on vLLM's async engine (``VLLMBackend(resumable=True)``).

The contract of :mod:`mtflow.engine.resume` for a stream's ``on_update='resume'``, the way
AReaL interrupts vLLM: a single-request call runs one ``AsyncLLM.generate`` stream on the
backend's loop and notes each cumulative ``RequestOutput`` it yields (:func:`snapshot`). When the
driver cancels the call, the stream's generator is left, and the backend calls
``AsyncLLM.abort(request_id)`` (vLLM aborts a request whose output generator is closed too), so
the engine frees the sequence at once; the call raises
:class:`~mtflow.engine.resume.GenerationAborted` with the ids, logprobs and text of the last
output it had (:func:`partial_output`). The call issued again appends ``current_prefix().ids``
to the token prompt, so the engine continues from exactly the ids it sampled (its prefix cache
serves the prompt and the prefix), and returns only the new tokens; the turn's token record is
committed with the joined ids, on the caller's side, after the call returns.

A snapshot keeps the output's id count with the lists, not copies of them: vLLM's cumulative
lists only grow, so slicing them to that count when the call is cut reads a consistent prefix
from another thread without copying every step.
"""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

from mtflow.backends.base import BackendError, sampling_seeds
from mtflow.backends.images import refuse_images
from mtflow.backends.resumable import bridged, resumed_options
from mtflow.backends.tokens import commit_outputs
from mtflow.engine.resume import current_prefix, merged_output

__all__ = ['snapshot', 'partial_output', 'resumable_acall']


def snapshot(out: Any) -> Tuple[Any, int, str, bool]:
    """What a cumulative ``RequestOutput`` holds now: its completion, id count, text, finished."""
    completion = out.outputs[0]
    return completion, len(completion.token_ids or ()), completion.text or '', bool(getattr(out, 'finished', False))


def partial_output(snap: Optional[Tuple[Any, int, str, bool]], turn_prompt: List[int], options: Any, backend: Any,
                   build: Callable[..., Any]) -> Any:
    """The output a snapshot stands for (nothing yet: an empty output, with empty logprobs when
    they are asked for, so that the turn's logprobs still join)."""
    if snap is None:
        view = SimpleNamespace(token_ids=[], logprobs=[] if options.logprobs else None, text='', finish_reason=None)
    else:
        completion, n, text, finished = snap
        steps = completion.logprobs
        view = SimpleNamespace(token_ids=list(completion.token_ids[:n]), text=text,
                               logprobs=None if steps is None else list(steps[:n]),
                               finish_reason=completion.finish_reason if finished else None)
    return build(view, turn_prompt, options, backend.model_name, backend.tokenizer)


async def resumable_acall(backend: Any, request: Any, request_config: Any, build: Callable[..., Any]) -> List[Any]:
    """One resumable single-request call (``VLLMBackend.acall`` with ``resumable=True``);
    ``build`` makes a rollout output of a ``CompletionOutput`` (``choice_from_completion``)."""
    runner = backend._live_runner()
    prefix = current_prefix()
    options = resumed_options(request_config, backend.default_max_tokens, prefix)
    refuse_images(request, "vllm's async engine", 'use the LLM engine (engine: llm) for requests with images')
    plan = backend.prompter.plan(request)
    progress: Dict[str, Any] = {}
    t0 = time.perf_counter()
    stream = backend._stream(request, plan, options, sampling_seeds([request], options, backend.seed)[0],
                             prefix.ids if prefix is not None else None, progress)

    def cut() -> Tuple[bool, Any]:
        snap = progress.get('last')
        return bool(snap and snap[3]), partial_output(snap, plan.ids, options, backend, build)

    out = await bridged(stream, runner.loop, cut)
    if out is None:
        raise BackendError(f'request {getattr(request, "uuid", None)!r}: the vllm stream gave no output')
    whole = merged_output(prefix, [out])[0] if prefix is not None else out
    commit_outputs(backend.prompter, [request], [plan], [whole])
    backend._record([out], time.perf_counter() - t0)
    return [out]
