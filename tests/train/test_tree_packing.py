"""Tree training equals per-leaf training: branched groups of a real run (the tiny Qwen2 through
the HF backend, forks before turns 2 and 3, so every tree has two levels of forks), packed once as
trees, give the same loss and the same gradients as the same leaves packed one sequence each,
within 1e-5 in float32, for GRPO, per-token (TreeRL) advantages, both aggregations and the TIS
weight; and the shared prefix goes through the model once."""
from __future__ import annotations

import copy

import pytest

from mtflow import Branching, Executor, RequestConfig
from mtflow.train import SampleError, assign_advantages, assign_tree_advantages, samples_from_result
from mtflow.train.loop import policy_loss, token_logprobs
from mtflow.train.packing import pack, to_tensors
from mtflow.train.tree_packing import (pack_trees, tree_policy_loss, tree_tensors, tree_token_counts, tree_token_logprobs,
                                       tree_train_step)

from tests.train.helpers import ToolEveryTurn, prompts, tiny_backend

torch = pytest.importorskip('torch')


def fork_before_turns_2_and_3(infer_request, state, turn):
    return 2 if state == 'generating' and turn in (2, 3) else 0


@pytest.fixture(scope='module')
def branched():
    backend = tiny_backend(seed=0, max_tokens=5)
    requests = prompts(3, 1)
    executor = Executor(ToolEveryTurn(max_turns=4), backend, RequestConfig(max_tokens=5, temperature=1.0, logprobs=True),
                        branch=Branching(at=fork_before_turns_2_and_3, copies=2, leaves=4))
    result = executor.run(requests)
    assert result.ok, result.failures
    samples = samples_from_result(result, requests)
    return backend.model, result.trees, samples


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _per_leaf(model, samples, **loss):
    model.zero_grad()
    batch = to_tensors(pack(samples, row_len=max(len(s.input_ids) for s in samples)))
    value = policy_loss(token_logprobs(model, batch), batch, **loss)
    value.backward()
    return float(value.detach()), _grads(model)


def _as_tree(model, trees, samples, **loss):
    model.zero_grad()
    batch = tree_tensors(pack_trees(trees, samples))
    value = tree_policy_loss(tree_token_logprobs(model, batch), batch, **loss)
    value.backward()
    return float(value.detach()), _grads(model)


def test_the_trees_have_forks_at_two_levels(branched):
    _, trees, samples = branched
    assert len(trees) == 3 and len(samples) == 12
    for tree in trees:
        assert len(tree['leaves']) == 4 and [f['turn'] for f in tree['forks']] == [2, 3, 3]
        assert all(n['span'] is not None for n in tree['nodes'])


@pytest.mark.parametrize('agg', ['token-mean', 'sample-mean'])
@pytest.mark.parametrize('advantage', ['grpo', 'tree'])
def test_tree_loss_and_gradients_equal_per_leaf_training(branched, agg, advantage):
    model, trees, samples = branched
    samples = copy.deepcopy(samples)
    if advantage == 'grpo':
        assign_advantages(samples, 'grpo')
    else:
        assign_tree_advantages(samples, trees)  # a different advantage per node, so per token
    model = model.float().eval()  # no dropout: the same forward both ways
    leaf_loss, leaf_grads = _per_leaf(model, samples, agg=agg, tis_cap=2.0)
    tree_loss, tree_grads = _as_tree(model, trees, samples, agg=agg, tis_cap=2.0)
    assert tree_loss == pytest.approx(leaf_loss, abs=1e-5)
    worst = max(float((a - b).abs().max()) for a, b in zip(leaf_grads, tree_grads))
    assert worst < 1e-5
    assert any(float(g.abs().max()) > 1e-4 for g in leaf_grads)  # the gradients are not all zero


def test_every_token_sees_its_own_leafs_logits_and_the_rollouts_logprobs(branched):
    model, trees, samples = branched
    model = model.float().eval()
    rows = pack_trees(trees, samples)
    batch = tree_tensors(rows)
    with torch.no_grad():
        logp = tree_token_logprobs(model, batch)
    trained = batch['leaf_mask'].sum(-1) > 0
    # the rollout sampled these tokens from the same weights: the trainer's logprob is the rollout's
    assert float((logp - batch['logprobs'])[trained].abs().max()) < 1e-4
    # each leaf's trained tokens, read off the tree in its columns, are the leaf's own, in order
    row = rows[0]
    for k, uuid in enumerate(row.leaves):
        sample = next(s for s in samples if s.uuid == uuid)
        mine = [row.input_ids[t] for t in range(len(row)) if row.leaf_mask[t][k]]
        assert mine == [i for i, m in zip(sample.completion_ids, sample.loss_mask) if m]
    counts = tree_token_counts(rows, samples)
    assert counts['leaf_tokens'] == sum(len(s.input_ids) for s in samples)
    assert counts['tree_tokens'] < 0.75 * counts['leaf_tokens']  # the shared turns once, not four times


