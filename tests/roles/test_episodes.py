"""Episodes of several roles on the one engine (docs/multi-agent.md): who acts, rewards, records,
and what goes wrong (a role that fails, an environment that fails or names nobody, an unknown
policy, an environment that does not implement the interface)."""
from __future__ import annotations

import asyncio

import pytest

from mtflow import Executor, RequestConfig, RolloutInferRequest, Scheduler
from mtflow.core.records import Wait
from mtflow.roles import (EpisodeEnvError, EpisodeScheduler, PolicyRouter, Role, RoleError, episode_requests,
                          iter_episode_requests, self_play)
from mtflow.roles.judge import judged, read_score
from tests.helpers import out
from tests.roles.envs import BothAtOnce, NamesNobody, NoStep, Relay, StepFails, TakeTurns

ROLES = [Role('a', policy='p'), Role('b', policy='q')]


def echo(tag, fail_at=None):
    """A policy whose reply names the role and its count of messages; ``fail_at``: (uuid, turn) it cannot serve."""
    seen = {}

    def rollout(requests, request_config=None):
        answers = []
        for r in requests:
            n = seen[r.uuid] = seen.get(r.uuid, 0) + 1
            if fail_at == (r.uuid, n):
                answers.append(RuntimeError(f'cannot serve {r.uuid}'))
                continue
            answers.append(out(f'{tag} {r.uuid.split("/")[-1]} {len(r.messages)}', [n, n + 1]))
        return answers

    return rollout


def prompts(n=1):
    return [RolloutInferRequest(messages=[{'role': 'user', 'content': f'task {i}'}], uuid=f'e{i}') for i in range(n)]


def run(env, roles=ROLES, policies=None, n=1, mode=None, **options):
    policies = policies or {'p': echo('P'), 'q': echo('Q')}
    scheduler = EpisodeScheduler(env, roles, policies=list(policies))
    requests = episode_requests(prompts(n), roles)
    kwargs = dict(max_turns=12, on_error='return', **options)
    if mode:
        kwargs['mode'] = mode
    return Executor(scheduler, PolicyRouter(policies, roles), **kwargs).run(requests), requests


@pytest.mark.parametrize('mode', [None, 'async'])
def test_turn_based_episode_each_role_its_own_trajectory_and_reward(mode):
    result, requests = run(TakeTurns, mode=mode)
    assert [r.uuid for r in requests] == ['e0/a', 'e0/b']
    assert result.finish_reasons == ['episode_done', 'episode_done']
    a, b = result.outputs
    assert [m['content'] for m in a.messages] == ['task: task 0 (you start)', 'P a 1', 'b said: Q b 1', 'P a 3']
    assert [m['content'] for m in b.messages] == ['a said: P a 1', 'Q b 1', 'a said: P a 3', 'Q b 3']
    assert (a.rollout_infos['reward'], b.rollout_infos['reward']) == (-1.0, 1.0)  # zero-sum
    record = a.rollout_infos['episode']
    assert record['role'] == 'a' and record['policy'] == 'p' and record['reason'] == 'episode_done'
    assert [(s['acted'], s['turns']) for s in record['steps']] == [
        (['a'], {'a': 1}), (['b'], {'b': 1}), (['a'], {'a': 2}), (['b'], {'b': 2})]
    assert [r['uuid'] for r in record['roles']] == ['e0/a', 'e0/b']
    # a role waiting for the other rests in tool_step: b opens in its step and waits there
    assert result.trace.states('e0/b')[:3] == ['pending', 'tool_step', 'generating']


def test_simultaneous_moves_step_once_everyone_acted():
    result, _ = run(BothAtOnce)
    assert result.finish_reasons == ['episode_done'] * 2
    a = result.outputs[0]
    assert [s['acted'] for s in a.rollout_infos['episode']['steps']] == [['a', 'b'], ['a', 'b']]
    assert a.rollout_infos['reward'] == 2.0  # 1.0 each round: both said as many words


def test_message_passing_with_a_user_simulator_keeps_its_own_record():
    roles = [Role('assistant', policy='p'), Role('user', policy='q', train=False, system='You are Bob.')]
    result, requests = run(lambda info: Relay(exchanges=2), roles)
    assistant, user = result.outputs
    assert user.messages[0] == {'role': 'system', 'content': 'You are Bob.'}
    # the user's turns are the assistant's user messages, and the other way round
    assert [m['content'] for m in assistant.messages if m['role'] == 'user'] == [
        m['content'] for m in user.messages if m['role'] == 'assistant'][:1]
    assert user.rollout_infos['episode']['train'] is False and user.response is not None


