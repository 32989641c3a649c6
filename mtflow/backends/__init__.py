"""Inference backends: ``rollout_fn`` factories for the executor.

=============  ================================================  ====================================
name           class                                             model
=============  ================================================  ====================================
``hf``         :class:`~mtflow.backends.hf.HFBackend`            transformers ``generate`` (CPU/GPU)
``openai``     :class:`~mtflow.backends.openai_server.OpenAIBackend`  any ``/v1/chat/completions`` server
``vllm``       :class:`~mtflow.backends.vllm_engine.VLLMBackend`  ``vllm.LLM`` (colocated)
``scripted``   :class:`~mtflow.backends.scripted.ScriptedBackend`  outputs replayed from a JSONL file
``swift``      :class:`~mtflow.backends.swift_engine.SwiftBackend`  an ms-swift ``InferEngine``
=============  ================================================  ====================================

Every backend subclasses :class:`~mtflow.backends.base.Backend`. Nothing heavy is imported here:
each backend module imports its engine (torch, vLLM, httpx, ms-swift) when it is built.
``make_backend('hf', model='embedded')`` is what ``mtflow run`` calls.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Dict, Optional, Tuple

from mtflow.backends.base import Backend, BackendError, BackendStats, SamplingOptions, build_output, prepare_chat, sampling_options

__all__ = ['BACKENDS', 'Backend', 'BackendError', 'BackendStats', 'SamplingOptions', 'build_output', 'make_backend',
           'prepare_chat', 'sampling_options', 'backend_names', 'backend_options', 'split_options']

#: name -> (module, class); aliases map to the same entry
BACKENDS: Dict[str, Tuple[str, str]] = {
    'hf': ('mtflow.backends.hf', 'HFBackend'),
    'openai': ('mtflow.backends.openai_server', 'OpenAIBackend'),
    'vllm': ('mtflow.backends.vllm_engine', 'VLLMBackend'),
    'scripted': ('mtflow.backends.scripted', 'ScriptedBackend'),
    'swift': ('mtflow.backends.swift_engine', 'SwiftBackend'),
}
ALIASES = {'transformers': 'hf', 'huggingface': 'hf', 'openai_server': 'openai', 'server': 'openai'}


def backend_names() -> Tuple[str, ...]:
    return tuple(BACKENDS)


def resolve_backend(name: str) -> type:
    """The backend class registered as ``name`` (or an alias), imported on demand."""
    key = ALIASES.get(name, name)
    if key not in BACKENDS:
        raise BackendError(f'unknown backend {name!r}; choose one of: {", ".join(BACKENDS)}')
    module_name, cls_name = BACKENDS[key]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise BackendError(f'backend {name!r} is not available in this build') from exc
        raise BackendError(f'backend {name!r} needs the package {exc.name!r}, which is not installed') from exc
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise BackendError(f'backend {name!r}: {module_name} has no {cls_name}')
    return cls


def backend_options(name: str) -> Tuple[Tuple[str, ...], bool]:
    """The keyword options backend ``name`` takes, and whether it takes any (``**kwargs``)."""
    params = inspect.signature(resolve_backend(name).__init__).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = tuple(p for p, v in params.items() if p != 'self' and v.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                                                inspect.Parameter.VAR_KEYWORD))
    return named, accepts_any


def split_options(name: str, options: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(kept, dropped)``: the ``options`` backend ``name`` accepts, and the others."""
    named, accepts_any = backend_options(name)
    kept = {k: v for k, v in options.items() if accepts_any or k in named}
    return kept, {k: v for k, v in options.items() if k not in kept}


def make_backend(name: str, model: Optional[str] = None, **options: Any) -> Any:
    """Build backend ``name`` with ``options`` (its constructor's keyword arguments); ``model``
    is passed to backends that take one. Unknown options are a :class:`BackendError` that lists
    the accepted ones."""
    cls = resolve_backend(name)
    params = inspect.signature(cls.__init__).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not accepts_any:
        known = [p for p in params if p not in ('self', ) and params[p].kind is not inspect.Parameter.VAR_POSITIONAL]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise BackendError(f'backend {name!r} has no option(s) {", ".join(unknown)}; '
                               f'its options are: {", ".join(known)}')
    if model is not None:
        if 'model' in params or accepts_any:
            options['model'] = model
        elif 'path' in params and 'path' not in options:  # scripted: the "model" is the script file
            options['path'] = model
    return cls(**options)
