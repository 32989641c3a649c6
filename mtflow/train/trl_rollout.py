"""TRL's ``GRPOTrainer`` driven by mtflow: a ``rollout_func`` that runs the trainer's prompts
through an mtflow executor (any scheduler, multi-turn, tools) and hands back exact samples.

TRL (0.29) calls ``rollout_func(prompts, trainer)`` once per generation batch, with the prompts
its sampler already repeated ``num_generations`` times, consecutively (one group after another),
and takes per prompt the ``prompt_ids``, ``completion_ids`` and ``logprobs`` of one completion;
``env_mask`` (its name for the tool mask: 1 model tokens, 0 tool output) multiplies its loss mask,
and every other key is handed to the reward functions. :class:`TRLRollout` returns, per prompt,
the one sample of its trajectory (:mod:`mtflow.train.samples`): the token record's prompt ids,
the completion with the tool messages and template glue between the turns, the loss mask as
``env_mask``, the rollout logprobs on the trained tokens, and the trajectory's reward as
``mtflow_reward`` for :func:`mtflow_reward`. The trainer's own ``generate`` is never called, so no
vLLM is needed; with an HF backend over the trainer's model, every generation batch samples from
the weights being trained.

A trajectory that compacted (several segments) cannot be one TRL completion: refused with the
request named (:class:`~mtflow.train.errors.SampleError`). TRL is imported by the trainer, never
here.

Samples without rollout logprobs follow the reference loop's rule (:mod:`mtflow.train.weights`,
``missing_logprobs``): TRL takes ``logprobs`` for every rollout of a batch or for none, so a batch
holding one such sample hands TRL none (its off-policy mask then compares with the trainer's own
logprobs: the batch is trained without the correction), counted in
:attr:`TRLRuns.uncorrected_samples` and in the trainer's logged metrics
(``mtflow/uncorrected_samples``), and said once as a warning; ``missing_logprobs='refuse'``
refuses such a batch when the trainer asks for a correction, naming the first sample. TRL's
vLLM importance sampling correction cannot go without them: that is refused either way.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence

from mtflow.core.protocol import RolloutInferRequest
from mtflow.train.errors import SampleError
from mtflow.train.samples import Sample, samples_from_result
from mtflow.train.weights import MISSING_LOGPROBS, uncorrected_samples

__all__ = ['TRLRuns', 'TRLRollout', 'mtflow_reward', 'REWARD_KEY', 'UNCORRECTED_METRIC', 'prompt_messages', 'trl_fields',
           'run_for_trl', 'asks_correction']

#: the extra field the rollout hands the reward function
REWARD_KEY = 'mtflow_reward'
#: the trainer's logged metric: samples of the batch without rollout logprobs
UNCORRECTED_METRIC = 'mtflow/uncorrected_samples'


def prompt_messages(prompt: Any) -> List[Dict[str, Any]]:
    """A TRL prompt (a string, or conversational messages) as mtflow's messages."""
    if isinstance(prompt, str):
        return [{'role': 'user', 'content': prompt}]
    return [dict(m) for m in prompt]


def asks_correction(trainer: Any) -> bool:
    """Whether TRL's trainer uses the rollout logprobs: its vLLM importance sampling correction,
    or its off-policy sequence mask (``off_policy_mask_threshold``)."""
    return vllm_correction(trainer) or getattr(trainer, 'off_policy_mask_threshold', None) is not None


def vllm_correction(trainer: Any) -> bool:
    """TRL's vLLM importance sampling correction, which subtracts the rollout logprobs as given
    (``None`` fails inside TRL)."""
    return bool(getattr(trainer, 'use_vllm', False) and getattr(trainer, 'vllm_importance_sampling_correction', False))


class TRLRuns:
    """What TRL's two ways in share: the executor, the rule for samples without rollout logprobs
    (``missing_logprobs``, the module docstring), and with ``keep=True`` each batch's samples and
    requests (``batches``, ``requests``: for checks and logging).

    Attributes:
        uncorrected_samples: samples handed to TRL without rollout logprobs, over every batch.
    """

    def __init__(self, executor: Any, keep: bool = False, missing_logprobs: str = 'uncorrected') -> None:
        if missing_logprobs not in MISSING_LOGPROBS:
            raise ValueError(f'missing_logprobs must be one of {MISSING_LOGPROBS}, not {missing_logprobs!r}')
        self.executor = executor
        self.keep = keep
        self.missing_logprobs = missing_logprobs
        self.calls = 0
        self.uncorrected_samples = 0
        self._warned = False
        self.batches: List[List[Sample]] = []
        self.requests: List[List[RolloutInferRequest]] = []

    def kept(self, samples: List[Sample], requests: List[RolloutInferRequest]) -> None:
        if self.keep:
            self.batches.append(samples)
            self.requests.append(requests)

    def fields(self, samples: List[Sample], trainer: Any) -> Dict[str, Any]:
        """:func:`trl_fields` of a batch, after the rule for samples without rollout logprobs:
        counted (here and in the trainer's metrics), said once, or refused."""
        corrects = asks_correction(trainer)
        missing = uncorrected_samples(samples, corrects, self.missing_logprobs)  # raises when refused
        if missing and vllm_correction(trainer):
            first = missing[0]
            raise SampleError(f'no rollout logprobs ({len(missing)} of {len(samples)} samples have none): TRL\'s vLLM '
                              'importance sampling correction needs them for every sample of the batch (turn it off: '
                              'vllm_importance_sampling_correction=False, or have the backend return logprobs)',
                              uuid=first.uuid, turn=first.turns[0], field='rollout_logprobs')
        self.uncorrected_samples += len(missing)
        _log_metric(trainer, UNCORRECTED_METRIC, len(missing))
        if missing and not self._warned:
            self._warned = True
            effect = (f'so none of the {len(samples)} is corrected against the rollout (the off-policy mask compares '
                      "with the trainer's own logprobs)" if corrects else 'the trainer asks for no correction')
            warnings.warn(f'mtflow TRL rollout: {len(missing)} of {len(samples)} samples have no rollout logprobs '
                          f'(first: {missing[0].uuid}); TRL takes logprobs for every sample of a batch or none: {effect}. '
                          f"Counted in '{UNCORRECTED_METRIC}'; missing_logprobs='refuse' refuses such a batch "
                          '(said once)', RuntimeWarning, stacklevel=3)
        return trl_fields(samples)


