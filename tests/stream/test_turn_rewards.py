"""Per-turn rewards: a gym environment's step rewards, a YAML tool reward and the ``turn_reward``
hook land on the right turns, each with the token span of its turn."""
from __future__ import annotations

import pytest

from mtflow import Executor
from mtflow.declarative import load_scheduler
from tests.helpers import out, req


def _scripted(replies):
    """rollout_fn: request uuid -> the reply texts per turn, ids 10*turn + k (one per word)."""
    def rollout(requests, request_config):
        outs = []
        for r in requests:
            turn = sum(1 for m in r.messages if m['role'] == 'assistant') + 1
            text = replies[r.uuid][turn - 1]
            outs.append(out(text, [10 * turn + k for k in range(len(text.split()))]))
        return outs
    return rollout


def _spans(output):
    ids = output.response_token_ids
    flat = [i for seg in ids for i in seg]
    return [(e['turn'], e['source'], e['reward'], flat[e['span'][0]:e['span'][1]] == ids[e['segment']])
            for e in output.rollout_infos['turn_rewards']]


def test_gym_step_rewards_are_per_turn_with_their_spans():
    pytest.importorskip('gymnasium')
    sched = load_scheduler({'name': 'say', 'max_turns': 8,
                            'env': {'gym': 'tests.envs.text_envs:make_timed', 'kwargs': {'max_episode_steps': 3}}})
    replies = {'win': ['banana split', 'river']}
    result = Executor(sched, _scripted(replies), max_turns=8).run([req('win', data_dict={'seed': 1})])
    o = result.outputs[0]
    assert o.rollout_infos['reward'] == pytest.approx(0.9)  # the trajectory reward, as before
    assert _spans(o) == [(1, 'env', -0.1, True), (2, 'env', 1.0, True)]
    entries = o.rollout_infos['turn_rewards']
    assert entries[0]['span'][0] == 0 and entries[1]['span'][0] == entries[0]['span'][1]


CALC = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{}"}}}}</tool_call>'


def test_a_yaml_tool_reward_and_the_turn_reward_hook():
    sched = load_scheduler({
        'name': 'calc', 'max_turns': 4, 'parser': 'hermes',
        'tools': [{'name': 'calculator', 'reward': {'ok': 0.5, 'error': -1.0}}],
        'observation': {'mode': 'message', 'role': 'tool'},
        'turn_reward': 'tests.stream.rewards_hooks:by_length',
    })
    replies = {'a': [CALC.format('2 + 3'), CALC.format('2 +'), 'skip: the answer is 5']}
    result = Executor(sched, _scripted(replies), max_turns=4, on_error='return').run([req('a')])
    assert result.failures == []
    o = result.outputs[0]
    got = [(t, s, r) for t, s, r, ok in _spans(o) if ok]
    assert len(got) == len(o.rollout_infos['turn_rewards'])  # every span is its turn's segment
    hook1 = len(CALC.format('2 + 3')) / 10.0
    hook2 = len(CALC.format('2 +')) / 10.0
    assert got == [(1, 'turn_reward', hook1), (1, 'tools', 0.5), (2, 'turn_reward', hook2), (2, 'tools', -1.0)]
    assert 'reward' not in o.rollout_infos  # no trajectory reward configured: none invented


def test_a_turn_reward_that_is_not_a_number_fails_its_request_by_name():
    sched = load_scheduler({'name': 'bad', 'max_turns': 2, 'turn_reward': 'tests.stream.rewards_hooks:not_a_number'})
    result = Executor(sched, _scripted({'a': ['x', 'y']}), max_turns=2, on_error='return').run([req('a')])
    assert result.finish_reasons == ['error']
    assert 'turn_reward must return a number or None' in str(result.failures[0].error)


# ---- the engine's turn_reward hook: a Python scheduler's method, or Executor(turn_reward=) --------------
from mtflow import Scheduler  # noqa: E402


class Talk(Scheduler):
    """Three turns of plain replies; the reward is the reply's word count, none for 'skip'."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= 3

    def step(self, infer_request, response_choice, current_turn):  # the contract: a step names its turn's ids
        infer_request.messages.append({'role': 'user', 'content': 'go on'})
        return {'infer_request': infer_request, 'response_token_ids': response_choice.token_ids}

    def turn_reward(self, infer_request, response_choice, current_turn):
        text = response_choice.message.content
        return None if 'skip' in text else float(len(text.split()))


TALK = {'a': ['one two', 'skip this', 'three four five'], 'b': ['x', 'y z', 'skip']}


@pytest.mark.parametrize('mode', ['lockstep', 'async'])
def test_a_python_schedulers_turn_reward_is_recorded_with_its_span(mode):
    result = Executor(Talk(max_turns=3), _scripted(TALK), mode=mode).run([req('a'), req('b')])
    a, b = result.outputs
    assert _spans(a) == [(1, 'turn_reward', 2.0, True), (3, 'turn_reward', 3.0, True)]
    assert _spans(b) == [(1, 'turn_reward', 1.0, True), (2, 'turn_reward', 2.0, True)]
    assert a.rollout_infos['turn_rewards'][1]['span'] == [4, 7]  # 2 + 2 ids before turn 3's three


def test_executor_turn_reward_takes_the_schedulers_place_and_may_be_async():
    calls = []

    async def bonus(infer_request, response_choice, current_turn):
        calls.append((infer_request.uuid, current_turn))
        return -0.5 if current_turn == 2 else None

    result = Executor(Talk(max_turns=3), _scripted(TALK), turn_reward=bonus).run([req('a')])
    assert sorted(calls) == [('a', 1), ('a', 2), ('a', 3)]
    assert _spans(result.outputs[0]) == [(2, 'turn_reward', -0.5, True)]
    with pytest.raises(TypeError, match='turn_reward must be callable'):
        Executor(Talk(), _scripted(TALK), turn_reward=3)


def test_the_engine_hook_and_a_yaml_schedulers_own_rewards_are_merged_in_turn_order():
    sched = load_scheduler({
        'name': 'calc', 'max_turns': 4, 'parser': 'hermes',
        'tools': [{'name': 'calculator', 'reward': {'ok': 0.5, 'error': -1.0}}],
        'observation': {'mode': 'message', 'role': 'tool'},
    })
    replies = {'a': [CALC.format('2 + 3'), CALC.format('2 +'), 'skip: the answer is 5']}
    result = Executor(sched, _scripted(replies), max_turns=4, on_error='return',
                      turn_reward=lambda r, c, t: float(t)).run([req('a')])
    assert result.failures == []
    got = _spans(result.outputs[0])
    assert got == [(1, 'tools', 0.5, True), (1, 'turn_reward', 1.0, True), (2, 'tools', -1.0, True),
                   (2, 'turn_reward', 2.0, True), (3, 'turn_reward', 3.0, True)]


def test_a_python_turn_reward_that_is_not_a_number_fails_its_request_by_name():
    class Bad(Talk):
        def turn_reward(self, infer_request, response_choice, current_turn):
            return 'high' if infer_request.uuid == 'b' else 1

    result = Executor(Bad(max_turns=3), _scripted(TALK), on_error='return').run([req('a'), req('b')])
    assert result.finish_reasons[0] != 'error' and result.finish_reasons[1] == 'error'
    failure = result.failures[0]
    assert failure.uuid == 'b' and failure.phase == 'turn_reward'
    assert 'turn_reward must return a number or None, got str' in str(failure.error)
    assert [e['reward'] for e in result.outputs[0].rollout_infos['turn_rewards']] == [1.0, 1.0, 1.0]
