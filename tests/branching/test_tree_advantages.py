"""The tree record of a small branched run, and TreeRL's node values and advantages on it, against a
hand computation; each leaf sample's tokens get the advantage of their node."""
from __future__ import annotations

import math

import pytest

from mtflow import Executor
from mtflow.train import Sample, assign_tree_advantages, leaf_path, tree_advantages, tree_values
from mtflow.train.errors import SampleError
from tests.branching.helpers import ToolLoop, model
from tests.helpers import req


def small_tree() -> dict:
    """``r`` forks before turn 2 into ``r``, ``r~1``; ``r~1`` forks before turn 3 into ``r~1``, ``r~1~1``."""
    def hook(infer_request, state, turn):
        return 2 if (infer_request.uuid, turn) in (('r', 2), ('r~1', 3)) else None

    result = Executor(ToolLoop(), model, max_turns=3, branch={'at': {'hook': hook}}).run([req('r')])
    [tree] = result.trees
    return tree


def test_the_tree_record_has_a_node_per_run_of_turns():
    tree = small_tree()
    assert tree['leaves'] == ['r', 'r~1', 'r~1~1']
    shape = [(n['id'], n['parent'], n['uuid'], n['turns'], sorted(n['leaves'])) for n in tree['nodes']]
    assert shape == [
        (0, None, None, [0, 0], ['r', 'r~1', 'r~1~1']),  # the prompt
        (1, 0, 'r', [1, 1], ['r', 'r~1', 'r~1~1']),
        (2, 1, 'r', [2, 3], ['r']),
        (3, 1, 'r~1', [2, 2], ['r~1', 'r~1~1']),
        (4, 3, 'r~1', [3, 3], ['r~1']),
        (5, 3, 'r~1~1', [3, 3], ['r~1~1']),
    ]
    assert [n['value'] for n in tree['nodes']] == [
        pytest.approx(v) for v in [(1 + 3 + 5) / 3, (1 + 3 + 5) / 3, 1, (3 + 5) / 2, 3, 5]]  # reward: len(uuid)
    assert [n['uuid'] for n in leaf_path(tree, 'r~1~1')] == [None, 'r', 'r~1', 'r~1~1']


def test_tree_advantages_match_a_hand_computation():
    tree = small_tree()
    rewards = {'r': 1.0, 'r~1': 0.0, 'r~1~1': 1.0}
    values = tree_values(tree, rewards)
    assert values == pytest.approx({0: 2 / 3, 1: 2 / 3, 2: 1.0, 3: 0.5, 4: 0.0, 5: 1.0})
    # A(n) = (V(n) - V(root)) + (V(n) - V(parent)), over sqrt(leaves under n)
    hand = {0: 0.0, 1: 0.0, 2: (1 / 3 + 1 / 3) / 1, 3: (-1 / 6 - 1 / 6) / math.sqrt(2), 4: (-2 / 3 - 1 / 2) / 1,
            5: (1 / 3 + 1 / 2) / 1}
    assert tree_advantages(tree, rewards) == pytest.approx(hand)
    assert tree_advantages(tree, rewards, weight='none')[3] == pytest.approx(-1 / 3)
    assert tree_advantages(tree, rewards, global_=False)[4] == pytest.approx(-1 / 2)
    assert tree_advantages(tree, rewards, local=False)[5] == pytest.approx(1 / 3)


def test_each_token_gets_its_node_advantage():
    tree = small_tree()
    rewards = {'r': 1.0, 'r~1': 0.0, 'r~1~1': 1.0}
    adv = tree_advantages(tree, rewards)
    leaf = Sample(uuid='r~1~1', group='r', reward=1.0, prompt_ids=[9], completion_ids=[1, 1, 7, 2, 2, 7, 3],
                  loss_mask=[1, 1, 0, 1, 1, 0, 1], token_turns=[1, 1, None, 2, 2, None, 3])
    other = Sample(uuid='r', group='r', reward=1.0, prompt_ids=[9], completion_ids=[1, 7, 2, 7, 3],
                   loss_mask=[1, 0, 1, 0, 1], token_turns=[1, None, 2, None, 3])
    assign_tree_advantages([leaf, other], [tree], rewards)
    assert leaf.token_advantages == pytest.approx([adv[1], adv[1], 0, adv[3], adv[3], 0, adv[5]])
    assert other.token_advantages == pytest.approx([adv[1], 0, adv[2], 0, adv[2]])


def test_a_leaf_without_a_reward_or_a_sample_of_no_tree_is_an_error():
    tree = small_tree()
    with pytest.raises(SampleError, match='without a numeric reward: r~1'):
        tree_values(tree, {'r': 1.0, 'r~1': None, 'r~1~1': 0.0})
    stray = Sample(uuid='x', group='x', reward=0.0, prompt_ids=[1], completion_ids=[2], loss_mask=[1], token_turns=[1])
    with pytest.raises(SampleError, match='no leaf of the trees'):
        assign_tree_advantages([stray], [tree])
