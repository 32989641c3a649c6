"""Gymnasium-style text environments (``env: {gym: module:Class}``): a real gymnasium.Env with
gymnasium's TimeLimit wrapper; terminated and truncated end requests with distinct reasons."""
from __future__ import annotations

import pytest

pytest.importorskip('gymnasium', reason="needs the 'gym' extra (gymnasium)")

from mtflow import Executor
from mtflow.declarative import ConfigError, load_scheduler
from tests.envs import text_envs
from tests.helpers import out, req

WORDS = ['apple', 'river', 'stone']


def scheduler(ref='tests.envs.text_envs:make_timed', **kwargs):
    return load_scheduler({'name': 'say', 'max_turns': 8, 'env': {'gym': ref, 'kwargs': kwargs}})


def test_terminated_and_truncated_are_distinct_finish_reasons():
    sched = scheduler(max_episode_steps=3)
    assert 'stop_rule:env_done' in sched.finish_reasons and 'stop_rule:env_truncated' in sched.finish_reasons
    # seed 1 -> 'river'; 'win' says it at turn 2, 'lose' never does (TimeLimit truncates at step 3)
    reqs = [req('win', data_dict={'seed': 1}), req('lose', data_dict={'seed': 2, 'env_options': {'hint': 'rock'}})]

    def rollout(requests, request_config):
        outs = []
        for r in requests:
            turn = sum(1 for m in r.messages if m['role'] == 'assistant') + 1
            outs.append(out('river' if r.uuid == 'win' and turn == 2 else 'banana'))
        return outs

    text_envs.CLOSED.clear()
    result = Executor(sched, rollout, max_turns=8, on_error='return').run(reqs)
    assert result.failures == []
    assert result.finish_reasons == ['stop_rule:env_done', 'stop_rule:env_truncated']
    win, lose = (o.rollout_infos for o in result.outputs)
    assert win['rewards'] == [-0.1, 1.0] and win['reward'] == pytest.approx(0.9) and win['env_info'] == {'said': 'river'}
    assert lose['rewards'] == [-0.1] * 3 and lose['env_steps'] == 3
    # reset's observation opened the conversation (options reached reset); step observations follow
    # the request had its own user message, so reset's observation did not add another
    assert reqs[1].messages[0] == {'role': 'user', 'content': 'question lose'}
    assert not any('Say the secret word' in m['content'] for m in reqs[1].messages)
    assert [m['content'] for m in reqs[0].messages if m['role'] == 'user'][1:] == ['No, try again.']
    assert sorted(text_envs.CLOSED) == ['river', 'stone']  # both closed (through TimeLimit)


def test_reset_observation_opens_a_request_without_user_message():
    sched = scheduler(max_episode_steps=2)
    r = req('a', {'role': 'system', 'content': 'Play.'}, data_dict={'seed': 0, 'env_options': {'hint': 'fruit'}})
    result = Executor(sched, lambda rs, rc: [out('apple') for _ in rs], max_turns=8).run([r])
    assert result.finish_reasons == ['stop_rule:env_done']
    assert r.messages[1] == {'role': 'user', 'content': 'Say the secret word. Hint: fruit'}


def test_plain_object_without_gymnasium_and_without_reset_arguments():
    sched = scheduler('tests.envs.text_envs:PlainCounter')
    r = req('a', {'role': 'system', 'content': 'Count.'})
    result = Executor(sched, lambda rs, rc: [out('go') for _ in rs], max_turns=8).run([r])
    assert result.finish_reasons == ['stop_rule:env_truncated']
    assert result.outputs[0].rollout_infos['rewards'] == [0.5, 0.5]
    assert [m['content'] for m in r.messages if m['role'] == 'user'] == ['Count with me.', '1']


def test_bad_gym_refs_are_config_errors():
    with pytest.raises(ConfigError, match=r'env\.gym: .*must look like'):
        load_scheduler({'env': {'gym': 'justaname'}})
    with pytest.raises(ConfigError, match=r"env\.kwargs: cannot create environment 'tests.envs.text_envs:NotAnEnv'.*"
                       r'no reset\(\) method'):
        load_scheduler({'env': {'gym': 'tests.envs.text_envs:NotAnEnv'}})
    with pytest.raises(ConfigError, match=r'unexpected keyword'):
        load_scheduler({'env': {'gym': 'tests.envs.text_envs:make_timed', 'kwargs': {'nope': 1}}})
    with pytest.raises(ConfigError, match='give exactly one of impl, gym, openenv, textarena'):
        load_scheduler({'env': {'gym': 'tests.envs.text_envs:make_timed', 'impl': 'guess_number'}})


def test_a_bad_step_return_fails_that_request_only():
    class Bad:
        def reset(self):
            return 'hi', {}

        def step(self, action):
            return 'obs', 1.0, True, {}  # the old 4-tuple: not Gymnasium

    import sys
    import types
    mod = types.ModuleType('_i15_bad_env')
    mod.Bad = Bad
    sys.modules['_i15_bad_env'] = mod
    sched = load_scheduler({'env': {'gym': '_i15_bad_env:Bad'}})
    result = Executor(sched, lambda rs, rc: [out('x') for _ in rs], max_turns=3, on_error='return').run([req('a')])
    assert result.finish_reasons == ['error']
    assert 'must return (observation, reward, terminated, truncated, info)' in str(result.failures[0].error)
