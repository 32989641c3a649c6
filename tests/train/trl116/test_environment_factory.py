"""TRL 1.16's ``GRPOTrainer(environment_factory=...)`` over mtflow schedulers: two environments
picked per example by the dataset's ``environment`` column (a Python scheduler calling a tool every
turn, and the YAML guess-the-number game), each episode run by its scheduler's executor over the
trainer's own model, the reward each environment's ``get_reward``. The trainer's loss is hooked:
for every row, its ids are exactly one episode's token-record sequence, its tool mask the one the
record implies, its sampling logprobs the rollout's, and its advantage ``mtflow.train.grpo``'s of
the rewards ``get_reward`` gave. Runs where TRL 1.16 is importable (``tests/train/test_trl116.py``
runs this file with ``.extras/trl116`` first on the path)."""
from __future__ import annotations

import pytest

from mtflow import Executor, RequestConfig
from mtflow.declarative import load_scheduler
from mtflow.train import grpo
from mtflow.train.trl_environment import MtflowEpisode, TRLEnvironment

from tests.train.helpers import TOOL_TEMPLATE, ToolEveryTurn, record_mask
from tests.train.trl116 import trl_1_16

torch = pytest.importorskip('torch')
trl = trl_1_16()
datasets = pytest.importorskip('datasets')

GAME = {'max_turns': 3, 'system_prompt': 'Guess my number between 1 and 100.', 'stop': {'on_length': False},
        'env': {'impl': 'guess_number', 'kwargs': {'low': 1, 'high': 100, 'max_guesses': 6}}}


def test_grpo_trainer_with_mtflow_environments_gets_mtflows_exact_ids_masks_logprobs_and_advantages(tmp_path, monkeypatch):
    monkeypatch.setenv('TRL_EXPERIMENTAL_SILENCE', '1')
    from mtflow.backends.hf import HFBackend
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    tok = tok.__class__.from_pretrained(_saved(tok, tmp_path))  # a copy: the cached tokenizer keeps its template
    tok.chat_template = TOOL_TEMPLATE
    model = make_model(tok, seed=0)
    backend = HFBackend(model, tok, default_max_tokens=6, seed=0)  # generates with the weights TRL trains
    config = RequestConfig(max_tokens=6, temperature=1.0, logprobs=True)
    tools = TRLEnvironment(Executor(ToolEveryTurn(max_turns=3), backend, config))
    game = TRLEnvironment(Executor(load_scheduler(GAME, tokenizer=tok), backend, config))
    env = TRLEnvironment.several({'tools': tools, 'game': game}, keep=True)
    seen = []

    class Hooked(trl.GRPOTrainer):
        def _compute_loss(self, model, inputs):  # what the loss receives
            seen.append({k: v.detach().clone() if hasattr(v, 'detach') else v for k, v in inputs.items()})
            return super()._compute_loss(model, inputs)

    rows = [{'prompt': [{'role': 'user', 'content': f'count to {i}'}], 'environment': 'tools'} for i in range(4)] + \
        [{'prompt': [{'role': 'user', 'content': 'your guess?'}], 'environment': 'game'} for _ in range(4)]
    args = trl.GRPOConfig(output_dir=str(tmp_path / 'out'), use_cpu=True, per_device_train_batch_size=8,
                          num_generations=4, max_steps=2, learning_rate=1e-2, report_to='none', save_strategy='no',
                          bf16=False, beta=0.0, seed=0, logging_steps=1, disable_tqdm=True)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Hooked(model=model, processing_class=tok, args=args, train_dataset=datasets.Dataset.from_list(rows),
                     **env.trainer_kwargs())
    assert trainer.tools == [] and trainer.reward_func_names == ['MtflowEpisode']  # no TRL tool loop; the env's reward
    trainer.train()

    assert len(seen) == len(env.batches) == 2
    kinds = set()
    for inputs, samples, requests in zip(seen, env.batches, env.requests):
        assert len(samples) == 8 and len({s.group for s in samples}) == 2  # two groups of four episodes
        advantages = dict(zip([s.uuid for s in samples], grpo([s.reward for s in samples], [s.group for s in samples])))
        by_sequence = {tuple(r.token_record.sequence()): r for r in requests}
        for r in range(len(samples)):  # TRL shuffles the rows of a generation batch: each is found by its ids
            prompt = inputs['prompt_ids'][r][inputs['prompt_mask'][r].bool()].tolist()
            keep = inputs['completion_mask'][r].bool()
            request = by_sequence.pop(tuple(prompt + inputs['completion_ids'][r][keep].tolist()))
            record = request.token_record
            assert [0] * len(prompt) + inputs['tool_mask'][r][keep].tolist() == record_mask(record)
            trained = inputs['tool_mask'][r][keep].bool()
            logps = inputs['sampling_per_token_logps'][r][keep][trained].tolist()
            assert logps == pytest.approx([v for turn in record.turns for v in turn.logprobs], abs=1e-6)
            assert inputs['advantages'][r].item() == pytest.approx(advantages[request.uuid], abs=1e-5)
            kinds.add('game' if 'Guess' in str(request.messages[0]) else 'tools')
        assert not by_sequence
    assert kinds == {'tools', 'game'}
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_an_episode_says_what_it_is_missing():
    episode = TRLEnvironment(None).factory()
    assert isinstance(episode, MtflowEpisode)
    with pytest.raises(ValueError, match='needs a "prompt" column'):
        episode.reset(question='2 + 2')
    with pytest.raises(RuntimeError, match='get_reward before the episode ran'):
        episode.get_reward()


def test_an_episode_passed_without_rollout_func_stops_at_its_reward_saying_what_to_pass(tmp_path, monkeypatch):
    """``environment_factory=TRLEnvironment(...).factory`` alone: TRL offers no tool and generates one
    reply itself; the first reward stops training with the line naming both ways."""
    monkeypatch.setenv('TRL_EXPERIMENTAL_SILENCE', '1')
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer().__class__.from_pretrained(_saved(make_tokenizer(), tmp_path))
    tok.chat_template = TOOL_TEMPLATE
    args = trl.GRPOConfig(output_dir=str(tmp_path / 'out'), use_cpu=True, per_device_train_batch_size=4,
                          num_generations=4, max_steps=1, max_completion_length=4, report_to='none', save_strategy='no',
                          bf16=False, seed=0, disable_tqdm=True)
    rows = [{'prompt': [{'role': 'user', 'content': 'count to 3'}]}]
    trainer = trl.GRPOTrainer(model=make_model(tok, seed=0), processing_class=tok, args=args,
                              train_dataset=datasets.Dataset.from_list(rows), environment_factory=TRLEnvironment(None).factory)
    assert trainer.tools == []
    with pytest.raises(RuntimeError, match='rollout_func=TRLEnvironment.rollout_func .*trl_tool_environment'):
        trainer.train()


def _saved(tok, tmp_path):
    tok.save_pretrained(tmp_path / 'tok')
    return tmp_path / 'tok'
