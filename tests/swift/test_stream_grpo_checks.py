"""The stream trainer's pieces that need no training run: the exact encoding in and out of
ms-swift's template, the ``mtflow_reward`` reward function, registration with ms-swift's
``TrainerFactory``, and the options and settings it refuses, each with its reason.

Importing ms-swift's GRPO trainer (and so ``mtflow.train.swift_grpo``) deletes TRL's
``GRPOTrainer.__init__`` and ``log`` and replaces TRL's ``seed_worker`` for the whole process
(``swift/rlhf_trainers/grpo_trainer.py``): the ``sg`` fixture imports it here, not at
collection, and puts TRL's back afterwards, so that TRL's tests later in the session still build
TRL's trainer."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from mtflow.train import Sample, SampleError, StalePolicy

pytest.importorskip('swift')
trl_grpo = pytest.importorskip('trl.trainer.grpo_trainer')


@pytest.fixture(scope='module')
def sg() -> Iterator[Any]:
    """``mtflow.train.swift_grpo``, with TRL's GRPO trainer as it was before, afterwards."""
    trainer = trl_grpo.GRPOTrainer
    kept = {name: vars(trainer)[name] for name in ('__init__', 'log') if name in vars(trainer)}
    seed_worker = trl_grpo.seed_worker
    import mtflow.train.swift_grpo as module  # lazy: imports ms-swift's GRPO trainer, which changes TRL's
    yield module
    for name, value in kept.items():
        setattr(trainer, name, value)
    trl_grpo.seed_worker = seed_worker


def sample() -> Sample:
    return Sample(uuid='g0#1', group='g0', reward=0.5, prompt_ids=[1, 2, 3], completion_ids=[4, 5, 6, 7],
                  loss_mask=[1, 1, 0, 1], logprobs=[-0.1, -0.2, 0.0, -0.4])


class Template:
    def encode(self, inputs, return_template_inputs=False, return_length=False):
        return {'rendered': inputs['messages'], 'length': return_length}


def test_exact_encoding_answers_for_mtflow_samples_only_and_leaves_the_template_as_it_was(sg):
    template = Template()
    s = sg.StreamSample(messages=[{'role': 'user', 'content': 'hi'}], mtflow_sample=sample(), rollout_mask=[1, 1, 0, 0])
    with sg.exact_encoding(template):
        encoded = template.encode(s.to_template_dict(), return_length=True)
        other = template.encode({'messages': ['m']}, return_length=True)
    assert encoded == {'input_ids': [1, 2, 3, 4, 5, 6, 7], 'labels': [-100, -100, -100, 4, 5, -100, -100],
                       'length': 7, 'lengths': [7]}  # labelled by the rollout mask: the withheld token later
    assert other == {'rendered': ['m'], 'length': True}
    assert 'encode' not in vars(template) and template.encode({'messages': []}) == {'rendered': [], 'length': False}
    assert sg.EXACT_KEY not in sg.StreamSample(messages=[]).to_template_dict()


def test_mtflow_reward_reads_the_schedulers_reward_and_names_a_trajectory_without_one(sg):
    reward = sg.MtflowReward()
    assert reward(['a', 'b'], rollout_infos=[{'reward': 1}, {'reward': 0.25}]) == [1.0, 0.25]
    with pytest.raises(ValueError, match=r"trajectory 'g3#1' has no numeric rollout_infos\['reward'\]"):
        reward(['a', 'b'], rollout_infos=[{'reward': 1}, {'reward': True}], request_id=['g3#0', 'g3#1'])


def test_options_that_cannot_work_are_refused_before_ms_swift_builds_anything(sg):
    with pytest.raises(ValueError, match=r"stream_options \['max_stalenes'\] are not options of Executor.stream"):
        sg.StreamGRPOTrainer(stream_options={'max_stalenes': 1})
    with pytest.raises(ValueError, match="stale='drop' would take a sample out of its group"):
        sg.StreamGRPOTrainer(stale_policy=StalePolicy(1, stale='drop'))
    with pytest.raises(TypeError, match='stale_policy must be a mtflow.train.StalePolicy, not dict'):
        sg.StreamGRPOTrainer(stale_policy={'max_staleness': 1})


@pytest.mark.parametrize('setting, why', [
    ({'eval_strategy': 'steps'}, "eval_strategy='steps': evaluation through the stream is not built"),
    ({'processes': 2}, '2 processes: one stream per process is not built'),
    ({'async_generate': True}, "async_generate: ms-swift's own asynchronous generation"),
    ({'multi_turn_scheduler': object()}, "multi_turn_scheduler: ms-swift's driver is not used"),
    ({'padding_free': True}, 'padding_free with a stale_policy'),
])
def test_trainer_settings_the_stream_does_not_serve_are_refused(sg, setting, why):
    trainer = sg.StreamGRPOTrainer.__new__(sg.StreamGRPOTrainer)  # the settings a built trainer has, nothing else
    trainer.args = SimpleNamespace(eval_strategy=setting.get('eval_strategy', 'no'),
                                   async_generate=setting.get('async_generate', False))
    trainer.accelerator = SimpleNamespace(num_processes=setting.get('processes', 1))
    trainer.multi_turn_scheduler = setting.get('multi_turn_scheduler')
    trainer.stale_policy = StalePolicy(0)
    trainer.template = SimpleNamespace(padding_free=setting.get('padding_free', False))
    with pytest.raises(ValueError, match=f'StreamGRPOTrainer: {why}'):
        trainer._check_trainer()


def test_a_trajectory_without_a_trained_token_is_refused_naming_it(sg):
    trainer = sg.StreamGRPOTrainer.__new__(sg.StreamGRPOTrainer)
    with pytest.raises(SampleError, match=r"request g0#1, turn 1, field 'response_loss_mask': no trained token"):
        trainer._swift_sample(sg.StreamSample(messages=[]), None, sample(), [0, 0, 0, 0], 'g0')


def test_use_stream_trainer_points_ms_swifts_factory_at_a_top_level_subclass(sg, monkeypatch):
    from swift.trainers import TrainerFactory

    monkeypatch.setitem(TrainerFactory.TRAINER_MAPPING, 'grpo', TrainerFactory.TRAINER_MAPPING['grpo'])
    top = type('TopLevel', (sg.StreamGRPOTrainer,), {'__module__': __name__})
    monkeypatch.setitem(globals(), 'TopLevel', top)  # what a plugin's top-level class is: its module's attribute
    assert sg.use_stream_trainer(top) is top
    assert TrainerFactory.get_trainer_cls(SimpleNamespace(rlhf_type='grpo')) is top

    class Nested(sg.StreamGRPOTrainer):
        pass

    with pytest.raises(ValueError, match='not defined at the top level of its module'):
        sg.use_stream_trainer(Nested)
    with pytest.raises(TypeError, match='is not a StreamGRPOTrainer subclass'):
        sg.use_stream_trainer(dict)