def test_a_failing_role_ends_its_episode_naming_it_and_the_others_are_kept():
    policies = {'p': echo('P'), 'q': echo('Q', fail_at=('e0/b', 2))}
    result, _ = run(TakeTurns, policies=policies, n=2)
    assert result.finish_reasons == ['role_failed', 'error', 'episode_done', 'episode_done']
    a = result.outputs[0]
    assert a.rollout_infos['episode']['ended_by'] == {'role': 'b', 'seat': None, 'uuid': 'e0/b', 'reason': 'error',
                                                      'turn': 2}
    assert 'reward' not in a.rollout_infos and len(a.messages) == 4  # kept as it was: its turns and observations
    assert [f.uuid for f in result.failures] == ['e0/b']  # the other episode went on


@pytest.mark.parametrize('mode', [None, 'async'])
def test_an_environment_that_names_nobody_is_a_deadlock_naming_episode_and_turn(mode):
    result, _ = run(NamesNobody, mode=mode)
    assert result.finish_reasons == ['error', 'error']
    message = str(result.failures[0].error)
    assert 'episode e0, after step 1 (a at its turn 1)' in message and 'named no role to act' in message
    assert {type(f.error).__name__ for f in result.failures} == {'DeadlockError'}


def test_an_environment_that_fails_fails_its_episode_only():
    result, _ = run(StepFails, n=1)
    assert result.finish_reasons == ['error', 'error']
    assert all('the board caught fire' in str(f.error) for f in result.failures)


def test_unknown_policy_id_is_refused_at_load():
    with pytest.raises(RoleError, match="role 'b': unknown policy id 'q'; the policies are: 'p'"):
        EpisodeScheduler(TakeTurns, ROLES, policies=['p'])
    with pytest.raises(RoleError, match="unknown policy id 'q'"):
        PolicyRouter({'p': echo('P')}, ROLES)


def test_an_environment_without_the_interface_is_refused_at_load():
    with pytest.raises(EpisodeEnvError, match=r'NoStep: it has no step\(actions\) method.*docs/multi-agent.md'):
        EpisodeScheduler(NoStep, ROLES)

    class TakesNothing(TakeTurns):
        def step(self):
            return None

    with pytest.raises(EpisodeEnvError, match=r'TakesNothing.step\(\) .*takes \(self\); mtflow calls it as step\(actions\)'):
        EpisodeScheduler(TakesNothing, ROLES)
    with pytest.raises(EpisodeEnvError, match=r"do not include the seat\(s\) \['c'\]"):
        EpisodeScheduler(TakeTurns, ROLES + [Role('c')])


def test_roles_declared_wrong_are_refused():
    with pytest.raises(RoleError, match="role 'a' is declared twice"):
        EpisodeScheduler(TakeTurns, [Role('a'), Role('a')])
    with pytest.raises(RoleError, match='same seat 0'):
        EpisodeScheduler(TakeTurns, [Role('a', seat=0), Role('b', seat=0)])
    with pytest.raises(RoleError, match='without "/"'):
        Role('a/b')
    assert [(r.name, r.seat, r.policy) for r in self_play('x', 2)] == [('player_0', 0, 'x'), ('player_1', 1, 'x')]


def test_a_request_that_is_no_role_fails_naming_it():
    scheduler = EpisodeScheduler(TakeTurns, ROLES)
    result = Executor(scheduler, echo('P'), max_turns=3, on_error='return').run(prompts())
    assert result.finish_reasons == ['error']
    assert 'has no data_dict["episode"]' in str(result.failures[0].error)


def test_episode_requests_one_per_role_in_the_prompts_group():
    groups = list(iter_episode_requests(prompts(2), ROLES, copies=2))
    assert [[r.uuid for r in g] for g in groups] == [['e0#0/a', 'e0#0/b', 'e0#1/a', 'e0#1/b'],
                                                    ['e1#0/a', 'e1#0/b', 'e1#1/a', 'e1#1/b']]
    first = groups[0][0]
    assert first.messages == [] and first.data_dict['group'] == 'e0'
    assert first.data_dict['episode'] == {'id': 'e0#0', 'role': 'a', 'seat': None, 'policy': 'p', 'train': True}
    with pytest.raises(RoleError, match='is a role request already'):
        episode_requests(groups[0], ROLES)


def test_the_router_gives_each_role_its_policy_and_sampling():
    calls = []

    def policy(tag):
        def rollout(requests, request_config=None):
            calls.append((tag, [r.uuid for r in requests], request_config.temperature))
            return [out(tag, [1]) for _ in requests]
        return rollout

    roles = [Role('a', policy='p', sampling={'temperature': 0.2}), Role('b', policy='q')]
    router = PolicyRouter({'p': policy('P'), 'q': policy('Q')}, roles)
    requests = episode_requests(prompts(2), roles)
    router(requests, RequestConfig(temperature=1.0))
    assert calls == [('P', ['e0/a', 'e1/a'], 0.2), ('Q', ['e0/b', 'e1/b'], 1.0)]


