"""mtflow schedulers as ms-swift schedulers: ms-swift's driver (or ``swift rollout``) runs an
mtflow scheduler's hooks.

:func:`as_swift_scheduler` wraps any mtflow scheduler (a Python :class:`mtflow.Scheduler` class or
instance, a factory, or a YAML file loaded with :func:`mtflow.declarative.load_scheduler`) in a
subclass of ms-swift's ``MultiTurnScheduler``; :func:`register` puts it into ms-swift's
``multi_turns`` registry so GRPO finds it with ``--external_plugins schedulers/swift_plugin.py
--multi_turn_scheduler <name>``. In colocate mode ms-swift's driver calls its ``step`` /
``check_finished`` / ``on_turn_end``; in server mode (``swift rollout``) ms-swift calls its
``run`` once per request.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import swift.rollout.multi_turn as swift_multi_turn
from swift.rollout.multi_turn import MultiTurnScheduler

from mtflow.core.errors import UserError
from mtflow.core.machine import CHECK_FINISHED, ERROR
from mtflow.core.scheduler import is_default_hook
from mtflow.core.stop import decide_stop, default_check
from mtflow.declarative import load_scheduler
from mtflow.engine.branching import Branching
from mtflow.integrations.swift.converters import to_swift

__all__ = ['FINISH_REASON_KEY', 'SwiftSchedulerAdapter', 'as_swift_scheduler', 'register']

#: the ``rollout_infos`` key under which the adapter reports a request's mtflow finish reason
FINISH_REASON_KEY = 'mtflow_finish_reason'


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

    A scheduler with a ``branch`` (``docs/branching.md``) is refused when the adapter is built:
    ms-swift's trainers take one output per request, so its forks could only be dropped.
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
        if isinstance(getattr(inner, 'branch', None), Branching):
            raise UserError(f'mtflow scheduler {self.registered_name or type(inner).__name__!r} has a branch: section '
                            "(docs/branching.md), but ms-swift's trainers and driver take one output per request and "
                            'cannot fork it: remove branch: to train with ms-swift, or roll the trees out with mtflow '
                            '(mtflow run, Executor) and train on them (docs/training.md)')
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
            return bool(out), CHECK_FINISHED
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
            self._notify(infer_request, ERROR, current_turn)
            raise
        if isinstance(result, dict):
            next_request = result.get('infer_request')
            if next_request is not None and type(next_request).__module__.startswith('mtflow.'):
                result = {**result, 'infer_request': to_swift(next_request)}
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
            self._notify(infer_request, ERROR, 0)
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
    multi_turns = swift_multi_turn.multi_turns  # looked up per call: the registry may be replaced after import
    if name in multi_turns and not overwrite and not (isinstance(multi_turns[name], type)
                                                      and issubclass(multi_turns[name], SwiftSchedulerAdapter)):
        raise ValueError(f'ms-swift already has a multi-turn scheduler named {name!r} '
                         f'({multi_turns[name].__name__}); pass overwrite=True or choose another name')
    cls = as_swift_scheduler(source, name=name, **options)
    multi_turns[name] = cls
    return cls
