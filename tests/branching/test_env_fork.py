"""A YAML scheduler's environment at a fork: copied (``fork()``), replayed (``replayable``), or the
fork refused with a message naming the environment and the state; ``branch:`` in the schema."""
from __future__ import annotations

import pytest

from mtflow import Executor
from mtflow.declarative import ConfigError, load_scheduler
from tests.helpers import dump, out, req


def config(env: str, **branch) -> dict:
    return {'max_turns': 4, 'env': {'impl': f'tests.branching.envs:{env}', 'kwargs': {'rolls': 3}},
            'branch': {'at': {'turn': 2}, 'copies': 3, **branch}}


def rollout(requests, request_config=None):
    outs = []
    for r in requests:
        turn = 1 + sum(1 for m in r.messages if m['role'] == 'assistant')
        outs.append(out(f'{r.uuid} rolls at turn {turn}', [turn, len(r.uuid)], [-0.5, -0.25]))
    return outs


def run(env: str, mode=None, **branch):
    scheduler = load_scheduler(config(env, **branch))
    requests = [req('a'), req('b')]
    result = Executor(scheduler, rollout, on_error='return', **(mode or {})).run(requests)
    scheduler.close()
    return result, requests


@pytest.mark.parametrize('mode', [{}, {'mode': 'async', 'max_concurrency': 2}])
def test_a_copied_environment_goes_on_in_each_branch(mode):
    result, requests = run('CopyingDice', mode)
    assert result.ok and len(requests) == 6
    by_uuid = {r.uuid: o for r, o in zip(requests, result.outputs)}
    # the branches share the first roll (one environment step, copied) and roll apart from there
    first = [o.messages[2]['content'] for o in (by_uuid['a'], by_uuid['a~1'], by_uuid['a~2'])]
    assert len(set(first)) == 1 and first[0].startswith('total ')
    last = {u: o.messages[-1]['content'] for u, o in by_uuid.items() if u.startswith('a')}
    assert len(set(last.values())) == 3
    assert all(o.rollout_infos['env_steps'] == 3 for o in result.outputs)
    tree = next(t for t in result.trees if t['root'] == 'a')
    assert tree['nodes'][0]['value'] == pytest.approx(sum(tree['rewards'].values()) / 3)


def test_a_replayed_environment_gives_the_leaves_a_copied_one_gives():
    copied, _ = run('CopyingDice')
    replayed, requests = run('ReplayingDice')
    assert replayed.ok and len(requests) == 6
    assert dump(replayed.outputs) == dump(copied.outputs)
    assert replayed.trees == copied.trees


def test_an_environment_that_neither_copies_nor_replays_refuses_the_fork_by_name():
    result, requests = run('Dice')
    assert len(requests) == 2 and result.finish_reasons == ['error', 'error']
    failure = result.failures[0]
    message = str(failure.error)
    assert failure.phase == 'fork' and failure.turn == 2
    assert 'environment Dice' in message and "state 'generating'" in message and 'request a' in message
    assert 'fork()' in message and 'replayable' in message


def test_a_replay_that_comes_out_differently_refuses_the_fork():
    result, _ = run('ForgetfulDice')
    failure = result.failures[0]
    assert failure.phase == 'fork' and 'ForgetfulDice replayed differently at its step 1' in str(failure.error)


def test_the_branch_section_is_checked_by_the_schema():
    with pytest.raises(ConfigError, match='branch.copie'):
        load_scheduler({'max_turns': 2, 'branch': {'at': {'turn': 2}, 'copie': 3}})
    with pytest.raises(ConfigError, match='no tools'):
        load_scheduler({'max_turns': 2, 'branch': {'at': 'tool_calls'}})
    with pytest.raises(ConfigError, match='say where to fork'):
        load_scheduler({'max_turns': 2, 'branch': {'at': {'state': 'tool_step'}}})
    with pytest.raises(ConfigError, match='branch.at.hook'):
        load_scheduler({'max_turns': 2, 'branch': {'at': {'hook': 'tests.branching.envs:nothing'}}})
    scheduler = load_scheduler({'max_turns': 2, 'branch': {'at': {'turn': 2, 'entropy': {'above': 1}}, 'leaves': 4}})
    assert scheduler.branch.at == {'turn': 2, 'state': 'generating', 'entropy': {'above': 1.0}}
    assert scheduler.branch.leaves == 4 and scheduler.branch.copies == 2


def test_mtflow_validate_names_the_file_line_and_closest_key(tmp_path):
    from mtflow.declarative import validate_file

    path = tmp_path / 'branch.yaml'
    path.write_text('max_turns: 3\nbranch:\n  at: {turns: 2}\n  copies: 3\n')
    [problem] = validate_file(path)
    assert problem.line == 3 and "branch.at.turns: unknown key 'turns'; did you mean 'turn'?" in str(problem)
