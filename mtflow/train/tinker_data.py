"""mtflow's samples as the Tinker cookbook's types (``tinker`` 0.38, ``tinker-cookbook`` 0.6):
a ``tinker.Datum`` per exact sample, and the cookbook's ``Trajectory`` / ``TrajectoryGroup`` for
its own pipeline.

The cookbook trains on ``Datum``\\ s: ``model_input`` the sequence without its last token,
``loss_fn_inputs`` the targets (the sequence without its first), the sampled ``logprobs``, the
``advantages`` and the ``mask``, all per target position. Its RL loop builds them from
trajectories of (observation, action) pairs (``rl.data_processing.trajectory_to_data``), one
datum while each observation extends the last one. :func:`to_datum` builds the datum straight from
a :class:`~mtflow.train.samples.Sample`: the same shift of ``prompt_ids + completion_ids``, the
sample's loss mask (the scheduler's), rollout logprobs and advantage (its ``token_advantages`` when
set); :func:`to_trajectory` gives the cookbook the same rollout as its own type, each turn's
observation the exact prompt ids that turn was generated from and its action the sampled ids, so
``trajectory_to_data`` and :func:`to_datum` agree token for token (``tests/train/tinker_check.py``).
:func:`datums` converts a batch (sample or ``StreamGroup``), with the cookbook's advantage (the
reward minus its group's mean) where the samples have none.

This module imports ``tinker`` and ``tinker_cookbook``; it is left out of :mod:`mtflow.train`'s face.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import tinker
import torch
from tinker import TensorData
from tinker_cookbook.completers import TokensWithLogprobs
from tinker_cookbook.rl.types import Trajectory, TrajectoryGroup, Transition

from mtflow.train.advantages import grpo
from mtflow.train.errors import SampleError
from mtflow.train.packing import token_advantages_of
from mtflow.train.samples import Sample, samples_from_group

__all__ = ['to_datum', 'datums', 'datums_from_group', 'to_trajectory', 'trajectory_group']


def _advantages(sample: Sample, fallback: Optional[float]) -> List[float]:
    if sample.token_advantages is None and sample.advantage is None:
        if fallback is None:
            raise SampleError('no advantage: assign one (mtflow.train.assign_advantages) or convert with datums()',
                              uuid=sample.uuid, field='advantage')
        return [fallback if m else 0.0 for m in sample.loss_mask]
    return token_advantages_of(sample)


def to_datum(sample: Sample, advantage: Optional[float] = None) -> tinker.Datum:
    """One ``tinker.Datum`` of an exact sample: inputs ``ids[:-1]``, targets ``ids[1:]`` of
    ``prompt_ids + completion_ids``, and per target the rollout logprob, advantage and loss mask
    (0 on the prompt and wherever the sample's mask is 0). ``advantage`` is used when the sample
    has none assigned."""
    ids = sample.input_ids
    if len(ids) < 2:
        raise SampleError('a sequence of fewer than 2 ids has no target', uuid=sample.uuid, field='completion_ids')
    pad = [0.0] * len(sample.prompt_ids)
    logprobs = pad + (list(sample.logprobs) if sample.logprobs is not None else [0.0] * len(sample.completion_ids))
    advantages = pad + _advantages(sample, advantage)
    mask = pad + [float(m) for m in sample.loss_mask]
    return tinker.Datum(
        model_input=tinker.ModelInput(chunks=[tinker.EncodedTextChunk(tokens=ids[:-1])]),
        loss_fn_inputs={'target_tokens': TensorData.from_torch(torch.tensor(ids[1:])),
                        'logprobs': TensorData.from_torch(torch.tensor(logprobs[1:])),
                        'advantages': TensorData.from_torch(torch.tensor(advantages[1:])),
                        'mask': TensorData.from_torch(torch.tensor(mask[1:]))})


def _centred(samples: Sequence[Sample]) -> List[float]:
    """The cookbook's advantage (``rl.data_processing.compute_advantages``): each reward minus its
    group's mean, one per trajectory (its segments share it)."""
    return grpo([s.reward for s in samples], [s.group for s in samples], scale_rewards='none')


def datums(samples: Sequence[Sample]) -> List[tinker.Datum]:
    """A datum per sample, in order; samples without an assigned advantage get the cookbook's
    (reward minus the group mean)."""
    fallback = _centred(samples)
    return [to_datum(s, a) for s, a in zip(samples, fallback)]


def datums_from_group(group: Any, failed: str = 'raise') -> List[tinker.Datum]:
    """The datums of a ``StreamGroup`` (``Executor.stream``): its members' samples, the
    cookbook's advantage within the group."""
    return datums(samples_from_group(group, failed=failed))


def _turn_runs(sample: Sample) -> List[tuple]:
    """``(start, end)`` in the completion of each turn's ids (its assistant message, or its run
    of trained ids in a continued message)."""
    if sample.token_turns is None:
        raise SampleError('the turn of each token cannot be placed, so the rollout has no (observation, action) '
                          'pairs', uuid=sample.uuid, turn=sample.turns[0], field='token_turns')
    runs: Dict[int, List[int]] = {}
    for k, turn in enumerate(sample.token_turns):
        if turn is not None:
            runs.setdefault(turn, []).append(k)
    return [(min(v), max(v) + 1) for _, v in sorted(runs.items())]


def to_trajectory(sample: Sample) -> Trajectory:
    """The cookbook's ``Trajectory`` of one exact sample: per turn, the observation is every id
    before the turn's first sampled id (the exact prompt of that turn) and the action the turn's
    ids with their rollout logprobs; the last transition ends the episode. Per-turn rewards are
    in each transition's ``metrics['mtflow/turn_reward']``; the reward goes to the group
    (:func:`trajectory_group`)."""
    transitions = []
    runs = _turn_runs(sample)
    logprobs = sample.logprobs or [0.0] * len(sample.completion_ids)
    for k, (start, end) in enumerate(runs):
        turn = sample.turns[0] + k
        ob = tinker.ModelInput(chunks=[tinker.EncodedTextChunk(tokens=sample.prompt_ids + sample.completion_ids[:start])])
        ac = TokensWithLogprobs(tokens=sample.completion_ids[start:end], maybe_logprobs=logprobs[start:end])
        transitions.append(Transition(ob=ob, ac=ac, reward=0.0, episode_done=k == len(runs) - 1,
                                      metrics={'mtflow/turn_reward': sample.turn_rewards.get(turn, 0.0)}))
    final = tinker.ModelInput(chunks=[tinker.EncodedTextChunk(tokens=sample.input_ids)])
    return Trajectory(transitions=transitions, final_ob=final)


def trajectory_group(samples: Sequence[Sample]) -> TrajectoryGroup:
    """One group's samples as the cookbook's ``TrajectoryGroup`` (their rewards as its final
    rewards, so ``get_total_rewards`` is the rewards)."""
    return TrajectoryGroup(trajectories_G=[to_trajectory(s) for s in samples],
                           final_rewards_G=[s.reward for s in samples], metrics_G=[{} for _ in samples])
