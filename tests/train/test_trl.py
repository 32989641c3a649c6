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
from mtflow.train import SampleError
from mtflow.train.trl_rollout import UNCORRECTED_METRIC, TRLRollout, mtflow_reward

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


class NoLogprobsFor(ToolEveryTurn):
    """:class:`ToolEveryTurn` whose output for one request has no rollout logprobs (as when the
    contract clears logprobs that do not cover a turn's tokens), through its own public hooks."""

    def __init__(self, uuid, **kwargs):
        super().__init__(**kwargs)
        self.uuid = uuid

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        result = await super().on_turn_end(infer_request, response_choice, current_turn)
        if infer_request.uuid == self.uuid:
            result.setdefault('rollout_infos', {})['no_logprobs'] = True
        return result

    def finalize_output(self, output, finish_reason, turn):
        if (output.rollout_infos or {}).get('no_logprobs'):
            return output.model_copy(update={'rollout_logprobs': None})
        return None


def _grpo_one_step(tmp_path, monkeypatch, missing_logprobs):
    monkeypatch.setenv('TRL_EXPERIMENTAL_SILENCE', '1')
    from mtflow.backends.hf import HFBackend
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    model = make_model(tok, seed=0)
    executor = Executor(NoLogprobsFor('trl0-0#1', max_turns=2), HFBackend(model, tok, default_max_tokens=4, seed=0),
                        RequestConfig(max_tokens=4, temperature=1.0, logprobs=True))
    rollout = TRLRollout(executor, keep=True, missing_logprobs=missing_logprobs)
    seen = []

    class Hooked(trl.GRPOTrainer):
        def _compute_loss(self, model, inputs):
            seen.append(set(inputs))
            return super()._compute_loss(model, inputs)

    data = datasets.Dataset.from_list([{'prompt': [{'role': 'user', 'content': f'count to {i}'}]} for i in range(8)])
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=8, num_generations=4,
                          max_steps=1, learning_rate=1e-2, report_to='none', save_strategy='no', bf16=False, beta=0.0,
                          seed=0, logging_steps=1, disable_tqdm=True, off_policy_mask_threshold=0.5)
    trainer = Hooked(model=model, processing_class=tok, reward_funcs=mtflow_reward, args=args, train_dataset=data,
                     rollout_func=rollout)
    return trainer, rollout, seen


def test_a_sample_without_logprobs_is_counted_said_and_its_batch_trained_uncorrected(
        tmp_path, monkeypatch, transformers_own_callbacks):
    trainer, rollout, seen = _grpo_one_step(tmp_path, monkeypatch, 'uncorrected')
    with pytest.warns(RuntimeWarning) as warned:
        trainer.train()
    said = [str(w.message) for w in warned if 'mtflow TRL rollout' in str(w.message)]
    assert len(said) == 1 and said[0].startswith('mtflow TRL rollout: 1 of 8 samples have no rollout logprobs (first: '
                                                 'trl0-0#1); TRL takes logprobs for every sample of a batch or none: '
                                                 'so none of the 8 is corrected')
    assert rollout.uncorrected_samples == 1
    assert [s.uuid for s in rollout.batches[0] if s.logprobs is None] == ['trl0-0#1']
    assert seen and all('sampling_per_token_logps' not in inputs for inputs in seen)  # none reached TRL
    logged = [h[UNCORRECTED_METRIC] for h in trainer.state.log_history if UNCORRECTED_METRIC in h]
    assert logged == [1.0]


def test_refuse_stops_the_batch_naming_the_sample(tmp_path, monkeypatch, transformers_own_callbacks):
    trainer, rollout, seen = _grpo_one_step(tmp_path, monkeypatch, 'refuse')
    with pytest.raises(SampleError) as err:
        trainer.train()
    assert (err.value.uuid, err.value.field) == ('trl0-0#1', 'rollout_logprobs')
    assert 'no rollout logprobs (1 of 8 samples have none)' in str(err.value) and not seen


def test_trls_vllm_correction_refuses_a_sample_without_logprobs_whatever_the_rule():
    """TRL's vLLM importance sampling correction subtracts the rollout logprobs as given (vLLM
    cannot run here: a trainer with its two settings stands in); a batch that would hand it none is
    refused naming the first sample, under ``'uncorrected'`` too. Without it the batch goes on."""
    from types import SimpleNamespace

    from mtflow.train.samples import Sample
    from mtflow.train.trl_rollout import TRLRuns

    samples = [Sample('a', 'g', 1.0, [1], [2, 3], [1, 1], logprobs=[-0.1, -0.2]),
               Sample('b', 'g', 0.0, [1], [2, 3], [1, 1])]
    vllm = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True, _metrics={})
    with pytest.raises(SampleError) as err:
        TRLRuns(None, missing_logprobs='uncorrected').fields(samples, vllm)
    assert (err.value.uuid, err.value.field) == ('b', 'rollout_logprobs')
    assert "vllm_importance_sampling_correction=False" in str(err.value)
    runs = TRLRuns(None)
    with pytest.warns(RuntimeWarning, match='1 of 2 samples have no rollout logprobs'):
        fields = runs.fields(samples, SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=False))
    assert fields['logprobs'] is None and runs.uncorrected_samples == 1
