"""textarena games as environments (``env: {textarena: ...}``): the real Mastermind game; the
game's own turn limit and scoring; the ready scheduler ``schedulers/textarena_mastermind.yaml``."""
from __future__ import annotations

import itertools

import pytest

pytest.importorskip('textarena', reason="needs the 'textarena' extra")

import schedulers
from mtflow import Executor
from mtflow.declarative import load_scheduler
from tests.helpers import out, req


def secret(sched, uuid):
    return list(sched._states[uuid].env.env.state.game_state['secret_code'])


def test_mastermind_solved_lost_and_invalid():
    sched = load_scheduler(schedulers.path('textarena_mastermind'))
    assert sched.finish_reasons == ('stop_rule:env_done', )
    reqs = [req(u, {'role': 'system', 'content': 'Play.'}, data_dict={'seed': i})
            for i, u in enumerate(['solve', 'lose', 'garbage'])]
    codes = {}

    def rollout(requests, request_config):
        outs = []
        for r in requests:
            code = codes.setdefault(r.uuid, secret(sched, r.uuid))
            turn = sum(1 for m in r.messages if m['role'] == 'assistant') + 1
            wrong = [p for p in itertools.permutations(range(1, 6), 3) if list(p) != code]
            if r.uuid == 'solve':
                guess = code if turn == 2 else list(wrong[0])
            elif r.uuid == 'lose':
                guess = list(wrong[turn])
            else:
                outs.append(out('I have no idea'))
                continue
            outs.append(out('My guess: [' + ' '.join(map(str, guess)) + ']'))
        return outs

    result = Executor(sched, rollout, max_turns=6, on_error='return').run(reqs)
    assert result.failures == []
    assert result.finish_reasons == ['stop_rule:env_done'] * 3
    solve, lose, garbage = (o.rollout_infos for o in result.outputs)
    assert solve['rewards'] == [0.0, 1.0] and solve['env_info']['reason'].startswith('You have cracked the code')
    # the game's own limit ends it, scored by textarena: the share of the code found
    assert lose['env_steps'] == 6 and 0.0 <= lose['reward'] < 1.0  # textarena's max_turns 5 allows 6 moves
    assert lose['env_info']['reason'].startswith('Turn limit reached')
    # two moves in the wrong format lose the game (textarena allows one retry)
    assert garbage['env_steps'] == 2 and garbage['env_info']['invalid_move'] is True
    # the game's prompt opened each conversation; the player's own moves are not echoed back
    assert reqs[0].messages[1]['role'] == 'user' and 'You are playing Mastermind' in reqs[0].messages[1]['content']
    feedback = reqs[1].messages[3]['content']
    assert feedback.startswith('Submitted [') and 'black peg' in feedback and 'My guess' not in feedback


def test_unknown_game_and_bad_kwargs_are_config_errors():
    from mtflow.declarative import ConfigError
    with pytest.raises(ConfigError, match=r"env.textarena: cannot create environment 'NoSuchGame-v0'"):
        load_scheduler({'env': {'textarena': {'id': 'NoSuchGame-v0'}}})
    with pytest.raises(ConfigError, match=r"env.textarena: cannot create environment 'Mastermind-v0-raw'.*bogus"):
        load_scheduler({'env': {'textarena': {'id': 'Mastermind-v0-raw', 'kwargs': {'bogus': 1}}}})
