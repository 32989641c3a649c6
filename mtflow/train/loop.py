"""A plain PyTorch GRPO loop built only from this package's pieces: the reference a trainer
integration is checked against, and the loop of ``benchmarks/learning_curve.py``.

One step is: roll out a batch of groups (``Executor.run``), turn the outputs into exact samples
(:mod:`mtflow.train.samples`), optionally withhold stale ones (:mod:`mtflow.train.staleness`),
compute advantages (:mod:`mtflow.train.advantages`), pack (:mod:`mtflow.train.packing`), and take
one optimizer step on

``loss = agg_t( -min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A) * w_t )``

over the trained tokens (``loss_mask``), where ``rho_t = exp(logp_t - logp_t.detach())`` (one
update per batch, so ``rho = 1`` and its gradient is the policy gradient), ``A`` the sample's
advantage, and ``w_t`` the truncated importance weight of the trainer's logprob against the
rollout's (``tis_cap``; ``None``: no correction; ``mask_outside`` and ``sequence_weight`` are the
masked and the sequence-level corrections). ``agg`` is ``'token-mean'`` (every trained token
of the batch weighs the same) or ``'sample-mean'`` (each sample's token mean, averaged).

A sample without rollout logprobs (the contract clears them when they do not cover its trained
tokens, or the rollout asked for none) has no behaviour policy: its tokens get no correction
(ratio 1 in every weight, :func:`behaviour_logprobs`), never a weight against the 0.0 its packed
row holds; :func:`train_step` counts them (``uncorrected_samples``), or with
``missing_logprobs='refuse'`` refuses a step that asks for a correction it cannot make.

The model is shared with the backend (``HFBackend(model, tokenizer)``), so every step's rollouts
come from the weights the previous step left; the executor's policy version moves with each step.
torch is imported when a function runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from mtflow.train.errors import SampleError
from mtflow.train.advantages import assign_advantages, assign_gigpo_advantages, assign_turn_advantages
from mtflow.train.packing import block_causal_mask, pack, to_tensors
from mtflow.train.samples import Sample, by_policy, samples_from_result
from mtflow.train.staleness import StalePolicy
from mtflow.train.trees import assign_tree_advantages
from mtflow.train.tree_packing import tree_train_step
from mtflow.train.weights import (LOSS_AGGREGATIONS, MISSING_LOGPROBS, behaviour_logprobs, geometric_sequence_weight,
                                  keep_within, truncated_is, uncorrected_samples)

__all__ = ['LOSS_AGGREGATIONS', 'MISSING_LOGPROBS', 'token_logprobs', 'behaviour_logprobs', 'policy_loss', 'train_step',
           'StepStats', 'reference_loop']



def token_logprobs(model: Any, batch: Dict[str, Any]) -> Any:
    """``[rows, T]``: the model's logprob of each token given the earlier tokens of its own sample
    (``0`` at each sample's first token and on padding, which no mask trains)."""
    import torch

    logits = model(input_ids=batch['input_ids'], attention_mask=block_causal_mask(batch['sample_index']),
                   position_ids=batch['position_ids']).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch['input_ids'][:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)


def policy_loss(logp: Any, batch: Dict[str, Any], clip_eps: float = 0.2, tis_cap: Optional[float] = None,
                agg: str = 'token-mean', mask_outside: Optional[float] = None, sequence_weight: bool = False) -> Any:
    """The clipped policy-gradient loss of the module docstring over ``batch['loss_mask']``, with
    the rollout corrections of :mod:`mtflow.train.weights` against ``batch['logprobs']``:
    ``tis_cap`` (token TIS weights), ``mask_outside`` (tokens whose ratio is outside
    ``[1/u, u]`` leave the mask) and ``sequence_weight`` (each sample weighted by the geometric
    mean of its ratios). Tokens without a rollout logprob get none of them
    (:func:`behaviour_logprobs`)."""
    import torch

    if agg not in LOSS_AGGREGATIONS:
        raise ValueError(f'agg must be one of {LOSS_AGGREGATIONS}, not {agg!r}')
    mask, adv = batch['loss_mask'], batch['advantages']
    behaviour = behaviour_logprobs(logp, batch)
    ratio = (logp - logp.detach()).exp()
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if tis_cap is not None:
        per_token = per_token * truncated_is(logp, behaviour, cap=tis_cap)
    if mask_outside is not None:
        mask = mask * keep_within(logp, behaviour, upper=mask_outside)
    if sequence_weight:
        per_token = per_token * geometric_sequence_weight(logp, behaviour, mask, batch['sample_index'])
    per_token = per_token * mask
    if agg == 'token-mean':
        return per_token.sum() / mask.sum().clamp(min=1)
    index = batch['sample_index']
    count = int(index.max().item()) + 1 if index.numel() else 0
    sums = torch.zeros(count).index_add(0, index.clamp(min=0).flatten(), per_token.flatten())
    tokens = torch.zeros(count).index_add(0, index.clamp(min=0).flatten(), mask.flatten())
    live = tokens > 0
    return (sums[live] / tokens[live]).mean() if live.any() else per_token.sum()


@dataclass
class StepStats:
    """What one step did."""
    step: int
    version: int
    mean_reward: float
    samples: int
    trained_tokens: int
    loss: float
    rows: int
    withheld_tokens: int = 0
    #: max |trainer logprob - rollout logprob| over the trained tokens that have one, before the update
    max_logprob_gap: Optional[float] = None
    #: samples with trained tokens but no rollout logprobs, trained without the importance correction
    uncorrected_samples: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)
    #: the policy this step trained (several policies from one run: one entry per policy and step)
    policy: Optional[str] = None


