"""Advantages over groups of trajectories, as small named functions of plain numbers.

Each function takes the rewards of a batch and, where it needs them, each reward's group (the
prompt's copies: ``Sample.group``), and returns one advantage per reward, in order:

* :func:`grpo`: ``A_i = (r_i - mean_g) / (std + eps)``, the group's mean and the unbiased
  (Bessel) std of the group (``scale_rewards='group'``), of the whole batch (``'batch'``), or no
  division (``'none'``: Dr. GRPO); ``eps = 1e-4``. TRL's ``GRPOTrainer`` computes exactly this,
  so advantages compare one to one; a group of one has std 0 (advantage 0).
* :func:`rloo`: ``A_i = r_i - mean_{j != i} r_j`` (leave-one-out, REINFORCE Leave-One-Out);
  ``0`` for a group of one.
* :func:`reinforce`: ``A_i = r_i - b``, ``b`` a constant baseline or the batch mean;
* :func:`turn_returns`: per-turn rewards (``rollout_infos['turn_rewards']``) to discounted
  returns ``G_t = sum_{k >= t} gamma^(k - t) r_k`` over a trajectory's turns.

:func:`assign_advantages` applies one of them per trajectory (the segments of one trajectory
share its reward and count once in the baseline) and writes each sample's ``advantage``.
Withheld samples (:mod:`mtflow.train.staleness`) are passed in like the others: their rewards
move the baseline, their zeroed masks keep them out of the loss. :func:`assign_turn_advantages`
is the per-turn variant: each trained token gets the advantage of its turn's return, normalised
with :func:`grpo` over every (trajectory, turn) return of its group; :func:`assign_gigpo_advantages`
is GiGPO's two levels: the episode advantage plus ``step_weight`` times a step advantage, the
turn's return normalised among the turns of the group that were generated from the same
environment state (``Sample.state_keys``).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

from mtflow.train.errors import SampleError
from mtflow.train.samples import Sample, check_rewards

__all__ = ['GRPO_EPS', 'SCALE_REWARDS', 'grpo', 'rloo', 'reinforce', 'turn_returns', 'ADVANTAGES', 'assign_advantages',
           'assign_turn_advantages', 'assign_gigpo_advantages']

#: the epsilon TRL and the GRPO papers add to the std
GRPO_EPS = 1e-4
SCALE_REWARDS = ('group', 'batch', 'none')


def _by_group(groups: Sequence[Hashable]) -> Dict[Hashable, List[int]]:
    members: Dict[Hashable, List[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    return members


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _std(values: Sequence[float]) -> float:
    """Unbiased (Bessel) std, as ``torch.std``; ``0`` for fewer than two values."""
    if len(values) < 2:
        return 0.0
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def _check(rewards: Sequence[float], groups: Optional[Sequence[Hashable]]) -> None:
    if groups is not None and len(groups) != len(rewards):
        raise ValueError(f'{len(rewards)} rewards but {len(groups)} groups')
    bad = next((i for i, r in enumerate(rewards) if not math.isfinite(r)), None)
    if bad is not None:  # one would make its group's mean and std, and every advantage of the group, NaN
        raise ValueError(f'rewards[{bad}] is {rewards[bad]}: a NaN or infinite reward would make every advantage '
                         'of its group NaN')


def grpo(rewards: Sequence[float], groups: Sequence[Hashable], scale_rewards: str = 'group',
         eps: float = GRPO_EPS) -> List[float]:
    """Group-normalised advantages (see the module docstring)."""
    _check(rewards, groups)
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f'scale_rewards must be one of {SCALE_REWARDS}, not {scale_rewards!r}')
    out = [0.0] * len(rewards)
    batch_std = _std(rewards)
    for members in _by_group(groups).values():
        values = [rewards[i] for i in members]
        mean = _mean(values)
        std = _std(values) if scale_rewards == 'group' else batch_std
        for i in members:
            centred = rewards[i] - mean
            out[i] = centred if scale_rewards == 'none' else centred / (std + eps)
    return out


def rloo(rewards: Sequence[float], groups: Sequence[Hashable]) -> List[float]:
    """Leave-one-out advantages: each reward minus the mean of the others in its group."""
    _check(rewards, groups)
    out = [0.0] * len(rewards)
    for members in _by_group(groups).values():
        n = len(members)
        if n < 2:
            continue
        total = sum(rewards[i] for i in members)
        for i in members:
            out[i] = rewards[i] - (total - rewards[i]) / (n - 1)
    return out


def reinforce(rewards: Sequence[float], groups: Optional[Sequence[Hashable]] = None,
              baseline: Optional[float] = None) -> List[float]:
    """Plain REINFORCE with a baseline: ``r - baseline`` (default: the batch mean). ``groups`` is
    accepted for a common signature and not used."""
    _check(rewards, groups)
    if not rewards:
        return []
    b = _mean(rewards) if baseline is None else float(baseline)
    return [r - b for r in rewards]


def turn_returns(rewards: Dict[int, float], last_turn: int, gamma: float = 1.0) -> Dict[int, float]:
    """``{t: G_t}`` for turns ``1..last_turn``: ``G_t = sum_{k=t}^{last} gamma^(k - t) r_k``, a turn
    without a reward counting 0."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f'gamma must be in [0, 1], not {gamma!r}')
    out: Dict[int, float] = {}
    running = 0.0
    for t in range(last_turn, 0, -1):
        running = rewards.get(t, 0.0) + gamma * running
        out[t] = running
    return out


