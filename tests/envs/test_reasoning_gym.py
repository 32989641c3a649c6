"""reasoning-gym as a dataset and reward source: prompts generated from a run config, the task's
own score_answer as the reward, and the per-group reward spread in ``mtflow run``'s summary."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

rg = pytest.importorskip('reasoning_gym', reason="needs the 'reasoning-gym' extra")

import schedulers
from mtflow import Executor
from mtflow.cli import main
from mtflow.run.reward_spread import reward_spread
from mtflow.data.reasoning_gym import ReasoningGymSpec, check_spec, make_requests, score
from mtflow.data.sources import expand_groups
from mtflow.declarative import load_scheduler
from tests.helpers import out

ROOT = Path(__file__).resolve().parents[2]
EASY = {'min_terms': 2, 'max_terms': 2, 'min_digits': 1, 'max_digits': 1, 'operators': ['+', '-'],
        'allow_parentheses': False, 'allow_negation': False}


def spec(**kw):
    return ReasoningGymSpec(**{'name': 'basic_arithmetic', 'size': 6, 'seed': 3, 'config': EASY, **kw})


def test_prompts_are_the_generated_tasks_and_deterministic():
    reqs = make_requests(spec())
    ds = rg.create_dataset('basic_arithmetic', size=6, seed=3, **EASY)
    assert [r.messages for r in reqs] == [[{'role': 'user', 'content': ds[i]['question']}] for i in range(6)]
    assert [r.uuid for r in reqs] == [f'basic_arithmetic-3-{i}' for i in range(6)]
    assert [r.data_dict['answer'] for r in reqs] == [ds[i]['answer'] for i in range(6)]
    assert reqs[2].data_dict['reasoning_gym'] == {'name': 'basic_arithmetic', 'size': 6, 'seed': 3, 'config': EASY,
                                                  'index': 2}
    assert [r.messages for r in make_requests(spec())] == [r.messages for r in reqs]
    assert [r.messages for r in make_requests(spec(seed=4))] != [r.messages for r in reqs]
    assert len(make_requests(spec(), limit=2)) == 2
    json.dumps([r.data_dict for r in reqs])  # plain JSON: travels in trajectories and across processes


def test_spec_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"unknown task 'basic_arithmeticz'.*similar: basic_arithmetic"):
        check_spec({'name': 'basic_arithmeticz'})
    with pytest.raises(ValueError, match=r"reasoning_gym.config: basic_arithmetic rejects it: .*'bogus'"):
        check_spec({'name': 'basic_arithmetic', 'config': {'bogus': 1}})
    with pytest.raises(ValueError, match=r'reasoning_gym.size'):
        check_spec({'name': 'basic_arithmetic', 'size': 0})


def test_scripted_model_right_on_some_tasks_gets_score_answer_there_and_zero_elsewhere():
    """Even tasks: the right answer at turn 1. Task 1: wrong, then right after the retry hint.
    Others: wrong twice. The reward is the task's score_answer of the final answer."""
    reqs = make_requests(spec())
    answers = {r.uuid: r.data_dict['answer'] for r in reqs}

    def rollout(requests, request_config):
        outs = []
        for r in requests:
            turn = sum(1 for m in r.messages if m['role'] == 'assistant') + 1
            index = r.data_dict['reasoning_gym']['index']
            right = index % 2 == 0 or (index == 1 and turn == 2)
            answer = answers[r.uuid] if right else str(int(answers[r.uuid]) + 1)
            outs.append(out(f'Let me see. <answer>{answer}</answer>'))
        return outs

    sched = load_scheduler(schedulers.path('reasoning_gym'))
    result = Executor(sched, rollout, max_turns=2, on_error='return').run(reqs)
    assert result.failures == []
    rewards = [o.rollout_infos['reward'] for o in result.outputs]
    assert rewards == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert result.finish_reasons == ['stop_rule:correct_answer'] * 3 + ['stop_rule:tips_exhausted',
                                                                        'stop_rule:correct_answer',
                                                                        'stop_rule:tips_exhausted']
    assert [o.rollout_infos['num_turns'] for o in result.outputs] == [1, 2, 1, 2, 1, 2]
    # the reward is what the task's own verifier says
    for r, o in zip(reqs, result.outputs):
        assert o.rollout_infos['reward'] == score(o.rollout_infos['answer'], r.data_dict['reasoning_gym'])
    assert 'That is not right' in reqs[3].messages[-2]['content']


def test_last_number_is_read_when_the_model_writes_no_tags():
    reqs = make_requests(spec(size=2))
    sched = load_scheduler(schedulers.path('reasoning_gym'))
    first = reqs[0].data_dict['answer']
    rollout = lambda rs, rc: [out(f'The result is {first}.' if r is reqs[0] else 'I do not know') for r in rs]
    result = Executor(sched, rollout, max_turns=2).run(reqs)
    assert [o.rollout_infos['reward'] for o in result.outputs] == [1.0, 0.0]