def train_step(model: Any, optimizer: Any, samples: Sequence[Sample], *, row_len: int, pad_id: int = 0,
               clip_eps: float = 0.2, tis_cap: Optional[float] = None, agg: str = 'token-mean',
               mask_outside: Optional[float] = None, sequence_weight: bool = False,
               missing_logprobs: str = 'uncorrected',
               on_batch: Optional[Callable[[Dict[str, Any], List[Any], Sequence[Sample]], None]] = None) -> Dict[str, Any]:
    """One optimizer step on ``samples`` (advantages already assigned). ``on_batch(batch, rows,
    samples)`` sees the exact tensors the loss receives. Returns the loss, the rows, the largest
    trainer-vs-rollout logprob gap on the trained tokens that have a rollout logprob, and
    ``uncorrected_samples``: the samples with trained tokens and no rollout logprobs, trained
    without the correction; with ``missing_logprobs='refuse'`` a step that asks for a correction
    (``tis_cap``, ``mask_outside``, ``sequence_weight``) and has such a sample is refused
    (:class:`~mtflow.train.errors.SampleError` naming the first and the count)."""
    import torch

    corrects = tis_cap is not None or mask_outside is not None or sequence_weight
    uncorrected = uncorrected_samples(samples, corrects, missing_logprobs)
    rows = pack(samples, row_len, pad_id=pad_id)
    batch = to_tensors(rows)
    if on_batch is not None:
        on_batch(batch, rows, samples)
    logp = token_logprobs(model, batch)
    loss = policy_loss(logp, batch, clip_eps=clip_eps, tis_cap=tis_cap, agg=agg, mask_outside=mask_outside,
                       sequence_weight=sequence_weight)
    gap = None
    trained = batch['loss_mask'] > 0
    known = trained & batch['has_logprobs']
    if bool(known.any()):
        gap = float((logp.detach() - batch['logprobs'])[known].abs().max())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return {'loss': float(loss.detach()), 'rows': len(rows), 'max_logprob_gap': gap,
            'trained_tokens': int(trained.sum()), 'uncorrected_samples': len(uncorrected)}


def reference_loop(executor: Any, model: Any, optimizer: Any, batches: Iterable[Sequence[Any]], *, row_len: int,
                   advantage: str = 'grpo', advantage_options: Optional[Dict[str, Any]] = None,
                   stale: Optional[StalePolicy] = None, pad_id: int = 0, clip_eps: float = 0.2,
                   tis_cap: Optional[float] = None, agg: str = 'token-mean', mask_outside: Optional[float] = None,
                   sequence_weight: bool = False, missing_logprobs: str = 'uncorrected',
                   on_batch: Optional[Callable[..., None]] = None,
                   on_step: Optional[Callable[[StepStats], None]] = None, trees: bool = False) -> List[StepStats]:
    """A step per batch of prompts from ``batches`` (each a list of requests: whole groups):
    roll out with ``executor``, build samples, withhold stale ones (``stale``), assign
    advantages (``advantage``: a name of :data:`~mtflow.train.advantages.ADVANTAGES`, or
    ``'turn'`` / ``'gigpo'`` for :func:`~mtflow.train.advantages.assign_turn_advantages` /
    :func:`~mtflow.train.advantages.assign_gigpo_advantages`, ``'tree'`` for TreeRL's per-node
    :func:`~mtflow.train.trees.assign_tree_advantages`), take one step, then move the executor's
    policy version on by one. ``trees=True`` (a branched executor) packs each group as one tree
    (:func:`~mtflow.train.tree_packing.tree_train_step`: the same loss and gradients, the shared
    prefix through the model once; ``mask_outside``, ``sequence_weight`` and ``on_batch`` are
    per-leaf only).

    Several policies from one run (``docs/multi-agent.md``): ``model`` and ``optimizer`` map policy
    ids to each policy's own; each step's samples are split by policy id
    (:func:`~mtflow.train.samples.by_policy`: roles not trained left out), and each policy takes
    its step on its own samples, its advantages over the copies of each (prompt, role) (with
    ``trees=True``, on the trees whose leaves it played). A role's trajectory without a reward (its
    episode ended by another role's failure) is not trained on. ``on_batch(batch, rows, samples)``
    and ``on_step(stats)`` are called per policy then (``stats.policy`` names it)."""
    if trees and (mask_outside is not None or sequence_weight or on_batch is not None):
        raise ValueError('trees=True takes neither mask_outside, sequence_weight nor on_batch (per-leaf packing only)')
    policies = model if isinstance(model, dict) else None
    if policies is not None and (not isinstance(optimizer, dict) or set(optimizer) != set(policies)):
        raise ValueError(f'several policies: optimizer must map the same policy ids as model ({sorted(policies)})')
    version = 0
    executor.set_policy_version(version)
    history: List[StepStats] = []
    for step, requests in enumerate(batches):
        ran = list(requests)  # a branched executor appends its children's requests to the list it runs
        result = executor.run(ran)
        if result.failures:
            raise RuntimeError(f'step {step}: {len(result.failures)} requests failed; first: {result.failures[0]}')
        parts = _parts(model, optimizer, policies, result, ran, step)
        for pid, (policy_model, policy_optimizer, samples) in parts.items():
            if not samples:
                continue
            stats = _step(policy_model, policy_optimizer, samples, step, version, advantage, advantage_options, stale,
                          result.trees if policies is None else _trees_of(result.trees, samples),
                          dict(row_len=row_len, pad_id=pad_id, clip_eps=clip_eps, tis_cap=tis_cap, agg=agg,
                               missing_logprobs=missing_logprobs),
                          dict(mask_outside=mask_outside, sequence_weight=sequence_weight, on_batch=on_batch),
                          packed_as_trees=trees)
            stats.policy = pid
            history.append(stats)
            if on_step is not None:
                on_step(stats)
        version += 1
        executor.set_policy_version(version)
    return history


