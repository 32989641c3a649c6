"""mtflow: multi-turn LLM rollouts as explicit per-request state machines.

``import mtflow`` is light (pydantic, transitions); engines (torch, transformers, vLLM,
ms-swift) are imported only by the backends and integrations that need them.
"""
from mtflow.core.errors import (DuplicateUuidError, IllegalTransition, MtflowError, MultiTurnRolloutError, RankMismatchError,
                     RequestError, RequestFailure, RolloutFnError, RolloutInterrupted, SchedulerResultError,
                     StepTimeout)
from mtflow.engine.executor import Executor, RunResult, identity_gather, run_multi_turn
from mtflow.engine.partial import UnfinishedRequest, Until
from mtflow.engine.context_budget import ContextBudget
from mtflow.engine.admission import Admission
from mtflow.engine.branching import Branching
from mtflow.engine.stream import Stream, StreamGroup, StreamUntil
from mtflow.core.machine import StateGraph
from mtflow.core.records import FinishedRequest
from mtflow.core.protocol import (ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage, RequestConfig,
                       RolloutInferRequest, RolloutOutput, UsageInfo)
from mtflow.core.scheduler import Scheduler
from mtflow.core.trace import Trace, TraceEvent

__version__ = '0.1.0'

__all__ = [
    'Executor', 'RunResult', 'run_multi_turn', 'identity_gather', 'Scheduler', 'StateGraph', 'Trace', 'TraceEvent',
    'ChatCompletionResponse', 'ChatCompletionResponseChoice', 'ChatMessage', 'RequestConfig', 'RolloutInferRequest',
    'RolloutOutput', 'UsageInfo', 'MtflowError', 'IllegalTransition', 'RequestError', 'SchedulerResultError',
    'RolloutFnError', 'RequestFailure', 'MultiTurnRolloutError', 'RolloutInterrupted', 'StepTimeout', 'FinishedRequest',
    'DuplicateUuidError', 'RankMismatchError', 'Until', 'UnfinishedRequest', 'ContextBudget', 'Admission', 'Branching', 'Stream', 'StreamGroup',
    'StreamUntil', '__version__'
]
