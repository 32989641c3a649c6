"""What :meth:`mtflow.Executor.run` returns."""
from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Optional

from mtflow.core.errors import RequestFailure
from mtflow.core.trace import Trace, TraceRecorder

__all__ = ['RunResult']


class RunResult:
    """What :meth:`Executor.run` returns: one output per request (input order), each request's
    finish reason, the failures, and the trace (``None`` when tracing is off). A branched run
    (``docs/branching.md``) has one output per leaf: the inputs' first, then each fork's children
    in the order they were born (their requests appended to the list that was run), and
    :attr:`trees`.

    The trace is materialised from the recorder's raw tuples on first access, so a run whose
    trace nobody reads pays only for the tuples."""

    def __init__(self,
                 outputs: List[Any],
                 finish_reasons: List[Optional[str]],
                 failures: Optional[List[RequestFailure]] = None,
                 recorder: Optional[TraceRecorder] = None,
                 turns: int = 0,
                 rollout_fn_calls: int = 0) -> None:
        self.outputs = outputs
        self.finish_reasons = finish_reasons
        self.failures = failures if failures is not None else []
        self.turns = turns  # loop iterations in which some rank had live requests
        self.rollout_fn_calls = rollout_fn_calls
        #: the requests a partial rollout (async mode, ``run(..., until=...)``) handed back
        #: unfinished, as :class:`mtflow.UnfinishedRequest` items; empty when every request finished
        self.unfinished: List[Any] = []
        #: a branched run's trees (``docs/branching.md``), one per prompt, in input order: the
        #: records ``mtflow.engine.branching.tree_record`` writes; empty without branching
        self.trees: List[Dict[str, Any]] = []
        self._recorder = recorder
        self._trace: Optional[Trace] = None

    @property
    def trace(self) -> Optional[Trace]:
        if self._trace is None and self._recorder is not None:
            self._trace = self._recorder.trace()
        return self._trace

    @property
    def ok(self) -> bool:
        return not self.failures

    def __repr__(self) -> str:
        return (f'RunResult({len(self.outputs)} outputs, finish_reasons={dict(Counter(self.finish_reasons))}, '
                f'failures={len(self.failures)}, turns={self.turns}, rollout_fn_calls={self.rollout_fn_calls})')