def test_a_judge_scores_the_episode_on_its_own_backend():
    roles = ROLES + [Role('judge', policy='j', train=False)]
    policies = {'p': echo('P'), 'q': echo('Q'), 'j': lambda requests, config=None: [out('Score: 7', [1])] * len(requests)}
    result, _ = run(judged(lambda info: TakeTurns(moves=2), judges=['a']), roles, policies)
    a, b, judge = result.outputs
    assert result.finish_reasons == ['episode_done'] * 3
    assert a.rollout_infos['reward'] == pytest.approx(-1.0 + 0.7)  # its game reward plus the judge's score
    assert b.rollout_infos['reward'] == 1.0  # not judged
    assert 'Transcript:\na: P a 1\nb: Q b 1' in judge.messages[0]['content']
    assert judge.rollout_infos['episode']['info']['judge'] == {'score': 0.7, 'judged': ['a']}
    assert read_score('I would say 9/10... Score: 8') == 0.8 and read_score('no idea') is None


class WaitsForever(Scheduler):
    """Answers Wait with a future nobody resolves."""

    async def step(self, infer_request, response_choice, current_turn):
        return Wait(asyncio.get_running_loop().create_future(), f'{infer_request.uuid} waits for nothing')


@pytest.mark.parametrize('mode', [None, 'async'])
def test_a_request_resting_with_nothing_left_to_act_fails_as_a_deadlock(mode):
    kwargs = {'mode': mode} if mode else {}
    result = Executor(WaitsForever(), echo('P'), max_turns=3, on_error='return', **kwargs).run(prompts(2))
    assert result.finish_reasons == ['error', 'error']
    assert 'e0 waits for nothing' in str(result.failures[0].error)
    assert type(result.failures[0].error).__name__ == 'DeadlockError'


class OneWaitsOneWorks(Scheduler):
    """``e0`` answers Wait (nobody will end it) while ``e1`` works: slow steps, turn after turn."""

    async def step(self, infer_request, response_choice, current_turn):
        if infer_request.uuid == 'e0':
            return Wait(asyncio.get_running_loop().create_future(), 'e0 waits for e1')
        await asyncio.sleep(0.1)
        infer_request.messages.append({'role': 'user', 'content': 'go on'})
        return {'infer_request': infer_request}


@pytest.mark.parametrize('mode', [None, 'async'])
def test_a_wait_past_the_step_deadline_times_out(mode):
    kwargs = {'mode': mode} if mode else {}
    result = Executor(OneWaitsOneWorks(), echo('P'), max_turns=6, on_error='return', step_timeout_s=0.25,
                      **kwargs).run(prompts(2))
    assert result.finish_reasons == ['timeout', 'max_turns']


def test_episodes_of_a_stream_are_delivered_whole():
    scheduler = EpisodeScheduler(TakeTurns, ROLES)
    router = PolicyRouter({'p': echo('P'), 'q': echo('Q')}, ROLES)
    ex = Executor(scheduler, router.async_rollout_fn(), mode='async', max_turns=12)
    groups = list(ex.stream(iter_episode_requests(prompts(3), ROLES, copies=2), max_concurrency=2))
    assert sorted(sorted(g.uuids) for g in groups) == [[f'e{i}#{k}/{r}' for k in (0, 1) for r in 'ab'] for i in range(3)]
    assert all(reason == 'episode_done' for g in groups for reason in g.finish_reasons)


def test_a_role_cannot_be_forked_and_a_cut_episode_cannot_resume():
    from mtflow import Branching, Until

    result, _ = run(TakeTurns, branch=Branching(at={'turn': 2}, copies=2))
    assert 'cannot be forked' in str(result.failures[0].error)
    assert set(result.finish_reasons) == {'error'}  # each role refused its fork
    scheduler = EpisodeScheduler(lambda info: TakeTurns(moves=2 if info.id == 'e0' else 8), ROLES)
    router = PolicyRouter({'p': echo('P'), 'q': echo('Q')}, ROLES)
    ex = Executor(scheduler, router, mode='async', max_turns=12, on_error='return')
    part = ex.run(episode_requests(prompts(2), ROLES), until=Until(finished=2))  # e0 done, e1 cut mid-game
    assert part.finish_reasons[:2] == ['episode_done'] * 2 and [u.record.uuid for u in part.unfinished] == ['e1/a',
                                                                                                           'e1/b']
    again = ex.run(part.unfinished)
    assert any('episode e1 was cut while it waited for the others' in str(f.error) for f in again.failures)
