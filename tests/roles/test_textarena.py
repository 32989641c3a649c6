"""textarena's two-player games as episodes (docs/multi-agent.md): one request per seat, textarena
decides who moves, and the roles' rewards are exactly textarena's (checked by playing the recorded
moves again on a fresh game with the same seed). The scripted policies run in a second; the
embedded SmolLM2-135M in both seats, and against a second policy, is marked slow."""
from __future__ import annotations

import re
from typing import Any, Dict, List

import pytest

pytest.importorskip('textarena')

from mtflow import Executor, RequestConfig, RolloutInferRequest  # noqa: E402
from mtflow.backends.scripted import ScriptedBackend  # noqa: E402
from mtflow.roles import EpisodeScheduler, PolicyRouter, Role, episode_requests, self_play  # noqa: E402
from mtflow.roles.textarena import textarena_episode  # noqa: E402

GAMES = ('TicTacToe-v0-raw', 'KuhnPoker-v0-raw')


def legal_mover(request: Any) -> str:
    """A policy that always makes a legal move: the first one the game lists."""
    text = '\n'.join(str(m['content']) for m in request.messages if m['role'] != 'assistant')
    boards = re.findall(r'Available Moves: (.*)', text)
    if boards:
        return re.findall(r"\[\d\]", boards[-1])[0]
    actions = re.findall(r'\[(Check|Bet|Call|Fold)\]', text)
    return f'[{actions[-1]}]' if actions else '[Check]'


def play(game: str, policies: Dict[str, Any], roles: List[Role], seeds=(0, 1), mode=None, max_tokens: int = 8):
    scheduler = EpisodeScheduler(textarena_episode(game), roles, policies=list(policies), max_steps=20)
    prompts = [RolloutInferRequest(messages=[{'role': 'user', 'content': 'Play to win.'}], uuid=f'g{s}',
                                   data_dict={'seed': s}) for s in seeds]
    requests = episode_requests(prompts, roles)
    router = PolicyRouter(policies, roles)
    kwargs = {'mode': mode} if mode else {}
    result = Executor(scheduler, router.async_rollout_fn() if mode else router,
                      RequestConfig(max_tokens=max_tokens, temperature=0.7), max_turns=12, on_error='return',
                      **kwargs).run(requests)
    assert not result.failures, result.failures
    return result, requests


def replayed_rewards(game: str, seed: int, outputs: Dict[str, Any]) -> Dict[str, float]:
    """textarena's own rewards for the recorded moves, played again on a fresh game."""
    import textarena as ta

    record = next(iter(outputs.values())).rollout_infos['episode']
    replies = {role: [m['content'] for m in out.messages if m['role'] == 'assistant'] for role, out in outputs.items()}
    env = ta.make(game)
    env.reset(num_players=2, seed=seed)
    done = False
    for step in record['steps']:
        [(role, turn)] = step['turns'].items()
        player, _ = env.get_observation()
        assert f'player_{player}' == role  # textarena's turn order is the episode's
        done, _ = env.step(replies[role][turn - 1])
    assert done
    rewards, _ = env.close()
    return {f'player_{k}': float(v) for k, v in rewards.items()}


def check_rewards(game: str, result: Any, requests: List[Any]) -> None:
    by_episode: Dict[str, Dict[str, Any]] = {}
    for request, output in zip(requests, result.outputs):
        seat = request.data_dict['episode']
        by_episode.setdefault(seat['id'], {})[seat['role']] = output
    for episode, outputs in by_episode.items():
        seed = int(episode[1:])
        expected = replayed_rewards(game, seed, outputs)
        assert {role: out.rollout_infos['reward'] for role, out in outputs.items()} == expected
        assert sorted(expected.values()) in ([-1.0, 1.0], [0.0, 0.0])  # zero-sum: a win and a loss, or a draw


@pytest.mark.parametrize('game', GAMES)
@pytest.mark.parametrize('mode', [None, 'async'])
def test_scripted_self_play_rewards_are_textarenas(game, mode):
    roles = self_play('p', 2)
    result, requests = play(game, {'p': ScriptedBackend(respond=legal_mover)}, roles, mode=mode)
    assert set(result.finish_reasons) == {'episode_done'}
    check_rewards(game, result, requests)
    info = result.outputs[0].rollout_infos['episode']['info']
    assert info['game'] == game and set(info['rewards']) == {'0', '1'}


def test_an_invalid_move_is_textarenas_to_judge():
    roles = [Role('player_0', seat=0, policy='bad'), Role('player_1', seat=1, policy='good')]
    policies = {'bad': ScriptedBackend(outputs=['I like turtles.'], cycle=True),
                'good': ScriptedBackend(respond=legal_mover)}
    result, requests = play('TicTacToe-v0-raw', policies, roles, seeds=(0, ))
    bad, good = result.outputs
    assert (bad.rollout_infos['reward'], good.rollout_infos['reward']) == (-1.0, 1.0)
    assert 'format' in bad.rollout_infos['episode']['info']['result']['0']['reason']
    check_rewards('TicTacToe-v0-raw', result, requests)


@pytest.fixture(scope='module')
def embedded():
    import torch

    from mtflow.backends.hf import HFBackend
    from mtflow.backends.models import embedded_gguf_path

    try:
        embedded_gguf_path()
    except Exception as exc:  # installed by scripts/setup.sh
        pytest.skip(f'the embedded model is not installed: {exc}')
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared machine: one spinning thread, not two
    try:
        yield HFBackend('embedded', seed=0)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize('game', GAMES)
def test_the_embedded_model_plays_both_seats(embedded, game):
    result, requests = play(game, {'default': embedded}, self_play('default', 2), seeds=(0, ), max_tokens=6)
    assert set(result.finish_reasons) == {'episode_done'}
    assert any(o.response is not None for o in result.outputs)  # the model played
    check_rewards(game, result, requests)


@pytest.mark.slow
@pytest.mark.parametrize('game', GAMES)
def test_the_embedded_model_against_another_policy(embedded, game):
    roles = [Role('player_0', seat=0, policy='smollm'), Role('player_1', seat=1, policy='mover')]
    policies = {'smollm': embedded, 'mover': ScriptedBackend(respond=legal_mover)}
    result, requests = play(game, policies, roles, seeds=(1, ), max_tokens=6)
    assert set(result.finish_reasons) == {'episode_done'}
    assert [o.rollout_infos['episode']['policy'] for o in result.outputs] == ['smollm', 'mover']
    check_rewards(game, result, requests)
