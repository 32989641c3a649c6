"""The plain PyTorch reference loop: a few GRPO steps of the tiny model on multi-turn tool-use
rollouts through the HF backend, with a hook on the batch the loss receives checking that it holds
exactly the token record's ids and the mask the record implies (sampled 1; prompt, tool messages
and template glue 0), the advantages of each group, and that before each update the trainer's
logprobs of those ids equal the rollout's (which they do only when the ids are exact)."""
from __future__ import annotations

import copy
import math

import pytest

from mtflow import Executor, RequestConfig
from mtflow.train import grpo
from mtflow.train.loop import policy_loss, reference_loop
from mtflow.train.packing import unpack
from mtflow.train.staleness import StalePolicy

from tests.train.helpers import ToolEveryTurn, prompts, record_mask

torch = pytest.importorskip('torch')


def _setup(seed=0):
    from mtflow.backends.hf import HFBackend
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    model = make_model(tok, seed=seed)
    backend = HFBackend(model, tok, default_max_tokens=6, seed=seed)  # the trainer's model: rollouts see updates
    executor = Executor(ToolEveryTurn(max_turns=3), backend, RequestConfig(max_tokens=6, temperature=1.0, logprobs=True))
    return model, tok, executor


def test_grpo_steps_on_tool_use_rollouts_train_on_mtflows_exact_ids_and_masks():
    model, tok, executor = _setup()
    batches = [prompts(2, 4, start=2 * step) for step in range(3)]
    by_uuid = {r.uuid: r for batch in batches for r in batch}
    before = [p.detach().clone() for p in model.parameters()]
    seen = []

    def on_batch(batch, rows, samples):
        for row, ids, mask, adv in zip(rows, batch['input_ids'], batch['loss_mask'], batch['advantages']):
            assert ids.tolist() == row.input_ids and mask.tolist() == [float(m) for m in row.loss_mask]
            for index, part in unpack(row).items():
                record = by_uuid[samples[index].uuid].token_record
                assert part['input_ids'] == record.sequence()
                assert part['loss_mask'] == record_mask(record)
                start = row.sample_index.index(index)
                trained = [adv[start + k].item() for k, m in enumerate(part['loss_mask']) if m]
                assert trained == pytest.approx([samples[index].advantage] * len(trained))
        rewards = [s.reward for s in samples]
        assert [s.advantage for s in samples] == pytest.approx(grpo(rewards, [s.group for s in samples]))
        seen.append(sum(len(unpack(r)) for r in rows))

    history = reference_loop(executor, model, torch.optim.Adam(model.parameters(), lr=1e-2), batches, row_len=256,
                             on_batch=on_batch, tis_cap=2.0)
    assert seen == [8, 8, 8] and [h.step for h in history] == [0, 1, 2]
    assert [h.version for h in history] == [0, 1, 2]
    for h in history:
        assert h.samples == 8 and h.trained_tokens == 8 * 3 * 6  # 3 turns of 6 sampled ids each
        assert h.max_logprob_gap < 1e-4, h  # the trainer scored exactly the ids the rollout sampled
        assert math.isfinite(h.loss)
    for step, batch in enumerate(batches):  # each step's rollouts were stamped with the weights' version
        assert all(r.token_record.turns[-1].version == step for r in batch)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_withheld_tokens_never_reach_the_loss():
    model, tok, executor = _setup(seed=1)
    policy = StalePolicy(0, stale='withhold')  # every sample is stale at the version after its rollout

    class Late:
        """Roll out at version v, train at v + 1 (a trainer one step ahead of its data)."""

        def apply(self, samples, version):
            return policy.apply(samples, version + 1)

    masks = []
    history = reference_loop(executor, model, torch.optim.SGD(model.parameters(), lr=0.1), [prompts(1, 2)],
                             row_len=256, stale=Late(), on_batch=lambda b, r, s: masks.append(b['loss_mask']))
    assert masks[0].sum().item() == 0 and history[0].trained_tokens == 0 and history[0].loss == 0.0
    assert history[0].withheld_tokens == policy.counts.withheld_tokens == 2 * 3 * 6


