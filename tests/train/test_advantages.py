"""Each advantage and importance-weight function against a hand computation."""
from __future__ import annotations

import math

import pytest

from mtflow.train import Sample, SampleError
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


def test_turn_returns_by_hand():
    from mtflow.train.advantages import turn_returns

    # G3 = 2, G2 = 0 + 0.5 * 2, G1 = 1 + 0.5 * 1
    assert turn_returns({1: 1.0, 3: 2.0}, 3, gamma=0.5) == {3: 2.0, 2: 1.0, 1: 1.5}
    assert turn_returns({2: 1.0}, 2) == {2: 1.0, 1: 1.0}
    with pytest.raises(ValueError, match='gamma'):
        turn_returns({}, 1, gamma=1.5)


def _two_turns(uuid, rewards, keys=()):
    from mtflow.train import samples_from_output

    line = {'uuid': uuid, 'reward': sum(rewards), 'response_token_ids': [[7, 8], [9]],
            'response_loss_mask': [[1, 1], [1]],
            'rollout_infos': {'num_turns': 2, 'turn_rewards': [{'turn': t + 1, 'reward': r, 'source': 'env'}
                                                               for t, r in enumerate(rewards)],
                              'state_keys': [{'turn': t + 1, 'key': k} for t, k in enumerate(keys)],
                              'token_record': {'prompt_ids': [1], 'glue_ids': [[3]], 'exact': True}}}
    return samples_from_output(line)[0]


def test_per_turn_advantages_by_hand_and_through_packing():
    from mtflow.train.advantages import assign_turn_advantages
    from mtflow.train.packing import pack

    a, b = _two_turns('q#0', [1.0, 0.0]), _two_turns('q#1', [0.0, 1.0])
    assert a.token_turns == [1, 1, None, 2] and a.turn_rewards == {1: 1.0, 2: 0.0}
    assign_turn_advantages([a, b], gamma=1.0)
    # returns: a: G1 = 1, G2 = 0; b: G1 = 1, G2 = 1; over the group mean 0.75, unbiased std 0.5
    up, down = 0.25 / (0.5 + 1e-4), -0.75 / (0.5 + 1e-4)
    assert a.token_advantages == pytest.approx([up, up, 0.0, down])
    assert b.token_advantages == pytest.approx([up, up, 0.0, up])
    (row, ) = pack([a, b], row_len=10)
    assert row.advantages == pytest.approx([0.0, up, up, 0.0, down, 0.0, up, up, 0.0, up])
    # with gamma 0.5 and the trajectory reward added to the last turn (outcome): a: G2 = 1, G1 = 1.5
    assign_turn_advantages([a], gamma=0.5, outcome=True, scale_rewards='none')
    assert a.token_advantages == pytest.approx([0.25, 0.25, 0.0, -0.25])  # centred on the mean 1.25


def test_per_turn_advantages_refuse_turns_that_cannot_be_placed():
    from mtflow.train.advantages import assign_turn_advantages

    s = Sample(uuid='c#0', group='c', reward=1.0, prompt_ids=[1], completion_ids=[2, 3], loss_mask=[1, 1],
               turns=(1, 2), token_turns=None)
    with pytest.raises(SampleError, match="request c#0, turn 1, field 'turn_rewards'"):
        assign_turn_advantages([s])


def test_gigpo_by_hand():
    from mtflow.train.advantages import assign_gigpo_advantages

    # three trajectories of one group; turn 1 from one state for all, turn 2: a and b from s1, c from s2
    a, b, c = (_two_turns('q#0', [0.0, 1.0], ['s0', 's1']), _two_turns('q#1', [0.0, 0.0], ['s0', 's1']),
               _two_turns('q#2', [1.0, 1.0], ['s0', 's2']))
    assert a.state_keys == {1: 's0', 2: 's1'}
    assign_gigpo_advantages([a, b, c], step_weight=1.0, gamma=0.5)
    eps = 1e-4
    # episode: rewards 1, 0, 2: mean 1, unbiased std 1
    ea, eb, ec = 0.0, -1 / (1 + eps), 1 / (1 + eps)
    # anchor s0: returns G1 = 0 + 0.5 * 1, 0, 1 + 0.5 * 1 = 0.5, 0, 1.5: mean 2/3, std sqrt(21) / 6
    sd0 = math.sqrt(21) / 6
    # anchor s1: G2 = 1 (a), 0 (b): mean 0.5, std sqrt(0.5); anchor s2: c alone, 0
    sd1 = math.sqrt(0.5)
    assert a.token_advantages == pytest.approx([ea + (-1 / 6) / (sd0 + eps)] * 2 + [0.0] + [ea + 0.5 / (sd1 + eps)])
    assert b.token_advantages == pytest.approx([eb + (-2 / 3) / (sd0 + eps)] * 2 + [0.0] + [eb - 0.5 / (sd1 + eps)])
    assert c.token_advantages == pytest.approx([ec + (5 / 6) / (sd0 + eps)] * 2 + [0.0] + [ec])
    # step_weight 0 is the episode-level GRPO advantage on every token
    assign_gigpo_advantages([a, b, c], step_weight=0.0)
    assert b.token_advantages == pytest.approx([eb, eb, 0.0, eb])