def _log_metric(trainer: Any, name: str, value: float) -> None:
    """Add ``value`` to the trainer's logged metrics (TRL's ``_metrics``, averaged per logging
    step), when it keeps them."""
    metrics = getattr(trainer, '_metrics', None)
    if not isinstance(metrics, dict):
        return
    mode = 'train' if getattr(getattr(trainer, 'model', None), 'training', True) else 'eval'
    store = metrics.get(mode)
    if store is not None and hasattr(store, 'setdefault'):
        store.setdefault(name, []).append(float(value))


class TRLRollout(TRLRuns):
    """``GRPOTrainer(rollout_func=TRLRollout(executor))``. ``executor`` is an
    :class:`mtflow.Executor` (its scheduler and backend decide the turns and tools); the policy
    version is set to the trainer's ``global_step`` before each batch. With ``keep=True``,
    ``batches`` and ``requests`` keep the samples and the requests of every call (for checks and
    logging); ``missing_logprobs`` (``'uncorrected'`` or ``'refuse'``): samples without rollout
    logprobs, as the module docstring says."""

    def __call__(self, prompts: Sequence[Any], trainer: Any) -> Dict[str, Any]:
        n = int(getattr(trainer, 'num_generations', 1) or 1)
        if len(prompts) % n:
            raise ValueError(f'rollout_func got {len(prompts)} prompts, not a multiple of num_generations={n}')
        call, self.calls = self.calls, self.calls + 1
        requests = [RolloutInferRequest(messages=prompt_messages(p), uuid=f'trl{call}-{i // n}#{i % n}')
                    for i, p in enumerate(prompts)]
        samples = run_for_trl(self.executor, requests, getattr(getattr(trainer, 'state', None), 'global_step', None))
        self.kept(samples, requests)
        return self.fields(samples, trainer)


def run_for_trl(executor: Any, requests: List[RolloutInferRequest], step: Any = None) -> List[Sample]:
    """Run ``requests`` through ``executor`` (its policy version set to the trainer's ``step``)
    and return each one's single exact sample, in order: a failed rollout, a branched executor
    (more trajectories than TRL rollouts) or a compacted trajectory (several segments) is an error."""
    if isinstance(step, int) and step >= 0:
        executor.set_policy_version(step)
    asked = len(requests)
    result = executor.run(requests)  # a branched executor appends the children's requests to the list
    if len(result.outputs) != asked:
        raise ValueError(f'{asked} rollouts gave {len(result.outputs)} trajectories: a branched executor cannot serve '
                         'TRL, which takes one completion per rollout')
    if result.failures:
        raise RuntimeError(f'{len(result.failures)} of {len(requests)} rollouts failed; first: {result.failures[0]}')
    samples = samples_from_result(result, requests)
    for s in samples:
        if s.segments != 1:
            raise SampleError(f'{s.segments} context segments cannot be one TRL completion', uuid=s.uuid,
                              turn=s.turns[0], field='context_segments')
    return samples


def trl_fields(samples: Sequence[Sample]) -> Dict[str, Any]:
    """What TRL's ``rollout_func`` returns for one exact sample per rollout: ``prompt_ids``,
    ``completion_ids``, ``logprobs`` (``None`` unless every sample has them: TRL takes them for all
    or none; :meth:`TRLRuns.fields` counts and says it), the loss mask as
    ``env_mask``, the reward as the extra field ``mtflow_reward`` and the uuid."""
    have_logprobs = all(s.logprobs is not None for s in samples)
    return {'prompt_ids': [s.prompt_ids for s in samples], 'completion_ids': [s.completion_ids for s in samples],
            'logprobs': [s.logprobs for s in samples] if have_logprobs else None,
            'env_mask': [s.loss_mask for s in samples], REWARD_KEY: [s.reward for s in samples],
            'mtflow_uuid': [s.uuid for s in samples]}


def mtflow_reward(prompts: Sequence[Any], completions: Sequence[Any], mtflow_reward: Optional[Sequence[float]] = None,
                  **kwargs: Any) -> List[float]:
    """A TRL reward function that returns the rewards mtflow's scheduler gave the trajectories."""
    if mtflow_reward is None:
        raise ValueError(f'no {REWARD_KEY!r} field: use mtflow_reward with rollout_func=TRLRollout(...)')
    return [float(r) for r in mtflow_reward]