#: the advantage functions by name (``assign_advantages(method=...)``)
ADVANTAGES: Dict[str, Callable[..., List[float]]] = {'grpo': grpo, 'rloo': rloo, 'reinforce': reinforce}


def assign_advantages(samples: Sequence[Sample], method: str = 'grpo', **options: float) -> List[Sample]:
    """Set ``advantage`` on every sample: ``method`` over one reward per trajectory (uuid; its
    segments share it), grouped by ``Sample.group``. Returns ``samples``."""
    if method not in ADVANTAGES:
        raise ValueError(f'advantage method must be one of {sorted(ADVANTAGES)}, not {method!r}')
    check_rewards(samples)
    order: List[str] = []
    reward: Dict[str, float] = {}
    group: Dict[str, str] = {}
    for s in samples:
        if s.uuid not in reward:
            order.append(s.uuid)
            reward[s.uuid], group[s.uuid] = s.reward, s.group
        elif group[s.uuid] != s.group or reward[s.uuid] != s.reward:
            raise ValueError(f'request {s.uuid}: its segments disagree on the reward or group')
    values = ADVANTAGES[method]([reward[u] for u in order], [group[u] for u in order], **options)
    by_uuid = dict(zip(order, values))
    for s in samples:
        s.advantage = by_uuid[s.uuid]
    return list(samples)


def _turn_table(samples: Sequence[Sample], why: str) -> Tuple[Dict[str, Dict[int, float]], Dict[str, int], Dict[str, str]]:
    """Per trajectory: its per-turn rewards (all segments), its last turn, its group."""
    check_rewards(samples)
    rewards: Dict[str, Dict[int, float]] = {}
    last: Dict[str, int] = {}
    group: Dict[str, str] = {}
    for s in samples:
        if s.token_turns is None:
            raise SampleError(f'the turn of each token cannot be placed (turns share assistant messages), so {why} '
                              'cannot be given', uuid=s.uuid, turn=s.turns[0], field='turn_rewards')
        merged = rewards.setdefault(s.uuid, {})
        for t, r in s.turn_rewards.items():
            merged[t] = merged.get(t, 0.0) + r
        last[s.uuid] = max(last.get(s.uuid, 0), s.turns[1])
        group[s.uuid] = s.group
    return rewards, last, group


def _returns(samples: Sequence[Sample], rewards: Dict[str, Dict[int, float]], last: Dict[str, int], gamma: float,
             outcome: bool) -> Dict[Tuple[str, int], float]:
    out: Dict[Tuple[str, int], float] = {}
    for uuid, per_turn in rewards.items():
        if outcome:
            reward = next(s.reward for s in samples if s.uuid == uuid)
            per_turn = {**per_turn, last[uuid]: per_turn.get(last[uuid], 0.0) + reward}
        for t, g in turn_returns(per_turn, last[uuid], gamma).items():
            out[(uuid, t)] = g
    return out


def _spread(samples: Sequence[Sample], advantage: Dict[Tuple[str, int], float]) -> List[Sample]:
    for s in samples:
        s.token_advantages = [0.0 if t is None else advantage[(s.uuid, t)] for t in s.token_turns or ()]
    return list(samples)


