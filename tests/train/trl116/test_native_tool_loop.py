"""TRL 1.16's own tool loop over an mtflow YAML scheduler: ``GRPOTrainer(environment_factory=
trl_tool_environment(scheduler, args))`` and nothing else (no ``rollout_func``, no reward function).

TRL generates (the tiny random model's ``generate`` is scripted, so that it writes Qwen-style tool
calls: a calculator call varied per copy, then ``submit`` with the result, then a plain reply),
parses the calls with its Qwen response parser, calls the environment's methods and tokenizes
their results itself. The checks: TRL read the tools' schemas back from the methods exactly as
the scheduler declares them; every call the model wrote ran through mtflow's tool runner (the
``submit`` tool recorded each answer) and came back as the scheduler's observation (its
``template`` and ``error_template``, in the completion the loss received, with tool mask 0); the
reward is the scheduler's ``reward`` (one column named after the scheduler, and the advantage the
loss got is ``mtflow.train.grpo``'s of it); ``max_turns`` became TRL's
``max_tool_calling_iterations``; the weights moved. And a scheduler with a stop rule is refused
with one line before a trainer is made. Runs where TRL 1.16 is importable
(``tests/train/test_trl116.py``)."""
from __future__ import annotations

import json

import pytest

from mtflow.declarative import load_scheduler
from mtflow.train import grpo
from mtflow.train.errors import NotExpressibleInTRL
from mtflow.train.trl_native import trl_tool_environment

from tests.train.trl116 import native_tools, trl_1_16
from tests.train.trl116.native_tools import ARITH, QUESTIONS, TOOL_RESPONSE, scripted_generate

torch = pytest.importorskip('torch')
trl = trl_1_16()
datasets = pytest.importorskip('datasets')

def test_trls_own_tool_loop_runs_mtflows_tools_observations_and_reward(tmp_path, monkeypatch):
    monkeypatch.setenv('TRL_EXPERIMENTAL_SILENCE', '1')
    from transformers.utils import get_json_schema
    from trl.chat_template_utils import qwen2_5_chat_template

    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    tok.save_pretrained(tmp_path / 'tok')
    tok = tok.__class__.from_pretrained(tmp_path / 'tok')  # a copy: the cached tokenizer keeps its template
    tok.chat_template = qwen2_5_chat_template  # TRL knows its response parser
    model = make_model(tok, seed=0, max_position_embeddings=4096)
    monkeypatch.setattr(model, 'generate', scripted_generate(tok))
    scheduler = load_scheduler(dict(ARITH, max_turns=4), tokenizer=tok)
    args = trl.GRPOConfig(output_dir=str(tmp_path / 'out'), use_cpu=True, per_device_train_batch_size=8,
                          num_generations=4, max_steps=2, learning_rate=1e-2, report_to='none', save_strategy='no',
                          bf16=False, beta=0.0, seed=0, logging_steps=1, disable_tqdm=True, max_completion_length=512)
    env = trl_tool_environment(scheduler, args)
    assert args.max_tool_calling_iterations == 3  # max_turns 4: three rounds of tool calls
    seen, batches = [], []

    class Hooked(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            batches.append([(e._request.model_copy(deep=True), e._state.counters()) for e in self.environments])
            return out

        def _compute_loss(self, model, inputs):  # what the loss receives
            seen.append({k: v.detach().clone() if hasattr(v, 'detach') else v for k, v in inputs.items()})
            return super()._compute_loss(model, inputs)

    rows = [{'prompt': [{'role': 'user', 'content': f'What is {q}?'}], 'answer': a} for q, a in QUESTIONS.items()]
    before = [p.detach().clone() for p in model.parameters()]
    native_tools.SUBMITTED.clear()
    trainer = Hooked(model=model, processing_class=tok, args=args, train_dataset=datasets.Dataset.from_list(rows),
                     environment_factory=env)
    assert [t.__name__ for t in trainer.tools] == ['calculator', 'submit'] and trainer.reward_func_names == ['arith']
    assert trainer.max_tool_calling_iterations == 3
    for method in trainer.tools:  # TRL reads each tool's schema back exactly as the scheduler declares it
        assert get_json_schema(method) == next(t.spec() for t in scheduler.tools if t.name == method.__name__)
    trainer.train()

    assert len(seen) == len(batches) == 2
    submitted = []
    for inputs, episodes in zip(seen, batches):
        rewards = [native_tools.graded(request, infos) for request, infos in episodes]
        groups = [request.data_dict['answer'] for request, _ in episodes]
        assert sorted(rewards) == [-0.25, -0.25, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]  # per question: right, off, right, broken
        advantages = grpo(rewards, groups)
        by_text = {}
        for (request, infos), advantage in zip(episodes, advantages):
            observations = [m['content'] for m in request.messages if m['role'] == 'tool']
            assert observations[1].startswith('Result: received ') and infos['tool_calls'] == 2
            assert observations[0].startswith('Result: ' if infos['tool_errors'] == 0 else 'Oops: calculator raised')
            submitted.append(native_tools.last_submitted(request.messages))
            by_text.setdefault(json.dumps(observations), []).append(advantage)
        for r in range(len(episodes)):  # TRL shuffles a generation batch's rows: each is found by its tool messages
            keep = inputs['completion_mask'][r].bool()
            ids, tool_mask = inputs['completion_ids'][r][keep], inputs['tool_mask'][r][keep]
            tool_text = tok.decode(ids[tool_mask == 0].tolist())
            model_text = tok.decode(ids[tool_mask == 1].tolist())
            observations = TOOL_RESPONSE.findall(tool_text)
            assert len(observations) == 2 and '<tool_call>' not in tool_text and '<tool_response>' not in model_text
            assert model_text.count('<tool_call>') == 2 and model_text.endswith('Done.<|im_end|>')
            assert inputs['advantages'][r].item() == pytest.approx(by_text[json.dumps(observations)].pop(), abs=1e-5)
    assert native_tools.SUBMITTED == submitted  # every submit the model wrote ran through mtflow's tool runner
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_scheduler_with_a_stop_rule_is_refused_before_the_trainer_is_made(tmp_path):
    args = trl.GRPOConfig(output_dir=str(tmp_path / 'out'), use_cpu=True, report_to='none')
    scheduler = load_scheduler(dict(ARITH, stop={'regex': {'answered': '<answer>'}}))
    with pytest.raises(NotExpressibleInTRL) as refused:
        trl_tool_environment(scheduler, args)
    assert str(refused.value).count('\n') == 0 and 'stop.regex' in str(refused.value)
    assert args.max_tool_calling_iterations is None  # a refused scheduler changes nothing
