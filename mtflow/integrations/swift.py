"""mtflow inside ms-swift (tested against ms-swift 4.6.0), both ways.

1. **mtflow schedulers as ms-swift schedulers.** :func:`as_swift_scheduler` wraps any mtflow
   scheduler (a Python :class:`mtflow.Scheduler` class or instance, a factory, or a YAML file
   loaded with :func:`mtflow.declarative.load_scheduler`) in a subclass of ms-swift's
   ``MultiTurnScheduler``; :func:`register` puts it into ms-swift's ``multi_turns`` registry so
   GRPO finds it with ``--external_plugins schedulers/swift_plugin.py --multi_turn_scheduler <name>``.
   In colocate mode ms-swift's driver calls its ``step`` / ``check_finished`` / ``on_turn_end``;
   in server mode (``swift rollout``) ms-swift calls its ``run`` once per request.
2. **mtflow's executor inside ms-swift.** :func:`install` makes ms-swift's trainers (HF GRPO/GKD,
   Megatron, Ray) call mtflow's executor wherever they called
   ``swift.rollout.agent_loop.run_multi_turn``, so their runs get per-request states, finish
   reasons and traces; :func:`uninstall` undoes it.
3. **Conversions.** :func:`to_swift` / :func:`from_swift` convert requests, configs, messages,
   choices, responses and outputs between mtflow's pydantic models and ms-swift's types without
   losing a field (attributes a class does not declare travel too).

This module imports ms-swift (seconds); ``import mtflow`` never imports it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import swift.infer_engine.protocol as _sp
from swift.rollout.multi_turn import MultiTurnScheduler

from mtflow.core import machine as M
from mtflow.core import protocol as _mp
from mtflow.core.errors import MultiTurnRolloutError
from mtflow.engine.executor import Executor, identity_gather
from mtflow.core.stop import decide_stop, default_check
from mtflow.accounting.choose import keeps_messages_as_ids
from mtflow.accounting.swift46 import Swift46Accounting

__all__ = [
    'to_swift', 'from_swift', 'SwiftSchedulerAdapter', 'as_swift_scheduler', 'register', 'install', 'uninstall',
    'installed', 'InstallState', 'FINISH_REASON_KEY'
]

#: the ``rollout_infos`` key under which the adapter reports a request's mtflow finish reason
FINISH_REASON_KEY = 'mtflow_finish_reason'

# ------------------------------------------------------------------------------------------------
# conversions
# ------------------------------------------------------------------------------------------------

#: nested fields that hold protocol objects: class name -> {field: (shape, class name)}
_NESTED: Dict[str, Dict[str, Tuple[str, str]]] = {
    'RolloutOutput': {'response': ('one', 'ChatCompletionResponse')},
    'ChatCompletionResponse': {'choices': ('list', 'ChatCompletionResponseChoice'), 'usage': ('one', 'UsageInfo')},
    'ChatCompletionResponseChoice': {'message': ('one', 'ChatMessage')},
    'ChatMessage': {'tool_calls': ('list', 'ChatCompletionMessageToolCall')},
    'ChatCompletionMessageToolCall': {'function': ('one', 'Function')},
}
_NAMES = ('RolloutInferRequest', 'RequestConfig', 'Function', 'ChatCompletionMessageToolCall', 'ChatMessage',
          'UsageInfo', 'ChatCompletionResponseChoice', 'ChatCompletionResponse', 'RolloutOutput')
_ALIASES = {'InferRequest': 'RolloutInferRequest'}  # ms-swift's plain request becomes a rollout request


def _fields_of(obj: Any) -> Dict[str, Any]:
    """Every field of a pydantic model or dataclass, plus any attribute it carries undeclared."""
    if hasattr(type(obj), 'model_fields'):
        values = {k: getattr(obj, k) for k in type(obj).model_fields}
        values.update(getattr(obj, '__pydantic_extra__', None) or {})
        extra = {k: v for k, v in vars(obj).items() if k not in values and not k.startswith('_')}
        values.update(extra)
        return values
    if dataclasses.is_dataclass(obj):
        values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        values.update({k: v for k, v in vars(obj).items() if k not in values and not k.startswith('_')})
        return values
    raise TypeError(f'cannot convert {type(obj).__name__}: not a protocol object')


def _build(cls: type, values: Dict[str, Any]) -> Any:
    """An instance of ``cls`` holding exactly ``values`` (no validation rewrites a value; fields
    the class does not declare are kept as attributes / pydantic extras)."""
    if hasattr(cls, 'model_fields'):
        if cls.model_config.get('extra') == 'allow':
            return cls.model_construct(**values)
        known = {k: v for k, v in values.items() if k in cls.model_fields}
        obj = cls.model_construct(**known)
        for k, v in values.items():
            if k not in known:
                object.__setattr__(obj, k, v)
        return obj
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    obj = cls(**{k: v for k, v in values.items() if k in init})
    for k, v in values.items():
        if k not in init:
            setattr(obj, k, v)
    return obj


def _convert(obj: Any, module: Any, name: Optional[str] = None) -> Any:
    if obj is None:
        return None
    name = name or _ALIASES.get(type(obj).__name__, type(obj).__name__)
    if name not in _NAMES:
        raise TypeError(f'cannot convert {type(obj).__name__}: not one of {", ".join(_NAMES)}')
    values = _fields_of(obj)
    for field, (shape, sub) in _NESTED.get(name, {}).items():
        value = values.get(field)
        if value is None:
            continue
        if shape == 'list':
            values[field] = [_convert(v, module, sub) if not isinstance(v, dict) else v for v in value]
        elif not isinstance(value, dict):
            values[field] = _convert(value, module, sub)
    return _build(getattr(module, name), values)


def to_swift(obj: Any) -> Any:
    """The ms-swift counterpart of an mtflow protocol object (or a list of them).

    Objects that already are ms-swift's pass through unchanged. Values are not copied (a
    request's ``messages`` list is the same list), and nothing is validated away: e.g. a
    ``RequestConfig(stop=None)`` stays ``None``."""
    if isinstance(obj, list):
        return [to_swift(o) for o in obj]
    if obj is None or type(obj).__module__.startswith('swift.'):
        return obj
    return _convert(obj, _sp)


def from_swift(obj: Any) -> Any:
    """The mtflow counterpart of an ms-swift protocol object (or a list of them); fields mtflow's
    classes do not declare (e.g. ``add_eos``, ``routed_experts``, ``images_size``) are kept as
    pydantic extras, so :func:`to_swift` restores them."""
    if isinstance(obj, list):
        return [from_swift(o) for o in obj]
    if obj is None or type(obj).__module__.startswith('mtflow.'):
        return obj
    return _convert(obj, _mp)


# ------------------------------------------------------------------------------------------------
# mtflow schedulers as ms-swift schedulers
# ------------------------------------------------------------------------------------------------


def _run_coroutine(coro: Any) -> Any:
    """Finish ``coro`` from synchronous code, also when an event loop is running in this thread
    (server mode): then it runs on a private loop in a worker thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(coro)
        finally:
            loop.close()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _base_check(choice: Any, turn: int, max_turns: Optional[int]) -> Tuple[bool, str]:
    """The default stop rule (ms-swift's and mtflow's), with the reason mtflow reports for it."""
    return default_check(choice.finish_reason, turn, max_turns)


