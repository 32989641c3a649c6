"""The executor: runs a scheduler over a batch of requests, one state machine per request.

- :mod:`~mtflow.engine.executor`: :class:`Executor` (the public face), :func:`run_multi_turn`;
- :mod:`~mtflow.engine.options`: its options, checked once;
- :mod:`~mtflow.engine.run_state`: the state of one run, shared by everything below;
- :mod:`~mtflow.engine.handlers`: what happens in each state (one handler per phase);
- :mod:`~mtflow.engine.moves`: carrying the handlers' moves out; :mod:`~mtflow.engine.outputs`:
  building outputs; :mod:`~mtflow.engine.model_call`: the ``rollout_fn`` call;
- the drivers, siblings over those pieces: :mod:`~mtflow.engine.lockstep` (every live request one
  turn together) and :mod:`~mtflow.engine.async_driver` (each request on its own, partial
  rollouts: :mod:`~mtflow.engine.partial`), both :class:`~mtflow.engine.driver.Driver` s;
- :mod:`~mtflow.engine.result`: :class:`RunResult`;
- :mod:`~mtflow.engine.context_budget` and :mod:`~mtflow.engine.context`: context budgets, the
  check before each turn and the ``compacting`` state (``docs/context.md``).
"""
from mtflow.engine.context_budget import ContextBudget
from mtflow.engine.admission import Admission
from mtflow.engine.branching import Branching
from mtflow.engine.executor import Executor, identity_gather, run_multi_turn
from mtflow.engine.options import ExecutorOptions
from mtflow.engine.partial import UnfinishedRequest, Until
from mtflow.engine.result import RunResult

__all__ = ['Admission', 'Branching', 'ContextBudget', 'Executor', 'ExecutorOptions', 'RunResult', 'Until', 'UnfinishedRequest', 'identity_gather',
           'run_multi_turn']
