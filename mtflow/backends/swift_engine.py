"""Any ms-swift ``InferEngine`` as mtflow's ``rollout_fn``.

``SwiftBackend(engine)`` wraps ``TransformersEngine`` (CPU), ``VllmEngine`` / ``GRPOVllmEngine``
(GPU), ``SglangEngine``, ``LmdeployEngine`` or an ``InferClient`` alike: it converts mtflow's
requests and ``RequestConfig`` to ms-swift's types (losing no field, see
``mtflow.integrations.swift.converters``), calls ``engine.infer`` once per turn with the whole
batch, and returns one ``RolloutOutput`` per request.

ms-swift engines report sampled token ids only when ``return_details`` is on; token accounting
needs them, so the backend turns it on unless told otherwise (``return_details=False``).
ms-swift's engines understand requests whose last message is an assistant message (including
the ``content=None`` placeholder ms-swift's own loops send), so requests are passed as they are.
"""
from __future__ import annotations

import copy
import time
from typing import Any, List, Literal, Optional

from mtflow.backends.base import Backend, BackendError
from mtflow.core.protocol import RolloutOutput

__all__ = ['SwiftBackend']


class SwiftBackend(Backend):
    """``rollout_fn`` over an ms-swift ``InferEngine``.

    Args:
        engine: an ms-swift ``InferEngine`` instance, or a model id/path for which a
            ``TransformersEngine`` is built (``engine_kwargs`` go to it, e.g. ``model_type``,
            ``template_type``, ``max_batch_size``).
        model: the same as a path ``engine`` (what ``make_backend('swift', model=...)`` passes).
        request_config: the default config when a call passes ``None`` (mtflow's or ms-swift's).
        output: ``'mtflow'`` returns :class:`mtflow.RolloutOutput` (converted), ``'swift'``
            ms-swift's ``RolloutOutput`` (what ms-swift's driver and trainers expect).
        return_details: force ``return_details`` on (token ids) unless ``False``.
        seed: the sampling seed of calls whose request config has none: the n-th engine call
            gets ``seed + n`` (``mtflow run`` passes the run config's ``seed``).

    Unlike the other backends it passes each request config to the engine as it is (converted to
    ms-swift's ``RequestConfig``), so it overrides :meth:`__call__` rather than ``generate``.

    Exact ids: with an ms-swift 4.6 scheduler, the executor freezes each assistant message as
    the ids sampled for it (``set_assistant_message_token_ids``) and the engine's template
    encodes them as they are; ``response.prompt_token_ids`` (``return_details``) is the prompt
    the engine generated from.
    """

    name = 'swift'

    def __init__(self,
                 engine: Any = None,
                 request_config: Any = None,
                 *,
                 model: Optional[str] = None,
                 output: Literal['mtflow', 'swift'] = 'mtflow',
                 return_details: Optional[bool] = True,
                 use_tqdm: bool = False,
                 seed: Optional[int] = None,
                 **engine_kwargs: Any) -> None:
        super().__init__()
        if engine is None:  # make_backend('swift', model=...) / mtflow run --backend swift --model ...
            if model is None:
                raise BackendError('swift backend: give engine= (an ms-swift InferEngine) or model= (a model path)')
            engine = model
        elif model is not None:
            raise BackendError('swift backend: give engine= or model=, not both')
        if output not in ('mtflow', 'swift'):
            raise BackendError(f"swift backend: output must be 'mtflow' or 'swift', not {output!r}")
        if isinstance(engine, str):
            from swift.infer_engine import TransformersEngine
            try:
                engine = TransformersEngine(engine, **engine_kwargs)
            except Exception as exc:
                raise BackendError(f'swift backend: cannot load {engine!r} with TransformersEngine: {exc}') from exc
        elif engine_kwargs:
            raise BackendError(f'swift backend: engine options {sorted(engine_kwargs)} need a model path, '
                               f'not an engine instance')
        if not callable(getattr(engine, 'infer', None)):
            raise BackendError(f'swift backend: {type(engine).__name__} has no infer(requests, request_config)')
        self.engine = engine
        self.model_name = type(engine).__name__
        self.request_config = request_config
        self.output = output
        self.return_details = return_details
        self.use_tqdm = use_tqdm
        self.seed = seed
        self.calls = 0

    @property  # type: ignore[override]
    def tokenizer(self) -> Any:
        return getattr(self.engine, 'tokenizer', None)

    @property
    def template(self) -> Any:
        return getattr(self.engine, 'template', None)

    def swift_config(self, request_config: Any) -> Any:
        """ms-swift's ``RequestConfig`` for one call (a copy: the caller's is never changed)."""
        from swift.infer_engine.protocol import RequestConfig

        config = request_config if request_config is not None else self.request_config
        config = RequestConfig() if config is None else copy.copy(_converters().to_swift(config))
        if self.return_details and not config.return_details:
            config.return_details = True
        if self.seed is not None and getattr(config, 'seed', None) is None:
            config.seed = self.seed + self.calls
        if getattr(config, 'n', 1) != 1:
            raise BackendError(f'swift backend: request_config.n must be 1 for rollouts, not {config.n}')
        return config

    def __call__(self, requests: List[Any], request_config: Any = None) -> List[Any]:
        if not requests:  # an idle rank's turn: nothing to generate
            return []
        self.calls += 1  # engine calls
        from swift.infer_engine.protocol import RolloutOutput as SwiftOutput

        converters = _converters()
        swift_requests = converters.to_swift(list(requests))
        config = self.swift_config(request_config)
        started = time.perf_counter()
        try:
            responses = self.engine.infer(swift_requests, config, use_tqdm=self.use_tqdm)
        except Exception as exc:
            raise BackendError(f'swift backend: {type(self.engine).__name__}.infer failed for '
                               f'{len(requests)} request(s): {type(exc).__name__}: {exc}') from exc
        if len(responses) != len(requests):
            raise BackendError(f'swift backend: {type(self.engine).__name__}.infer returned {len(responses)} '
                               f'response(s) for {len(requests)} request(s)')
        outputs = []
        for req, resp in zip(requests, responses):
            if isinstance(resp, BaseException):
                raise BackendError(f'swift backend: request {getattr(req, "uuid", None)!r}: '
                                   f'{type(resp).__name__}: {resp}') from resp
            if self.output == 'swift':
                outputs.append(SwiftOutput(response=resp))
            else:
                outputs.append(RolloutOutput(response=converters.from_swift(resp)))
        self._record(outputs, time.perf_counter() - started)
        return outputs


def _converters() -> Any:
    """mtflow <-> ms-swift conversions, loaded on the first engine call: importing this module
    (``make_backend`` and ``backend_options`` do, to list a backend's options) must not load ms-swift."""
    from mtflow.integrations.swift import converters  # lazy: imports ms-swift (seconds)
    return converters