def _overrides(obj: Any, name: str) -> bool:
    """Whether ``obj``'s ``name`` hook is its own (not mtflow's or ms-swift's no-op default)."""
    from mtflow.core.scheduler import is_default_hook
    fn = getattr(obj, name, None)
    return fn is not None and not is_default_hook(fn, name)


class SwiftSchedulerAdapter(MultiTurnScheduler):
    """An mtflow scheduler seen by ms-swift as a ``MultiTurnScheduler``.

    ms-swift constructs it with ``(infer_engine=..., max_turns=..., tokenizer=..., template=...)``
    (colocate: ``_prepare_scheduler``; server: ``get_rollout_engine_type``); the wrapped mtflow
    scheduler is built by :meth:`make_inner` from the class attribute ``inner_factory``.

    What ms-swift's driver does not have, the adapter supplies:

    - ``on_request_finished(request, reason, turn)`` of the mtflow scheduler is called once per
      request: when its stop is decided (the adapter makes the same decision the driver makes,
      from ``on_turn_end``'s ``done``, ``check_finished`` and ``max_turns``), when its ``step``
      raises, or when ``run`` ends; under mtflow's executor the executor's own call is forwarded
      instead, never twice;
    - the finish reason (``stop_rule:<name>`` from an ``on_turn_end`` ``finish_reason``,
      ``done_by_hook``, ``check_finished``, ``length``, ``max_turns``) is reported in the
      request's ``rollout_infos`` under :data:`FINISH_REASON_KEY`;
    - async ``step`` / ``check_finished`` are run to completion (ms-swift calls them
      synchronously); an mtflow request returned by ``step`` is converted to ms-swift's type.

    Token accounting is ms-swift 4.6's (the adapter inherits ``get_response_token_data`` and the
    id-backed message methods), under ms-swift's driver and under mtflow's executor alike.
    """

    #: builds the mtflow scheduler: ``inner_factory(**kwargs)`` with the kwargs ms-swift passed
    inner_factory: Callable[..., Any] = None  # type: ignore[assignment]
    #: the name it is registered under (for messages)
    registered_name: str = ''
    #: per-request bookkeeping is keyed by uuid (see _key)
    requires_unique_uuids = True

    def __init__(self,
                 infer_engine: Any = None,
                 max_turns: Optional[int] = None,
                 *args: Any,
                 tokenizer: Any = None,
                 template: Any = None,
                 inner: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(infer_engine, max_turns, *args, tokenizer=tokenizer, template=template, **kwargs)
        if inner is None:
            inner = self.make_inner(infer_engine=infer_engine, max_turns=max_turns, tokenizer=tokenizer,
                                    template=template, **kwargs)
        self.inner = inner
        if max_turns is None:  # ms-swift passed none: the mtflow scheduler's own limit applies
            self.max_turns = getattr(inner, 'max_turns', None)
        if getattr(inner, '_tokenizer', 1) is None and tokenizer is not None:
            inner._tokenizer = tokenizer
        self.finish_reasons = tuple(getattr(inner, 'finish_reasons', ()) or ())
        self._has_turn_end = _overrides(inner, 'on_turn_end')
        self._has_check = _overrides(inner, 'check_finished')
        self._has_start = _overrides(inner, 'on_trajectory_start')
        self._has_end = _overrides(inner, 'on_trajectory_end')
        self._has_finished = _overrides(inner, 'on_request_finished')
        self._lock = threading.Lock()
        # id(request) -> (request, turn, checked): the decision on_turn_end made, for check_finished
        # (the request is held so that its id cannot be reused while the entry exists)
        self._decided: 'OrderedDict[int, Tuple[Any, int, bool]]' = OrderedDict()
        self._notified: 'OrderedDict[Any, str]' = OrderedDict()  # requests whose on_request_finished ran

    @classmethod
    def make_inner(cls, **kwargs: Any) -> Any:
        factory = cls.inner_factory
        if factory is None:
            raise TypeError(f'{cls.__name__} has no inner_factory: build it with mtflow.integrations.swift.'
                            f'as_swift_scheduler(...)')
        return factory(**kwargs)

    # ---- bookkeeping -------------------------------------------------------------------------
    @staticmethod
    def _key(request: Any) -> Any:
        return getattr(request, 'uuid', None) or id(request)

    def _notify(self, request: Any, reason: str, turn: int) -> None:
        """Call the mtflow scheduler's ``on_request_finished`` once for this request."""
        key = self._key(request)
        with self._lock:
            if key in self._notified:
                return
            self._notified[key] = reason
            while len(self._notified) > 65536:  # under ms-swift's driver nobody consumes them
                self._notified.popitem(last=False)
        if self._has_finished:
            result = self.inner.on_request_finished(request, reason, turn)
            if inspect.isawaitable(result):
                _run_coroutine(result)

    # ---- the hooks ms-swift calls ------------------------------------------------------------
    async def on_trajectory_start(self, requests: List[Any]) -> None:
        with self._lock:
            for req in requests:
                self._notified.pop(self._key(req), None)
        if self._has_start:
            result = self.inner.on_trajectory_start(requests)
            if inspect.isawaitable(result):
                await result

    async def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        result: Dict[str, Any] = {}
        if self._has_turn_end:
            out = self.inner.on_turn_end(infer_request, response_choice, current_turn)
            if inspect.isawaitable(out):
                out = await out
            if out is not None and not isinstance(out, dict):
                raise TypeError(f'{type(self.inner).__name__}.on_turn_end must return a dict, got '
                                f'{type(out).__name__} (request {self._key(infer_request)}, turn {current_turn})')
            result = dict(out or {})
        # Decide now, with the one stop rule (mtflow.core.stop.decide_stop), what the driver will do:
        # the hook's 'done' wins, else check_finished, then max_turns. The decision is handed to
        # the driver as 'done' (and to check_finished, which it calls too), so that the driver
        # finishes the request exactly when the mtflow scheduler's on_request_finished runs, even
        # when the bound is the mtflow scheduler's own max_turns.
        checked, check_reason = await self._check(infer_request, response_choice, current_turn)
        stop, reason = decide_stop(result, checked, check_reason, current_turn, self.max_turns)
        result['done'] = stop
        if stop:
            result['finish_reason'] = reason
        with self._lock:
            self._decided[id(infer_request)] = (infer_request, current_turn, stop)
            while len(self._decided) > 65536:  # entries left by a batch that raised mid-turn
                self._decided.popitem(last=False)
        if stop:
            infos = dict(result.get('rollout_infos') or {})
            infos[FINISH_REASON_KEY] = reason
            result['rollout_infos'] = infos
            self._notify(infer_request, reason, current_turn)
        return result

    async def _check(self, request: Any, choice: Any, turn: int) -> Tuple[bool, str]:
        if self._has_check:
            out = self.inner.check_finished(request, choice, turn)
            if inspect.isawaitable(out):
                out = await out
            return bool(out), M.CHECK_FINISHED
        return _base_check(choice, turn, self.max_turns)

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        with self._lock:
            decided = self._decided.pop(id(infer_request), None)
        if decided is not None and decided[0] is infer_request and decided[1] == current_turn:
            return decided[2]
        return _run_coroutine(self._check(infer_request, response_choice, current_turn))[0]

    async def on_trajectory_end(self, requests: List[Any], error: Optional[BaseException]) -> None:
        """Forwarded to the mtflow scheduler (newer ms-swift and mtflow's executor call it after
        a batch, so environments close)."""
        if self._has_end:
            result = self.inner.on_trajectory_end(requests, error)
            if inspect.isawaitable(result):
                await result

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        try:
            result = self.inner.step(infer_request, response_choice, current_turn)
            if inspect.isawaitable(result):
                result = _run_coroutine(result)
        except Exception:
            self._notify(infer_request, M.ERROR, current_turn)
            raise
        if isinstance(result, dict):
            nxt = result.get('infer_request')
            if nxt is not None and type(nxt).__module__.startswith('mtflow.'):
                result = {**result, 'infer_request': to_swift(nxt)}
        return result

    def on_request_finished(self, infer_request: Any, reason: str, turn: int) -> None:
        """Called by mtflow's executor on every finish path; forwarded once."""
        key = self._key(infer_request)
        with self._lock:
            done_before = self._notified.pop(key, None) is not None
        if not done_before:
            with self._lock:
                self._notified[key] = reason
            if self._has_finished:
                result = self.inner.on_request_finished(infer_request, reason, turn)
                if inspect.isawaitable(result):
                    _run_coroutine(result)
            with self._lock:
                self._notified.pop(key, None)

    async def run(self, infer_request: Any, request_config: Any, **kwargs: Any) -> Any:
        """Server mode (``swift rollout``): ms-swift's per-request loop with this scheduler's
        hooks; the mtflow scheduler's ``on_request_finished`` runs on every path."""
        try:
            output = await super().run(infer_request, request_config, **kwargs)
        except Exception:
            self._notify(infer_request, M.ERROR, 0)
            with self._lock:
                self._notified.pop(self._key(infer_request), None)
            raise
        with self._lock:
            self._notified.pop(self._key(infer_request), None)
        return output


def _factory_for(source: Any, **options: Any) -> Callable[..., Any]:
    """A factory ``(**swift_kwargs) -> mtflow scheduler`` for ``source``: a YAML path, a class, a
    callable, or an instance (shared)."""
    if isinstance(source, (str, os.PathLike)) and str(source).endswith(('.yaml', '.yml')):
        path = str(source)

        def from_yaml(**kw: Any) -> Any:
            from mtflow.declarative import load_scheduler
            kw = {**kw, **options}
            max_turns = kw.pop('max_turns', None)  # the YAML's own max_turns, unless ms-swift sets one
            scheduler = load_scheduler(path, **{k: v for k, v in kw.items() if v is not None})
            if max_turns is not None:
                scheduler.max_turns = max_turns
            return scheduler

        return from_yaml
    if isinstance(source, type):

        def from_class(**kw: Any) -> Any:
            params = inspect.signature(source.__init__).parameters
            var_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
            accepted = {k: v for k, v in {**kw, **options}.items() if var_kw or k in params}
            return source(**accepted)

        return from_class
    if callable(source) and not callable(getattr(source, 'step', None)):
        return lambda **kw: source(**{**kw, **options})
    if callable(getattr(source, 'step', None)):
        return lambda **kw: source
    raise TypeError(f'cannot make an ms-swift scheduler from {source!r}: give a YAML path, a scheduler class, '
                    f'an instance, or a factory')


def as_swift_scheduler(source: Any, name: Optional[str] = None, **options: Any) -> type:
    """A ``MultiTurnScheduler`` subclass wrapping the mtflow scheduler ``source``.

    ``source``: a YAML file (``mtflow.declarative.load_scheduler``), an mtflow scheduler class
    (built with the kwargs ms-swift passes that its ``__init__`` accepts), a factory
    ``(**kwargs) -> scheduler``, or an instance (shared by every adapter built). ``options`` are
    passed to the factory each time."""
    label = name or (Path(str(source)).stem if isinstance(source, (str, os.PathLike)) else
                     getattr(source, '__name__', type(source).__name__))
    factory = _factory_for(source, **options)
    cls_name = 'Mtflow_' + ''.join(c if c.isalnum() else '_' for c in str(label))
    return type(cls_name, (SwiftSchedulerAdapter, ), {
        'inner_factory': staticmethod(factory),
        'registered_name': str(label),
        '__module__': __name__,
        '__doc__': f'ms-swift MultiTurnScheduler running the mtflow scheduler {label!r}.'
    })


def register(name: str, source: Any, *, overwrite: bool = False, **options: Any) -> type:
    """Register ``source`` in ms-swift's ``multi_turns`` registry under ``name`` (what
    ``--multi_turn_scheduler name`` looks up) and return the adapter class."""
    from swift.rollout.multi_turn import multi_turns
    if name in multi_turns and not overwrite and not (isinstance(multi_turns[name], type)
                                                      and issubclass(multi_turns[name], SwiftSchedulerAdapter)):
        raise ValueError(f'ms-swift already has a multi-turn scheduler named {name!r} '
                         f'({multi_turns[name].__name__}); pass overwrite=True or choose another name')
    cls = as_swift_scheduler(source, name=name, **options)
    multi_turns[name] = cls
    return cls


# ------------------------------------------------------------------------------------------------
# mtflow's executor inside ms-swift
# ------------------------------------------------------------------------------------------------

#: every module that binds ``run_multi_turn`` at import time (ms-swift 4.6.0)
PATCH_TARGETS = (
    'swift.rollout.agent_loop',  # the definition
    'swift.rollout',  # the lazy package re-export (what later ``from swift.rollout import`` gets)
    'swift.rlhf_trainers.rollout_mixin',  # HF GRPO/GKD colocate: _colocate_multi_turn_infer
    'swift.megatron.trainers.rollout_mixin',  # Megatron GRPO
    'swift.ray.megatron.grpo_trainer',  # Ray Megatron GRPO, driver-side loop
    'swift.ray.megatron.gkd_trainer',  # Ray Megatron GKD
)


@dataclasses.dataclass
class InstallState:
    """What :func:`install` did: the functions it replaced (to restore) and its settings."""
    originals: Dict[str, Any]
    trace: bool
    on_error: str
    on_trace: Optional[Callable[[Any], None]]
    trace_dir: Optional[str]
    runs: int = 0
    last_result: Any = None


_STATE: Optional[InstallState] = None
_STATE_LOCK = threading.Lock()


def _rank() -> int:
    try:
        import torch.distributed as dist
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:  # pragma: no cover - torch missing or broken
        return 0


def _keep_run(state: Optional['InstallState'], rank: int, result: Any) -> None:
    """Hand a finished run's trace to what :func:`install` asked for (``trace_dir``, ``on_trace``)."""
    if state is None:
        return
    with _STATE_LOCK:
        state.runs += 1
        run_no = state.runs
        state.last_result = result
    if result.trace is not None:
        if state.trace_dir:
            Path(state.trace_dir).mkdir(parents=True, exist_ok=True)
            result.trace.write_jsonl(Path(state.trace_dir) / f'rank{rank}-run{run_no:06d}.jsonl')
        if state.on_trace is not None:
            state.on_trace(result.trace)


def _accounting_for(scheduler: Any) -> Any:
    """ms-swift 4.6's accounting for schedulers that keep assistant messages as ids (every
    ``MultiTurnScheduler``), else the contract's (the executor's default)."""
    if keeps_messages_as_ids(scheduler):
        return Swift46Accounting(scheduler)
    return None


def mtflow_run_multi_turn(requests: List[Any],
                          first_turn_outputs: List[Any],
                          scheduler: Any,
                          rollout_fn: Callable[[List[Any], Any], Any],
                          request_config: Any,
                          max_turns: Optional[int] = None,
                          gather_fn: Callable[[List[bool]], List[bool]] = identity_gather) -> List[Any]:
    """What :func:`install` puts in place of ms-swift's ``run_multi_turn``: the same signature and
    outputs, run by mtflow's executor (ms-swift 4.6 accounting for ms-swift schedulers), with the
    run's trace handed to ``on_trace`` / written under ``trace_dir``."""
    state = _STATE
    ex = Executor(
        scheduler,
        rollout_fn,
        request_config,
        max_turns=max_turns,
        gather_fn=gather_fn,
        trace=state.trace if state else True,
        on_error=state.on_error if state else 'raise',
        rank=_rank(),
        output_cls=_sp.RolloutOutput,
        accounting=_accounting_for(scheduler),
        scheduler_bounds_run=False)  # ms-swift's semantics: the caller's max_turns bounds the driver
    try:
        result = ex.run(requests, first_turn_outputs)
    except MultiTurnRolloutError as err:  # the run is complete: keep its trace, then raise
        _keep_run(state, ex.rank, err.result)
        raise
    _keep_run(state, ex.rank, result)
    return result.outputs


def install(*,
            trace: bool = True,
            on_error: str = 'raise',
            on_trace: Optional[Callable[[Any], None]] = None,
            trace_dir: Optional[Union[str, os.PathLike]] = None) -> InstallState:
    """Make ms-swift's trainers run multi-turn rollouts with mtflow's executor (opt-in).

    Replaces ``run_multi_turn`` in every module of :data:`PATCH_TARGETS` that is loaded, and in
    ``swift.rollout`` / ``swift.rollout.agent_loop`` so that modules imported later bind mtflow's.
    Modules that cannot be imported here (Megatron, Ray extras not installed) are not imported;
    if they are imported later they take the patched name from ``swift.rollout``.

    ``on_error='raise'`` raises one :class:`mtflow.MultiTurnRolloutError` after the loop (every
    rank stays in step); ``'return'`` keeps the failed requests' outputs (reason ``error`` in the
    trace, ``mtflow_error`` in ``rollout_infos``). ``on_trace(trace)`` is called with each run's
    :class:`mtflow.Trace`; ``trace_dir`` gets one JSONL file per run and rank. Idempotent."""
    global _STATE
    import importlib
    import sys
    if on_error not in ('raise', 'return'):
        raise ValueError(f"on_error must be 'raise' or 'return', not {on_error!r}")
    with _STATE_LOCK:
        originals = dict(_STATE.originals) if _STATE is not None else {}
        for target in PATCH_TARGETS[:2]:  # the definition and the re-export; trainers bind from these
            importlib.import_module(target)
        for target in PATCH_TARGETS:
            module = sys.modules.get(target)
            if module is None:
                continue
            current = getattr(module, 'run_multi_turn', None)
            if current is None:
                continue
            if current is not mtflow_run_multi_turn:
                originals[target] = current
            setattr(module, 'run_multi_turn', mtflow_run_multi_turn)
        _STATE = InstallState(originals, trace, on_error, on_trace, None if trace_dir is None else str(trace_dir))
        return _STATE


def uninstall() -> None:
    """Put ms-swift's own ``run_multi_turn`` back everywhere :func:`install` replaced it."""
    global _STATE
    import sys
    with _STATE_LOCK:
        if _STATE is None:
            return
        for target, original in _STATE.originals.items():
            module = sys.modules.get(target)
            if module is not None:
                setattr(module, 'run_multi_turn', original)
        for target in PATCH_TARGETS:  # modules imported after install() bound mtflow's too
            module = sys.modules.get(target)
            if module is not None and getattr(module, 'run_multi_turn', None) is mtflow_run_multi_turn:
                setattr(module, 'run_multi_turn', _STATE.originals.get('swift.rollout.agent_loop'))
        _STATE = None


def installed() -> Optional[InstallState]:
    """The current :class:`InstallState`, or ``None`` when ms-swift runs its own driver."""
    return _STATE