def _parts(model: Any, optimizer: Any, policies: Optional[Dict[str, Any]], result: Any, ran: List[Any],
           step: int) -> Dict[Optional[str], Tuple[Any, Any, List[Sample]]]:
    """``{policy id: (model, optimizer, its samples)}`` of a step (``None``: the one model); only
    trained roles' samples (a judge's, a user simulator's are not), each trained policy mapped."""
    if policies is None:
        return {None: (model, optimizer, [s for s in samples_from_result(result, ran) if s.train])}
    split = by_policy(samples_from_result(result, ran, rewardless='skip'))
    unmapped = sorted(set(split) - set(policies))
    if unmapped:  # their samples would be dropped: that policy never trained
        raise ValueError(f'step {step}: trained roles play policies {unmapped}, which model does not map '
                         f'(it maps {sorted(policies)}); add them, or set train: false on their roles')
    return {pid: (policies[pid], optimizer[pid], split.get(pid, [])) for pid in policies}


def _trees_of(trees: Sequence[Dict[str, Any]], samples: Sequence[Sample]) -> List[Dict[str, Any]]:
    """The trees some leaf of which is among ``samples`` (one policy's, of several)."""
    uuids = {s.uuid for s in samples}
    return [tree for tree in trees if any(str(leaf) in uuids for leaf in tree['leaves'])]


def _step(model: Any, optimizer: Any, samples: List[Sample], step: int, version: int, advantage: str,
          advantage_options: Optional[Dict[str, Any]], stale: Optional[StalePolicy],
          trees: Optional[List[Dict[str, Any]]], options: Dict[str, Any], per_leaf: Dict[str, Any],
          packed_as_trees: bool) -> StepStats:
    """One policy's step on its samples: stale tokens, advantages, the update (``packed_as_trees``:
    each of ``trees`` packed as one tree; ``per_leaf``: the options of per-leaf packing only)."""
    rewards = {s.uuid: s.reward for s in samples}
    if stale is not None:
        samples = stale.apply(samples, version)
    if advantage == 'turn':  # per-token: each turn's discounted return, normalised in its group
        assign_turn_advantages(samples, **(advantage_options or {}))
    elif advantage == 'gigpo':  # per-token: episode plus step advantages over anchor states
        assign_gigpo_advantages(samples, **(advantage_options or {}))
    elif advantage == 'tree':  # per-token: TreeRL's node advantages of a branched group
        assign_tree_advantages(samples, trees, **(advantage_options or {}))
    else:
        assign_advantages(samples, advantage, **(advantage_options or {}))
    if packed_as_trees:
        done = tree_train_step(model, optimizer, trees, samples, **options)
    else:
        done = train_step(model, optimizer, samples, **options, **per_leaf)
    return StepStats(step=step, version=version, mean_reward=sum(rewards.values()) / max(1, len(rewards)),
                     samples=len(samples), trained_tokens=done['trained_tokens'], loss=done['loss'], rows=done['rows'],
                     withheld_tokens=sum(s.withheld_tokens for s in samples), max_logprob_gap=done['max_logprob_gap'],
                     uncorrected_samples=done['uncorrected_samples'])