def test_reward_spread_per_group():
    groups = ['a', 'a', 'b', 'b', 'c']
    s = reward_spread(groups, [1.0, 0.0, 1.0, 1.0, None])
    assert s['groups'] == 2 and s['with_spread'] == 1 and s['requests_rewarded'] == 3 and s['requests_scored'] == 4
    assert s['per_group'] == [{'group': 'a', 'n': 2, 'mean': 0.5, 'std': 0.5, 'min': 0.0, 'max': 1.0},
                              {'group': 'b', 'n': 2, 'mean': 1.0, 'std': 0.0, 'min': 1.0, 'max': 1.0}]
    assert s['mean_std'] == 0.25
    assert reward_spread(['a'], [None]) is None


def test_expand_groups_copies_each_prompt():
    reqs = expand_groups(make_requests(spec(size=2)), 3)
    assert [r.uuid for r in reqs] == [f'basic_arithmetic-3-{i}#{k}' for i in range(2) for k in range(3)]
    assert {r.data_dict['group'] for r in reqs} == {'basic_arithmetic-3-0', 'basic_arithmetic-3-1'}
    assert reqs[0].messages == reqs[2].messages and reqs[0].messages is not reqs[2].messages


def _script(tmp_path, reqs):
    """Scripted backend lines: group 0 half right, group 1 all right, group 2 all wrong."""
    lines = []
    for r in reqs:
        index, k = r.data_dict['reasoning_gym']['index'], int(r.uuid.split('#')[1])
        right = (index == 0 and k == 0) or index == 1
        answer = r.data_dict['answer'] if right else str(int(r.data_dict['answer']) + 1)
        for turn in (1, 2):
            lines.append({'uuid': r.uuid, 'turn': turn, 'content': f'<answer>{answer}</answer>'})
    path = tmp_path / 'script.jsonl'
    path.write_text(''.join(json.dumps(l) + '\n' for l in lines))
    return path


def test_mtflow_run_with_a_reasoning_gym_dataset_prints_the_group_spread(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    dataset = {'reasoning_gym': {'name': 'basic_arithmetic', 'size': 3, 'seed': 3, 'config': EASY}}
    reqs = expand_groups(make_requests(ReasoningGymSpec(**dataset['reasoning_gym'])), 2)
    script = _script(tmp_path, reqs)
    (tmp_path / 'run.yaml').write_text(textwrap.dedent(f'''\
        scheduler: {ROOT / 'schedulers' / 'reasoning_gym.yaml'}
        backend: scripted
        model: {script}
        dataset: {json.dumps(dataset)}
        num_generations: 2
        out: out
        max_turns: 2
        batch_size: 4
        '''))
    assert main(['run', 'run.yaml', '--no-progress']) == 0
    shown = ' '.join(capsys.readouterr().out.split())
    summary = json.loads((tmp_path / 'out' / 'summary.json').read_text())
    spread = summary['reward_groups']
    assert spread['groups'] == 3 and spread['with_spread'] == 1 and spread['requests_rewarded'] == 3
    assert [g['mean'] for g in spread['per_group']] == [0.5, 1.0, 0.0]
    assert summary['requests'] == 6 and summary['reward_mean'] == 0.5
    assert 'rewarded requests' in shown and '3 of 6 (reward > 0)' in shown
    assert '1 of 3 groups (size 2) have unequal rewards' in shown
    trajs = [json.loads(l) for l in (tmp_path / 'out' / 'trajectories.jsonl').read_text().splitlines()]
    # written in the order they finish (issue 11's streaming run); `index` is the dataset position
    assert [t['uuid'] for t in sorted(trajs, key=lambda t: t['index'])] == [r.uuid for r in reqs]
    # the README's promise: `reference` is the dataset's answer, not the task spec the verifier reads
    by_uuid = {r.uuid: r for r in reqs}
    for t in trajs:
        assert t['reference'] == by_uuid[t['uuid']].data_dict['answer'] and isinstance(t['reference'], str)


def test_run_config_dataset_errors_name_file_line_and_field(tmp_path):
    from mtflow.run.config import RunConfigError, load_run_config
    (tmp_path / 'run.yaml').write_text('scheduler: s.yaml\nbackend: scripted\ndataset:\n  reasoning_gym:\n'
                                       '    name: no_such_task\n')
    with pytest.raises(RunConfigError, match=r"run.yaml:3: dataset: .*unknown task 'no_such_task'"):
        load_run_config(tmp_path / 'run.yaml')
    (tmp_path / 'run.yaml').write_text('scheduler: s.yaml\ndataset: {hub: x}\n')
    with pytest.raises(RunConfigError, match=r'run.yaml:2: dataset: .*one of: reasoning_gym'):
        load_run_config(tmp_path / 'run.yaml')


def test_spread_rows_without_groups_say_how_to_get_them():
    from mtflow.run.reward_spread import spread_rows
    rows = dict(spread_rows(reward_spread(['a', 'b'], [1.0, 0.0])))
    assert rows['rewarded requests'] == '1 of 2 (reward > 0)'
    assert rows['reward spread'] == 'one request per prompt: set num_generations for GRPO groups'
    assert 'per group (mean±std)' not in rows
    rows = dict(spread_rows(reward_spread(['a', 'a'], [1.0, 0.0])))
    assert rows['per group (mean±std)'] == 'a 0.5±0.5'
