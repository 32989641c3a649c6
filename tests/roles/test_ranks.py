"""An episode stays on one rank (docs/multi-agent.md): ``--ray`` hands each episode's roles to one
actor in one shard, an actor that dies with part of an episode in flight has the whole episode run
again, and ``mtflow run --ray`` of an episode file writes what a local run writes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from mtflow.distributed.ray_fanout import RayRecord, RayRunResult, _shards
from mtflow.roles import Role, iter_episode_requests
from tests.roles.test_episodes import prompts

ROLES = [Role('a'), Role('b'), Role('c')]
ROOT = Path(__file__).resolve().parents[2]


def test_shards_keep_each_episode_whole_and_skip_it_whole():
    episodes = list(iter_episode_requests(prompts(4), ROLES))
    result = RayRunResult()
    pending, attempts = _shards(episodes, 2, {'e1/a', 'e1/b', 'e1/c'}, result)
    assert [[r.uuid for _, r in shard] for shard in pending] == [['e0/a', 'e0/b', 'e0/c'], ['e2/a', 'e2/b', 'e2/c'],
                                                                 ['e3/a', 'e3/b', 'e3/c']]
    assert result.skipped == 3 and result.requests == 9 and set(attempts) == {r.uuid for g in episodes for r in g} - {
        'e1/a', 'e1/b', 'e1/c'}


def test_an_actor_that_dies_mid_episode_runs_the_whole_episode_again():
    pytest.importorskip('ray')
    from mtflow.distributed.ray_fanout import _FanOut, _Slot

    requeued = []
    shard = [(0, r) for r in next(iter(iter_episode_requests(prompts(1), ROLES)))]
    result = RayRunResult()
    fan = _FanOut.__new__(_FanOut)  # the death handler alone: no cluster, no actor
    fan.ray = SimpleNamespace(kill=lambda actor: None)
    fan.result, fan.pending, fan.attempts, fan.done = result, __import__('collections').deque(), {}, set()
    fan.sink, fan.on_duplicate, fan.on_progress, fan.on_requeue = None, None, None, requeued.extend
    fan.max_attempts, fan.restarts_left, fan.slots = 3, 0, []
    fan.attempts.update({r.uuid: 1 for _, r in shard})
    fan.deliver(RayRecord(0, 'e0/a', 'error', {}, [], 0, 1, None, []))  # a role that failed early was delivered
    slot = _Slot(0)
    slot.shard = shard
    fan.lost(slot, 'killed')
    assert requeued == ['e0/a'] and fan.done == set()
    assert [[r.uuid for _, r in s] for s in fan.pending] == [['e0/a', 'e0/b', 'e0/c']]


@pytest.mark.slow
def test_mtflow_run_ray_of_an_episode_file_equals_a_local_run(tmp_path, monkeypatch):
    pytest.importorskip('ray')
    from mtflow.cli import main

    monkeypatch.chdir(tmp_path)
    shutil.copy(ROOT / 'schedulers' / 'episodes' / 'textarena_tictactoe.yaml', 'ttt.yaml')
    Path('mover.py').write_text('from tests.roles.test_textarena import legal_mover\n')
    Path('games.jsonl').write_text(''.join(json.dumps({'uuid': f'g{k}', 'prompt': 'play', 'seed': k}) + '\n'
                                           for k in range(6)))
    Path('run.yaml').write_text("scheduler: ttt.yaml\nbackend: scripted\nbackend_options: {respond: 'mover:legal_mover'}\n"
                                'dataset: games.jsonl\nmax_turns: 12\nbatch_size: 4\n')
    assert main(['run', 'run.yaml', '--out', 'local', '-q']) == 0
    assert main(['run', 'run.yaml', '--out', 'ray', '--ray', '2', '-q']) == 0
    local = {json.loads(x)['uuid']: json.loads(x) for x in Path('local/trajectories.jsonl').read_text().splitlines()}
    ray = {json.loads(x)['uuid']: json.loads(x) for x in Path('ray/trajectories.jsonl').read_text().splitlines()}
    assert set(ray) == set(local) and len(ray) == 12
    for uuid, line in ray.items():
        assert {k: v for k, v in line.items() if k != 'rank'} == {k: v for k, v in local[uuid].items() if k != 'rank'}
    for k in range(6):  # each episode on one rank
        assert ray[f'g{k}/player_0']['rank'] == ray[f'g{k}/player_1']['rank']