def _episode_only(uuid, reward, keys):
    """Two turns, no per-turn reward: only the episode ends with ``reward`` (GiGPO's paper setting)."""
    s = _two_turns(uuid, [], keys)
    s.reward = reward
    return s


def test_gigpo_with_an_episode_reward_only_by_hand():
    from mtflow.train.advantages import assign_gigpo_advantages

    # one group; turn 1 from s0 for all; turn 2: a and b from s1, c from s2; rewards 1, 0, 1 at the end only
    a, b, c = (_episode_only('q#0', 1.0, ['s0', 's1']), _episode_only('q#1', 0.0, ['s0', 's1']),
               _episode_only('q#2', 1.0, ['s0', 's2']))
    assert a.turn_rewards == {} and a.turns == (1, 2)
    eps = 1e-4
    # episode: 1, 0, 1: mean 2/3, unbiased std sqrt(1/3)
    se = math.sqrt(1 / 3)
    ea, eb = (1 / 3) / (se + eps), (-2 / 3) / (se + eps)
    # the episode reward is received at the last turn: G2 = R, G1 = gamma * R (gamma 0.5)
    # anchor s0: G1 = 0.5, 0, 0.5: mean 1/3, unbiased std sqrt(1/12)
    s0 = math.sqrt(1 / 12)
    # anchor s1: G2 = 1 (a), 0 (b): mean 0.5, std sqrt(0.5); anchor s2: c alone, 0
    s1 = math.sqrt(0.5)
    assign_gigpo_advantages([a, b, c], step_weight=1.0, gamma=0.5)
    assert a.token_advantages == pytest.approx([ea + (1 / 6) / (s0 + eps)] * 2 + [0.0] + [ea + 0.5 / (s1 + eps)])
    assert b.token_advantages == pytest.approx([eb - (1 / 3) / (s0 + eps)] * 2 + [0.0] + [eb - 0.5 / (s1 + eps)])
    assert c.token_advantages == pytest.approx([ea + (1 / 6) / (s0 + eps)] * 2 + [0.0] + [ea])
    # episode_reward=False is what it was before: no per-turn rewards, no step term, plain GRPO on every token
    assign_gigpo_advantages([a, b, c], step_weight=1.0, gamma=0.5, episode_reward=False)
    assert a.token_advantages == pytest.approx([ea, ea, 0.0, ea]) and b.token_advantages == pytest.approx([eb, eb, 0.0, eb])


def test_gigpo_adds_the_episode_reward_only_to_groups_without_per_turn_rewards_unless_told():
    from mtflow.train.advantages import assign_gigpo_advantages

    # group q has per-turn rewards (the episode reward is their sum): returns of the per-turn rewards alone
    a, b = _two_turns('q#0', [0.0, 1.0], ['s0', 's1']), _two_turns('q#1', [0.0, 0.0], ['s0', 's1'])
    # group r has none: its episode rewards are received at the last turn
    c, d = _episode_only('r#0', 2.0, ['t0', 't1']), _episode_only('r#1', 0.0, ['t0', 't1'])
    assign_gigpo_advantages([a, b, c, d], step_weight=1.0, gamma=1.0, scale_rewards='none')
    # q: episode rewards 1, 0: A^E = +-0.5; s0: G1 = 1, 0: +-0.5; s1: G2 = 1, 0: +-0.5
    assert a.token_advantages == pytest.approx([1.0, 1.0, 0.0, 1.0])
    # r: A^E = +-1; t0: G1 = 2, 0: +-1; t1: G2 = 2, 0: +-1
    assert c.token_advantages == pytest.approx([2.0, 2.0, 0.0, 2.0])
    assert d.token_advantages == pytest.approx([-2.0, -2.0, 0.0, -2.0])
    # True adds it to q too (double counting when the reward is the per-turn sum: the caller's choice)
    assign_gigpo_advantages([a, b], step_weight=1.0, gamma=1.0, scale_rewards='none', episode_reward=True)
    # G: a: G2 = 1 + 1 = 2, G1 = 2; b: 0, 0: step terms +-1
    assert a.token_advantages == pytest.approx([1.5, 1.5, 0.0, 1.5])
