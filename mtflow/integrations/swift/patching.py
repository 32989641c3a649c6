"""mtflow's executor inside ms-swift: :func:`install` makes ms-swift's trainers (HF GRPO/GKD,
Megatron, Ray) call mtflow's executor wherever they called
``swift.rollout.agent_loop.run_multi_turn``, so their runs get per-request states, finish reasons
and traces; :func:`uninstall` undoes it.

ms-swift's trainers bind ``run_multi_turn`` by name when they are imported, so the name is
replaced in every module that holds it (:data:`PATCH_TARGETS`), not only where it is defined.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import swift.infer_engine.protocol as swift_protocol

from mtflow.accounting.choose import keeps_messages_as_ids
from mtflow.accounting.swift46 import Swift46Accounting
from mtflow.core.errors import MultiTurnRolloutError
from mtflow.engine.executor import Executor, identity_gather

__all__ = ['PATCH_TARGETS', 'InstallState', 'mtflow_run_multi_turn', 'install', 'uninstall', 'installed']

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
    executor = Executor(
        scheduler,
        rollout_fn,
        request_config,
        max_turns=max_turns,
        gather_fn=gather_fn,
        trace=state.trace if state else True,
        on_error=state.on_error if state else 'raise',
        rank=_rank(),
        output_cls=swift_protocol.RolloutOutput,
        accounting=_accounting_for(scheduler),
        scheduler_bounds_run=False)  # ms-swift's semantics: the caller's max_turns bounds the driver
    try:
        result = executor.run(requests, first_turn_outputs)
    except MultiTurnRolloutError as err:  # the run is complete: keep its trace, then raise
        _keep_run(state, executor.options.rank, err.result)
        raise
    _keep_run(state, executor.options.rank, result)
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
