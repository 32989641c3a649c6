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

A backend of one's own is named the way tools and environments are: by a ``'module:Class'``
reference (``backend: my_backends:EchoBackend`` in a run config, the module found next to the
config file too), or registered under a name with :func:`register_backend`.
"""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from mtflow.core.registry import Registry, entry_point_names, load_entry_point, resolve_reference
from mtflow.backends.base import Backend, BackendError, BackendStats, SamplingOptions, build_output, prepare_chat, sampling_options

__all__ = ['BACKENDS', 'Backend', 'BackendError', 'BackendStats', 'SamplingOptions', 'build_output', 'make_backend',
           'prepare_chat', 'sampling_options', 'backend_names', 'backend_options', 'split_options',
           'register_backend', 'is_backend_reference', 'check_backend_name']

#: what a registered name stands for: ``(module, class)`` imported on demand, a ``'module:Class'``
#: reference, or the class itself
BackendTarget = Union[Tuple[str, str], str, type]

#: name -> target, in the one registry kind of mtflow (``core/registry.py``): installed packages add
#: backends under the entry-point group ``mtflow.backends`` (``name = module:Class``), imported
#: only when a config names one; aliases are other names of the built-in ones
BACKENDS: Registry = Registry(
    'mtflow.backends', "unknown backend {name}; choose one of: {known}, or name your own class as 'module:Class'",
    builtins={
        'hf': ('mtflow.backends.hf', 'HFBackend'),
        'openai': ('mtflow.backends.openai_server', 'OpenAIBackend'),
        'vllm': ('mtflow.backends.vllm_engine', 'VLLMBackend'),
        'scripted': ('mtflow.backends.scripted', 'ScriptedBackend'),
        'swift': ('mtflow.backends.swift_engine', 'SwiftBackend'),
    },
    aliases={'transformers': 'hf', 'huggingface': 'hf', 'openai_server': 'openai', 'server': 'openai'})


def backend_names() -> Tuple[str, ...]:
    """The registered names (the built-in ones first) and those installed packages declare."""
    return tuple(dict.fromkeys(list(BACKENDS) + entry_point_names('mtflow.backends')))


def register_backend(name: str, target: BackendTarget) -> None:
    """Make ``target`` (a backend class, a ``'module:Class'`` reference or ``(module, class)``)
    available as ``backend: name``. A name already taken is refused, as a tool's is."""
    if not isinstance(name, str) or not name or ':' in name:
        raise BackendError(f"a backend name must be a non-empty string without ':' (got {name!r})")
    if name in BACKENDS:
        raise BackendError(f'backend name {name!r} is taken; choose another')
    if not (isinstance(target, (type, str)) or (isinstance(target, tuple) and len(target) == 2)):
        raise BackendError(f"backend {name!r}: register a class, a 'module:Class' reference or (module, class); "
                           f'got {type(target).__name__}')
    BACKENDS[name] = target


def is_backend_reference(name: str) -> bool:
    """``'module:Class'`` (a backend named by where it lives, not by a registered name)."""
    return isinstance(name, str) and ':' in name


def check_backend_name(name: str) -> str:
    """``name`` if it is a registered name, an alias or a ``'module:Class'`` reference (resolved when
    the backend is built); else a :class:`BackendError` listing the choices."""
    if name in BACKENDS or is_backend_reference(name) or _from_entry_point(name):
        return name
    raise BackendError(f"unknown backend {name!r}; choose one of: {', '.join(backend_names())}, or name your own "
                       "class as 'module:Class'")


def _from_entry_point(name: str) -> bool:
    """Register backend ``name`` from an installed package's ``mtflow.backends`` entry point."""
    try:
        found = isinstance(name, str) and load_entry_point('mtflow.backends', name)
    except ImportError as exc:
        raise BackendError(str(exc)) from None
    return bool(found) and name in BACKENDS


def _import_target(name: str, target: BackendTarget, base_dir: Optional[Union[str, Path]]) -> Any:
    if isinstance(target, type):
        return target
    if isinstance(target, str):
        try:
            return resolve_reference(target, str(base_dir) if base_dir is not None else None)
        except (ImportError, AttributeError) as exc:
            raise BackendError(f'backend {name!r}: {exc}') from None
    module_name, cls_name = target
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


def resolve_backend(name: str, base_dir: Optional[Union[str, Path]] = None) -> type:
    """The backend class registered as ``name`` (or an alias), or named by a ``'module:Class'``
    reference (looked up next to ``base_dir`` too), imported on demand."""
    check_backend_name(name)
    cls = _import_target(name, name if is_backend_reference(name) else BACKENDS[name], base_dir)
    if not callable(cls):
        raise BackendError(f'backend {name!r} is a {type(cls).__name__}, not a backend class or factory')
    return cls


def _parameters(cls: Any) -> Dict[str, inspect.Parameter]:
    """A class's constructor parameters, or a factory function's."""
    target = cls.__init__ if isinstance(cls, type) else cls
    return dict(inspect.signature(target).parameters)


def backend_options(name: str, base_dir: Optional[Union[str, Path]] = None) -> Tuple[Tuple[str, ...], bool]:
    """The keyword options backend ``name`` takes, and whether it takes any (``**kwargs``)."""
    params = _parameters(resolve_backend(name, base_dir))
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = tuple(p for p, v in params.items() if p != 'self' and v.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                                                inspect.Parameter.VAR_KEYWORD))
    return named, accepts_any


def split_options(name: str, options: Dict[str, Any],
                  base_dir: Optional[Union[str, Path]] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(kept, dropped)``: the ``options`` backend ``name`` accepts, and the others."""
    named, accepts_any = backend_options(name, base_dir)
    kept = {k: v for k, v in options.items() if accepts_any or k in named}
    return kept, {k: v for k, v in options.items() if k not in kept}


def make_backend(name: str, model: Optional[str] = None, base_dir: Optional[Union[str, Path]] = None,
                 **options: Any) -> Any:
    """Build backend ``name`` with ``options`` (its constructor's keyword arguments); ``model``
    is passed to backends that take one; ``base_dir`` is where a ``'module:Class'`` reference's
    module may also be found (the run config's directory). Unknown options are a
    :class:`BackendError` that lists the accepted ones."""
    cls = resolve_backend(name, base_dir)
    params = _parameters(cls)
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
    backend = cls(**options)
    if not callable(backend):
        raise BackendError(f'backend {name!r} built a {type(backend).__name__}, which is not callable: a backend '
                           'is a rollout_fn (subclass mtflow.backends.Backend and implement generate)')
    return backend