def test_sample_mean_weighs_each_sample_once():
    logp = torch.zeros(1, 5, requires_grad=True)
    batch = {'loss_mask': torch.tensor([[1., 1., 1., 0., 1.]]), 'advantages': torch.tensor([[1., 1., 1., 0., -2.]]),
             'sample_index': torch.tensor([[0, 0, 0, 1, 1]]), 'logprobs': torch.zeros(1, 5)}
    # per token -A (ratio 1): sample 0 mean -1, sample 1 mean 2; token mean (-3 + 2) / 4, sample mean (-1 + 2) / 2
    assert policy_loss(logp, batch, agg='token-mean').item() == pytest.approx(-0.25)
    assert policy_loss(logp, batch, agg='sample-mean').item() == pytest.approx(0.5)


def test_per_turn_advantages_reach_the_loss_token_by_token():
    from mtflow.train.advantages import assign_turn_advantages

    model, tok, executor = _setup(seed=2)
    batches = []
    reference_loop(executor, model, torch.optim.SGD(model.parameters(), lr=0.1), [prompts(1, 4)], row_len=256,
                   advantage='turn', advantage_options={'gamma': 0.9},
                   on_batch=lambda batch, rows, samples: batches.append((batch, samples)))
    (batch, samples), = batches
    expected = assign_turn_advantages([copy.deepcopy(s) for s in samples], gamma=0.9)
    for row, adv in zip(batch['sample_index'], batch['advantages']):
        for index in set(row.tolist()) - {-1}:
            s, want = samples[index], expected[index]
            got = adv[row == index][len(s.prompt_ids):].tolist()
            assert got == pytest.approx([a if m else 0.0 for a, m in zip(want.token_advantages, s.loss_mask)])
            per_turn = {}
            for t, a in zip(s.token_turns, got):
                if t is not None:
                    per_turn.setdefault(t, set()).add(round(a, 6))
            assert sorted(per_turn) == [1, 2, 3] and all(len(v) == 1 for v in per_turn.values())  # one per turn


def test_masked_and_sequence_level_corrections_by_hand():
    from mtflow.train.weights import geometric_sequence_weight

    index = torch.tensor([[0, 0, 0, 1, 1, -1]])
    mask = torch.tensor([[0., 1., 1., 0., 1., 0.]])
    # current - behaviour on the trained tokens: sample 0: 0.2, 0.4 (mean 0.3); sample 1: -0.3
    cur, beh = torch.zeros(1, 6), -torch.tensor([[9.0, 0.2, 0.4, 9.0, -0.3, 0.0]])
    w = geometric_sequence_weight(cur, beh, mask, index)
    assert w.tolist()[0] == pytest.approx([math.exp(0.3)] * 3 + [math.exp(-0.3)] * 2 + [1.0], rel=1e-6)
    logp = torch.zeros(1, 6, requires_grad=True)
    batch = {'loss_mask': mask, 'advantages': torch.tensor([[0., 1., 1., 0., -2., 0.]]), 'sample_index': index,
             'logprobs': beh}
    expected = (-2 * math.exp(0.3) + 2 * math.exp(-0.3)) / 3
    assert policy_loss(logp, batch, sequence_weight=True).item() == pytest.approx(expected, rel=1e-6)
    # masked IS: the ratio exp(1) at position 2 is above 2, so that token leaves the mask
    batch = {'loss_mask': torch.tensor([[1., 1., 1., 0., 1.]]), 'advantages': torch.tensor([[1., 3., 1., 0., -2.]]),
             'sample_index': torch.tensor([[0, 0, 0, 1, 1]]), 'logprobs': torch.tensor([[0., 0., -1., 0., 0.]])}
    logp = torch.zeros(1, 5, requires_grad=True)
    assert policy_loss(logp, batch).item() == pytest.approx((-1 - 3 - 1 + 2) / 4)
    assert policy_loss(logp, batch, mask_outside=2.0).item() == pytest.approx((-1 - 3 + 2) / 3)
