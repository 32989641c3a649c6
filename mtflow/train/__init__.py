"""From rollouts to a training step: exact-token samples, advantages, importance weights, stale
tokens, packing, and a plain PyTorch reference loop (``docs/training.md``).

This layer consumes what the engine and ``mtflow run`` produce (outputs, ``StreamGroup``\\ s,
``trajectories.jsonl``) and imports torch only inside the functions that need it, so
``import mtflow.train`` stays as light as ``import mtflow``. TRL's own tool loop over a YAML
scheduler (``trl_tool_environment``, ``TRLToolEnvironment``) loads the YAML layer when first named.
"""
from __future__ import annotations

from typing import Any

from mtflow.train.advantages import (ADVANTAGES, assign_advantages, assign_gigpo_advantages, assign_turn_advantages, grpo,
                                     reinforce, rloo, turn_returns)
from mtflow.train.errors import NotExpressibleInTRL, SampleError
from mtflow.train.loop import StepStats, policy_loss, reference_loop, token_logprobs, train_step
from mtflow.train.packing import PackedRow, block_causal_mask, pack, pad, to_tensors, unpack
from mtflow.train.samples import (STATE_KEYS, Sample, check_rewards, finite_reward, read_samples, samples_from_group,
                                  samples_from_output, samples_from_result, samples_from_trajectory)
from mtflow.train.staleness import STALE_POLICIES, StaleCounts, StalePolicy
from mtflow.train.trees import assign_tree_advantages, leaf_path, read_trees, tree_advantages, tree_values
from mtflow.train.trl_environment import MtflowEpisode, TRLEnvironment
from mtflow.train.trl_rollout import TRLRollout, mtflow_reward
from mtflow.train.weights import geometric_sequence_weight, keep_within, ratios, truncated_is

__all__ = [
    # samples
    'STATE_KEYS', 'Sample', 'SampleError', 'check_rewards', 'finite_reward', 'read_samples', 'samples_from_group', 'samples_from_output', 'samples_from_result',
    'samples_from_trajectory',
    # advantages and weights
    'ADVANTAGES', 'assign_advantages', 'assign_gigpo_advantages', 'assign_turn_advantages', 'grpo', 'reinforce', 'rloo', 'turn_returns',
    'geometric_sequence_weight', 'keep_within', 'ratios', 'truncated_is',
    # branched groups' trees
    'assign_tree_advantages', 'leaf_path', 'read_trees', 'tree_advantages', 'tree_values',
    # stale tokens, packing, the loop, TRL
    'STALE_POLICIES', 'StaleCounts', 'StalePolicy', 'PackedRow', 'block_causal_mask', 'pack', 'pad', 'to_tensors',
    'unpack', 'StepStats', 'policy_loss', 'reference_loop', 'token_logprobs', 'train_step', 'TRLRollout',
    'mtflow_reward', 'MtflowEpisode', 'TRLEnvironment', 'TRLToolEnvironment', 'trl_tool_environment',
    'NotExpressibleInTRL',
]

#: names loaded when first used: the YAML scheduler layer they need is not light
_LAZY = {'TRLToolEnvironment': 'mtflow.train.trl_native', 'trl_tool_environment': 'mtflow.train.trl_native'}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(list(globals()) + list(_LAZY))
