"""Each advantage and importance-weight function against a hand computation."""
from __future__ import annotations

import math

import pytest

from mtflow.train import Sample
from mtflow.train.advantages import GRPO_EPS, assign_advantages, grpo, reinforce, rloo

R = [1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 0.5]
G = ['a', 'a', 'a', 'a', 'b', 'b', 'c']


def test_grpo_group_scaled_by_hand():
    # group a: mean 0.5, unbiased std sqrt(4 * 0.25 / 3); group b: mean 2, std sqrt(2); c: alone, std 0
    sa, sb = math.sqrt(1 / 3), math.sqrt(2)
    expected = [0.5 / (sa + 1e-4), -0.5 / (sa + 1e-4), -0.5 / (sa + 1e-4), 0.5 / (sa + 1e-4),
                1 / (sb + 1e-4), -1 / (sb + 1e-4), 0.0]
    assert grpo(R, G) == pytest.approx(expected, abs=1e-12)
    assert GRPO_EPS == 1e-4


def test_grpo_batch_scaled_and_unscaled_by_hand():
    mean = sum(R) / 7  # 6.5 / 7
    std = math.sqrt(sum((r - mean) ** 2 for r in R) / 6)
    centred = [0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0]
    assert grpo(R, G, scale_rewards='batch') == pytest.approx([c / (std + 1e-4) for c in centred], abs=1e-12)
    assert grpo(R, G, scale_rewards='none') == pytest.approx(centred, abs=1e-12)
    with pytest.raises(ValueError, match='scale_rewards must be one of'):
        grpo(R, G, scale_rewards='std')


def test_grpo_matches_trls_formula():
    torch = pytest.importorskip('torch')
    rewards = torch.tensor([1.0, 0.0, 0.25, 0.75, 3.0, 1.0, 2.0, 2.5])  # two groups of 4, as TRL views them
    mean = rewards.view(-1, 4).mean(dim=1).repeat_interleave(4)
    std = rewards.view(-1, 4).std(dim=1).repeat_interleave(4)
    trl = (rewards - mean) / (std + 1e-4)  # GRPOTrainer._generate_and_score_completions, scale_rewards='group'
    assert grpo(rewards.tolist(), ['x'] * 4 + ['y'] * 4) == pytest.approx(trl.tolist(), abs=1e-6)


def test_rloo_by_hand():
    # a: 1 - (0 + 0 + 1) / 3 = 2/3, 0 - (1 + 0 + 1) / 3 = -2/3; b: 3 - 1 = 2, 1 - 3 = -2; c: alone
    assert rloo(R, G) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 2.0, -2.0, 0.0], abs=1e-12)


def test_reinforce_by_hand():
    assert reinforce([1.0, 0.0, 0.5]) == pytest.approx([0.5, -0.5, 0.0])
    assert reinforce([1.0, 0.0, 0.5], baseline=0.2) == pytest.approx([0.8, -0.2, 0.3])


def _sample(uuid, group, reward, segment=0):
    return Sample(uuid=uuid, group=group, reward=reward, prompt_ids=[1], completion_ids=[2], loss_mask=[1],
                  segment=segment)


def test_segments_of_one_trajectory_count_once_in_the_baseline():
    # r0 has two segments; the group's rewards are r0: 1, r1: 0, r2: 0 (not 1, 1, 0, 0)
    samples = [_sample('r0', 'g', 1.0, 0), _sample('r0', 'g', 1.0, 1), _sample('r1', 'g', 0.0), _sample('r2', 'g', 0.0)]
    assign_advantages(samples, 'rloo')
    assert [s.advantage for s in samples] == pytest.approx([1.0, 1.0, -0.5, -0.5])
    with pytest.raises(ValueError, match='request r0: its segments disagree'):
        assign_advantages([_sample('r0', 'g', 1.0), _sample('r0', 'g', 0.0, 1)])
    with pytest.raises(ValueError, match='advantage method must be one of'):
        assign_advantages(samples, 'ppo')


def test_importance_weights_by_hand():
    torch = pytest.importorskip('torch')
    from mtflow.train.weights import geometric_sequence_weight, keep_within, ratios, truncated_is

    cur, beh = [-1.0, -0.5, -2.0], [-1.2, -1.5, -1.0]
    # ratios: exp(0.2), exp(1.0), exp(-1.0)
    assert ratios(cur, beh).tolist() == pytest.approx([math.exp(0.2), math.e, math.exp(-1.0)], rel=1e-6)
    assert truncated_is(cur, beh, cap=2.0).tolist() == pytest.approx([math.exp(0.2), 2.0, math.exp(-1.0)], rel=1e-6)
    # the trained tokens are the first two: exp((0.2 + 1.0) / 2)
    assert geometric_sequence_weight(cur, beh, [1, 1, 0]).item() == pytest.approx(math.exp(0.6), rel=1e-6)
    assert keep_within(cur, beh, upper=2.0).tolist() == [1.0, 0.0, 0.0]  # e > 2, 1/e < 1/2
    assert keep_within(cur, beh, upper=3.0, lower=0.3).tolist() == [1.0, 1.0, 1.0]
    rows = geometric_sequence_weight([cur, cur], [beh, beh], [[1, 0, 0], [0, 0, 0]])
    assert rows.tolist() == pytest.approx([math.exp(0.2), 1.0], rel=1e-6)  # a row with no trained token: 1
    live = torch.tensor(cur, requires_grad=True)
    assert not truncated_is(live, beh).requires_grad  # weights, not trained through
    with pytest.raises(ValueError, match='shape'):
        ratios(cur, beh[:2])