def assign_turn_advantages(samples: Sequence[Sample], gamma: float = 1.0, outcome: bool = False,
                           scale_rewards: str = 'group', eps: float = GRPO_EPS) -> List[Sample]:
    """Per-token advantages from per-turn rewards: for each trajectory (uuid), the per-turn rewards
    of all its segments (``Sample.turn_rewards``; with ``outcome=True`` the trajectory reward is
    added to its last turn's), their discounted returns (:func:`turn_returns`), normalised by
    :func:`grpo` over all (trajectory, turn) returns of the group; each token gets its turn's
    (``Sample.token_advantages``, 0 on glue). Returns ``samples``."""
    rewards, last, group = _turn_table(samples, 'per-turn advantages')
    returns = _returns(samples, rewards, last, gamma, outcome)
    keys = list(returns)
    values = grpo([returns[k] for k in keys], [group[u] for u, _ in keys], scale_rewards=scale_rewards, eps=eps)
    return _spread(samples, dict(zip(keys, values)))


def _episode_at_last_turn(samples: Sequence[Sample], rewards: Dict[str, Dict[int, float]], group: Dict[str, str],
                          episode_reward: Optional[bool]) -> Dict[str, bool]:
    """Per trajectory: whether its episode reward counts as its last turn's reward for the step
    returns. ``None`` (auto): in every group none of whose members has a per-turn reward (the
    setting of GiGPO's paper: only the episode ends with a reward), else not."""
    if episode_reward is not None:
        if not isinstance(episode_reward, bool):
            raise ValueError(f'episode_reward must be None, True or False, not {episode_reward!r}')
        return {u: episode_reward for u in rewards}
    rewarded = {group[u] for u, per_turn in rewards.items() if per_turn}
    return {u: group[u] not in rewarded for u in rewards}


def assign_gigpo_advantages(samples: Sequence[Sample], step_weight: float = 1.0, gamma: float = 0.95,
                            scale_rewards: str = 'group', eps: float = GRPO_EPS,
                            episode_reward: Optional[bool] = None) -> List[Sample]:
    """GiGPO (group-in-group): ``A_{i,t} = A^E_i + step_weight * A^S_{i,t}``, where ``A^E_i`` is
    :func:`grpo` over the trajectory rewards of the group and ``A^S_{i,t}`` is :func:`grpo` over the
    discounted returns ``G_{i,t}`` (:func:`turn_returns`) of the turns of the group generated from
    the same environment state (``Sample.state_keys``: an anchor group; a turn without a key, or
    alone in its anchor group, has ``A^S = 0``). Each token gets its turn's
    (``Sample.token_advantages``). Returns ``samples``.

    The returns are of the per-turn rewards (``Sample.turn_rewards``) and, where
    ``episode_reward`` says so, of the episode reward received at the last turn (so ``G_{i,t} =
    gamma^(T_i - t) * R_i`` with no per-turn rewards): ``True`` always, ``False`` never, ``None``
    (default) for the groups none of whose trajectories has a per-turn reward, the paper's
    setting (ALFWorld, WebShop), where the step term would otherwise be 0 and GiGPO plain GRPO.
    Pass ``False`` when the episode reward is already the sum of the per-turn ones."""
    rewards, last, group = _turn_table(samples, 'GiGPO advantages')
    at_last = _episode_at_last_turn(samples, rewards, group, episode_reward)
    returns: Dict[Tuple[str, int], float] = {}
    for uuid in rewards:
        returns.update(_returns([s for s in samples if s.uuid == uuid], {uuid: rewards[uuid]}, last, gamma,
                                outcome=at_last[uuid]))
    uuids = list(rewards)
    episode = dict(zip(uuids, grpo([next(s.reward for s in samples if s.uuid == u) for u in uuids],
                                   [group[u] for u in uuids], scale_rewards=scale_rewards, eps=eps)))
    keys: Dict[Tuple[str, int], str] = {}
    for s in samples:
        keys.update({(s.uuid, t): k for t, k in s.state_keys.items()})
    anchored = [k for k in returns if k in keys]
    step = dict(zip(anchored, grpo([returns[k] for k in anchored], [(group[k[0]], keys[k]) for k in anchored],
                                   scale_rewards=scale_rewards, eps=eps)))
    return _spread(samples, {k: episode[k[0]] + step_weight * step.get(k, 0.0) for k in returns})
