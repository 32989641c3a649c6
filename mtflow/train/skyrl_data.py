"""mtflow's samples as SkyRL's generator output (``skyrl-train`` 0.3): the ``GeneratorOutput`` a
SkyRL generator returns and its trainer turns into a training batch
(``convert_to_training_input``: ``dataset.preprocess.convert_prompts_responses_to_batch_tensors``).

A SkyRL generator hands the trainer, per trajectory, ``prompt_token_ids``, ``response_ids`` (every
turn's ids with the observations between them), ``loss_masks`` (1 on the model's tokens),
``rewards`` (one per trajectory, or one per response token), ``rollout_logprobs`` (aligned with
the response), ``stop_reasons`` and ``trajectory_ids`` (the prompt and the repetition: its GRPO
group). :func:`generator_output` fills them from exact :class:`~mtflow.train.samples.Sample`\\ s:
``response_ids`` are the completion ids with the template's glue and tool messages, exactly as the
model saw them (never re-tokenized from messages), the loss mask the scheduler's, the rollout
logprobs 0.0 on untrained tokens. ``rewards='token'`` gives token-level rewards: each turn's
per-turn reward on its last sampled token, the trajectory's reward added on the last trained
token. :func:`generator_output_from_group` converts a ``StreamGroup``.

This module imports ``skyrl_train``; it is left out of :mod:`mtflow.train`'s face.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from skyrl_train.generators.base import GeneratorOutput, TrajectoryID

from mtflow.train.errors import SampleError
from mtflow.train.samples import Sample, samples_from_group

__all__ = ['REWARDS', 'generator_output', 'generator_output_from_group', 'token_rewards']

#: how rewards are given: one per trajectory, or one per response token
REWARDS = ('trajectory', 'token')


def token_rewards(sample: Sample) -> List[float]:
    """One reward per completion token: each turn's per-turn reward on its last trained token and
    the trajectory's reward added on the last trained token of the sample (0 elsewhere)."""
    out = [0.0] * len(sample.completion_ids)
    trained = [k for k, m in enumerate(sample.loss_mask) if m]
    if not trained:
        raise SampleError('no trained token to carry the reward', uuid=sample.uuid, field='loss_mask')
    if sample.turn_rewards:
        if sample.token_turns is None:
            raise SampleError('per-turn rewards, but the turn of each token cannot be placed', uuid=sample.uuid,
                              turn=sample.turns[0], field='turn_rewards')
        last_of: Dict[int, int] = {}
        for k in trained:
            turn = sample.token_turns[k]
            if turn is not None:
                last_of[turn] = k
        for turn, reward in sample.turn_rewards.items():
            if turn in last_of:
                out[last_of[turn]] += float(reward)
    out[trained[-1]] += float(sample.reward)
    return out


def generator_output(samples: Sequence[Sample], rewards: str = 'trajectory',
                     stop_reasons: Optional[Sequence[str]] = None) -> GeneratorOutput:
    """SkyRL's ``GeneratorOutput`` of ``samples`` (one trajectory each, in order): the exact ids,
    masks and logprobs (``rollout_logprobs`` ``None`` unless every sample has them), the rewards
    (``rewards``: ``'trajectory'`` or ``'token'``, :func:`token_rewards`), ``stop_reasons``
    (default ``'stop'``) and ``trajectory_ids`` (each sample's group and its place in it). A
    compacted trajectory (several segments) is refused: SkyRL takes one sequence per trajectory."""
    if rewards not in REWARDS:
        raise ValueError(f'rewards must be one of {REWARDS}, not {rewards!r}')
    for s in samples:
        if s.segments != 1:
            raise SampleError(f'{s.segments} context segments cannot be one SkyRL trajectory', uuid=s.uuid,
                              turn=s.turns[0], field='context_segments')
    if stop_reasons is not None and len(stop_reasons) != len(samples):
        raise ValueError(f'{len(stop_reasons)} stop reasons for {len(samples)} samples')
    seen: Dict[str, int] = {}
    ids: List[TrajectoryID] = []
    for s in samples:
        ids.append(TrajectoryID(instance_id=s.group, repetition_id=seen.get(s.group, 0)))
        seen[s.group] = seen.get(s.group, 0) + 1
    have_logprobs = all(s.logprobs is not None for s in samples)
    out: Dict[str, Any] = {
        'prompt_token_ids': [list(s.prompt_ids) for s in samples],
        'response_ids': [list(s.completion_ids) for s in samples],
        'rewards': [token_rewards(s) for s in samples] if rewards == 'token' else [float(s.reward) for s in samples],
        'loss_masks': [list(s.loss_mask) for s in samples],
        'stop_reasons': list(stop_reasons) if stop_reasons is not None else ['stop'] * len(samples),
        'rollout_metrics': None,
        'rollout_logprobs': [list(s.logprobs) for s in samples] if have_logprobs else None,
        'trajectory_ids': ids,
        'is_last_step': None}
    return out  # type: ignore[return-value]


def generator_output_from_group(group: Any, rewards: str = 'trajectory', failed: str = 'raise') -> GeneratorOutput:
    """The ``GeneratorOutput`` of a ``StreamGroup`` (``Executor.stream``), its members' finish
    reasons as the stop reasons."""
    samples = samples_from_group(group, failed=failed)
    reasons = {str(u): str(r) for u, r in zip(group.uuids, group.finish_reasons)}
    return generator_output(samples, rewards=rewards, stop_reasons=[reasons[s.uuid] for s in samples])