def test_a_tree_step_moves_the_weights_and_matches_the_rollout(branched):
    model, trees, samples = branched
    model = copy.deepcopy(model).float()
    samples = copy.deepcopy(samples)
    assign_tree_advantages(samples, trees)
    before = [p.detach().clone() for p in model.parameters()]
    done = tree_train_step(model, torch.optim.Adam(model.parameters(), lr=1e-2), trees, samples, row_len=512)
    assert done['max_logprob_gap'] < 1e-4 and done['rows'] == 2 and done['tree_tokens'] < done['leaf_tokens']
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_what_cannot_be_a_tree_is_refused_naming_it(branched):
    _, trees, samples = branched
    with pytest.raises(SampleError, match=r"request g?.*field 'tree': tree .*: no sample for its leaf"):
        pack_trees(trees[:1], [s for s in samples if s.uuid != trees[0]['leaves'][-1]])
    broken = copy.deepcopy(trees[0])
    broken['nodes'][1]['span'] = None
    with pytest.raises(SampleError, match='has no token span'):
        pack_trees([broken], samples)
    with pytest.raises(ValueError, match='do not fit a row of 8'):
        pack_trees(trees[:1], samples, row_len=8)


class StopsOneRootEarly(ToolEveryTurn):
    """``p1#0`` ends after its first turn, before its forks: the leaf budget tops its tree up with copies
    of the prompt (siblings of the prompt's only other node)."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return infer_request.uuid == 'p1#0' or super().check_finished(infer_request, response_choice, current_turn)


def test_a_tree_topped_up_with_copies_of_its_prompt_trains_as_its_leaves():
    backend = tiny_backend(seed=1, max_tokens=5)
    requests = prompts(2, 1)
    result = Executor(StopsOneRootEarly(max_turns=4), backend,
                      RequestConfig(max_tokens=5, temperature=1.0, logprobs=True),
                      branch=Branching(at=fork_before_turns_2_and_3, copies=2, leaves=4)).run(requests)
    assert result.ok, result.failures
    topped = next(t for t in result.trees if t['root'] == 'p1#0')
    assert topped['topped_up'] == 3 and len(topped['leaves']) == 4
    samples = assign_tree_advantages(samples_from_result(result, requests), result.trees)
    model = backend.model.float().eval()
    leaf_loss, leaf_grads = _per_leaf(model, samples)
    tree_loss, tree_grads = _as_tree(model, result.trees, samples)
    assert tree_loss == pytest.approx(leaf_loss, abs=1e-5)
    assert max(float((a - b).abs().max()) for a, b in zip(leaf_grads, tree_grads)) < 1e-5


def test_the_reference_loop_steps_on_trees_as_it_steps_on_leaves():
    from mtflow.train import reference_loop

    def loop(trees):
        backend = tiny_backend(seed=0, max_tokens=5)
        model = backend.model.float()
        executor = Executor(ToolEveryTurn(max_turns=4), backend,
                            RequestConfig(max_tokens=5, temperature=1.0, logprobs=True),
                            branch=Branching(at=fork_before_turns_2_and_3, copies=2, leaves=4))
        history = reference_loop(executor, model, torch.optim.SGD(model.parameters(), lr=1.0), [prompts(2, 1)],
                                 row_len=1024, advantage='tree', trees=trees, tis_cap=2.0)
        return history, model

    (as_trees, ), tree_model = loop(True)
    (as_leaves, ), leaf_model = loop(False)
    assert as_trees.samples == as_leaves.samples == 8 and as_trees.trained_tokens == as_leaves.trained_tokens
    assert as_trees.loss == pytest.approx(as_leaves.loss, abs=1e-5) and as_trees.max_logprob_gap < 1e-4
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(tree_model.parameters(), leaf_model.parameters()))
    with pytest.raises(ValueError, match='trees=True takes neither mask_outside'):
        reference_loop(None, None, None, [], row_len=8, trees=True, sequence_weight=True)


def test_leaves_without_rollout_logprobs_train_uncorrected_as_per_leaf_training_does(branched):
    """A tree whose leaves have no rollout logprobs is trained without the TIS correction (ratio 1),
    as :func:`~mtflow.train.loop.train_step` trains such samples (issue 47, item 13), never
    weighted against the 0.0 its row would hold; the step counts them, and ``refuse`` refuses."""
    model, trees, samples = branched
    samples = copy.deepcopy(samples)
    assign_advantages(samples, 'grpo')
    bare = set(trees[0]['leaves'])
    for s in samples:
        if s.uuid in bare:
            s.logprobs = None
    model = model.float().eval()
    leaf_loss, leaf_grads = _per_leaf(model, samples, tis_cap=2.0)
    tree_loss, tree_grads = _as_tree(model, trees, samples, tis_cap=2.0)
    assert tree_loss == pytest.approx(leaf_loss, abs=1e-5)
    assert max(float((a - b).abs().max()) for a, b in zip(leaf_grads, tree_grads)) < 1e-5
    stepped = copy.deepcopy(model)
    optimizer = torch.optim.SGD(stepped.parameters(), lr=0.0)
    assert tree_train_step(stepped, optimizer, trees, samples, tis_cap=2.0)['uncorrected_samples'] == len(bare)
    with pytest.raises(SampleError, match='no rollout logprobs'):
        tree_train_step(stepped, optimizer, trees, samples, tis_cap=2.0, missing_logprobs='refuse')
