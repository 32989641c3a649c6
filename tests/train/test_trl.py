"""TRL's ``GRPOTrainer`` (0.29, the version ms-swift 4.6 installs) driven by mtflow through its
public ``rollout_func`` hook: a few GRPO steps of the tiny model on CPU with multi-turn tool-use
rollouts (HF backend over the trainer's own model), with the trainer's loss hooked to check that
it received exactly the token records' ids and masks, the rollout logprobs, and the advantages
mtflow's ``grpo`` gives the same groups."""
from __future__ import annotations

import os

import pytest

from mtflow import Executor, RequestConfig
from mtflow.train import grpo
from mtflow.train.trl_rollout import TRLRollout, mtflow_reward

from tests.train.helpers import ToolEveryTurn, record_mask, transformers_own_callbacks as own_callbacks

torch = pytest.importorskip('torch')
trl = pytest.importorskip('trl')
datasets = pytest.importorskip('datasets')


@pytest.fixture
def transformers_own_callbacks(monkeypatch):
    """TRL as in a process that never imported ms-swift (other tests of this session may have:
    docs/training.md says so to users)."""
    own_callbacks(monkeypatch)


def test_grpo_trainer_steps_on_mtflow_rollouts_see_mtflows_exact_ids_masks_and_advantages(
        tmp_path, monkeypatch, transformers_own_callbacks):
    monkeypatch.setenv('TRL_EXPERIMENTAL_SILENCE', '1')
    from mtflow.backends.hf import HFBackend
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    model = make_model(tok, seed=0)
    backend = HFBackend(model, tok, default_max_tokens=6, seed=0)  # generates with the weights TRL trains
    executor = Executor(ToolEveryTurn(max_turns=3), backend,
                        RequestConfig(max_tokens=6, temperature=1.0, logprobs=True))
    rollout = TRLRollout(executor, keep=True)
    seen = []

    class Hooked(trl.GRPOTrainer):
        def _compute_loss(self, model, inputs):  # what the loss receives
            seen.append({k: v.detach().clone() if hasattr(v, 'detach') else v for k, v in inputs.items()})
            return super()._compute_loss(model, inputs)

    data = datasets.Dataset.from_list([{'prompt': [{'role': 'user', 'content': f'count to {i}'}]} for i in range(16)])
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=8, num_generations=4,
                          max_steps=3, learning_rate=1e-2, report_to='none', save_strategy='no', bf16=False,
                          beta=0.0, seed=0, logging_steps=1, disable_tqdm=True)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Hooked(model=model, processing_class=tok, reward_funcs=mtflow_reward, args=args, train_dataset=data,
                     rollout_func=rollout)
    trainer.train()

    assert len(seen) == len(rollout.batches) == 3
    for step, (inputs, samples, requests) in enumerate(zip(seen, rollout.batches, rollout.requests)):
        assert len(samples) == 8 and len({s.group for s in samples}) == 2  # two groups of four copies
        advantages = dict(zip([s.uuid for s in samples], grpo([s.reward for s in samples], [s.group for s in samples])))
        by_sequence = {tuple(r.token_record.sequence()): r for r in requests}
        assert len(by_sequence) == 8
        for r in range(8):  # TRL shuffles the rows of a generation batch: find each row's request by its ids
            prompt = inputs['prompt_ids'][r][inputs['prompt_mask'][r].bool()].tolist()
            keep = inputs['completion_mask'][r].bool()
            completion = inputs['completion_ids'][r][keep].tolist()
            request = by_sequence.pop(tuple(prompt + completion))  # exactly the token record's sequence
            record = request.token_record
            assert [t.version for t in record.turns] == [step] * 3  # each batch from the weights of its step
            assert [0] * len(prompt) + inputs['tool_mask'][r][keep].tolist() == record_mask(record)
            trained = inputs['tool_mask'][r][keep].bool()
            logps = inputs['sampling_per_token_logps'][r][keep][trained].tolist()
            assert logps == pytest.approx([v for turn in record.turns for v in turn.logprobs], abs=1e-6)
            assert inputs['advantages'][r].item() == pytest.approx(advantages[request.uuid], abs=1e-5)
        assert not by_sequence  # every rollout reached the loss once
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert os.environ.get('TRL_EXPERIMENTAL_SILENCE') == '1'
