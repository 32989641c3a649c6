"""``torch_gather`` and ``accelerate_gather`` on real gloo process groups (2 and 3 spawned
processes on 127.0.0.1): ranks with different numbers of requests (including none) and turns
produce exactly what each rank produces alone, merge to one process's outputs, call
``rollout_fn`` equally often, survive a scheduler that raises on one rank, fail fast (no hang)
when a peer leaves the loop, and every process exits with code 0 (clean teardown)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

pytest.importorskip('torch.distributed')

import mtflow  # noqa: E402
from tests.distributed.procs import launch  # noqa: E402
from tests.distributed.workers import LAYOUTS, MAX_TURNS, RAISING, rank_main  # noqa: E402
from tests.helpers import Counter, dump, req  # noqa: E402
from tests.ranks import StopAfter, first_outputs, make_output  # noqa: E402


def run_group(tmp: Path, world: int, scenarios: List[str], kind: str = 'torch', env: Dict[str, str] = None,
              expect_codes: List[int] = None) -> List[Dict[str, Any]]:
    codes = launch(rank_main, world, (kind, scenarios, str(tmp)), timeout=300, env=env)
    reports = [json.loads((tmp / f'rank{r}.json').read_text()) for r in range(world)]
    crashes = [r.get('crash') for r in reports if r.get('crash')]
    assert not crashes, crashes[0]
    assert codes == (expect_codes or [0] * world), codes  # no SIGABRT (-6) at teardown
    return reports


def single_process(shards: List[List[str]]) -> List[Any]:
    requests = [req(u) for shard in shards for u in shard]
    ex = mtflow.Executor(StopAfter(), Counter(make_output), max_turns=MAX_TURNS)
    res = ex.run(requests, first_outputs(requests))
    return json.loads(json.dumps(dump(res.outputs), default=str))


@pytest.fixture(scope='module', params=[2, 3], ids=['2 ranks', '3 ranks'])
def group(request, tmp_path_factory):
    world = request.param
    tmp = tmp_path_factory.mktemp(f'gloo{world}')
    return world, run_group(tmp, world, ['layouts', 'raising', 'check_ranks', 'branching'])


def test_ranks_join_the_group(group):
    world, reports = group
    assert [(r['got_rank'], r['world']) for r in reports] == [(i, world) for i in range(world)]


@pytest.mark.parametrize('layout', ['uneven', 'idle', 'one busy'])
def test_outputs_equal_each_rank_alone_and_one_process(group, layout):
    world, reports = group
    name = list(LAYOUTS[world])[['uneven', 'idle', 'one busy'].index(layout)]
    shards = LAYOUTS[world][name]
    per_rank = [r['layouts'][name] for r in reports]
    for rank, entry in enumerate(per_rank):
        assert len(entry['outputs']) == len(shards[rank])
        assert entry['outputs'] == entry['alone'], f'rank {rank}'
        assert entry['trace_ranks'] == ([rank] if shards[rank] else [])
    merged = [o for entry in per_rank for o in entry['outputs']]
    assert merged == single_process(shards)


@pytest.mark.parametrize('layout', ['uneven', 'idle', 'one busy'])
def test_every_rank_calls_rollout_fn_equally(group, layout):
    world, reports = group
    name = list(LAYOUTS[world])[['uneven', 'idle', 'one busy'].index(layout)]
    shards = LAYOUTS[world][name]
    calls = [r['layouts'][name]['calls'] for r in reports]
    longest = max(int(u.split('-')[1]) for shard in shards for u in shard)
    assert [len(c) for c in calls] == [longest] * world  # turns 2..longest plus the final empty call
    for shard, rank_calls in zip(shards, calls):
        if not shard:
            assert rank_calls == [[]] * longest  # an idle rank joins every call with nothing
    # alone, a rank stops as soon as its own requests are done
    alone = [r['layouts'][name]['alone_calls'] for r in reports]
    assert alone == [max([int(u.split('-')[1]) for u in shard], default=0) for shard in shards]


def test_a_raising_scheduler_on_one_rank_keeps_the_others_in_step(group):
    world, reports = group
    shards = RAISING[world]
    for on_error in ('return', 'raise'):
        entries = [r['raising'][on_error] for r in reports]
        assert len({e['calls'] for e in entries}) == 1, [e['calls'] for e in entries]
        broken = entries[1]
        # rank 1's requests that would step at turn 2 fail there; those done by turn 2 finish normally
        expected = ['check_finished' if int(u.split('-')[1]) <= 2 else 'error' for u in shards[1]]
        assert broken['finish_reasons'] == expected
        assert {(f['turn'], f['phase']) for f in broken['failures']} == {(2, 'step')}
        assert broken['raised'] == ('MultiTurnRolloutError' if on_error == 'raise' else None)
        for rank, entry in enumerate(entries):
            if rank != 1:
                assert entry['raised'] is None and not entry['failures']
                assert entry['finish_reasons'] == ['check_finished'] * len(shards[rank])
        healthy = [o for rank, e in enumerate(entries) if rank != 1 for o in e['outputs']]
        assert healthy == single_process([s for rank, s in enumerate(shards) if rank != 1])


def test_the_rank_consistency_check_works_over_torch_gather(group):
    world, reports = group
    agree = [r['check_ranks']['agree'] for r in reports]
    assert all(a['raised'] is None for a in agree)
    assert all(a['outputs'] == agree[0]['outputs'] for a in agree) and len(agree[0]['outputs']) == 3
    drift = [r['check_ranks']['drift'] for r in reports]
    assert all(d['raised'] == 'RankMismatchError' for d in drift), drift
    assert len({(d['turn'], tuple(d['ranks'])) for d in drift}) == 1  # every rank raised the same, together
    assert drift[0]['turn'] == 3 and world - 1 in drift[0]['ranks']  # r-5 left the last rank's live set at turn 2
    assert len({d['calls'] for d in drift}) == 1
    assert all('error' in d['finish_reasons'] for d in drift)


@pytest.mark.parametrize('world', [2, 3])
def test_a_rank_leaving_the_loop_fails_its_peers_fast_instead_of_hanging(tmp_path, world):
    # The group's own timeout is 10 minutes here: the peers must notice the departure, not time out.
    codes = [0] * (world - 1) + [3]
    reports = run_group(tmp_path, world, ['peer_exits'], env={'MTFLOW_TEST_PG_TIMEOUT': '600'}, expect_codes=codes)
    assert reports[-1]['exited'] == 3
    for report in reports[:-1]:
        result = report['peer_exits']
        assert result['error'] == 'GatherError', result
        assert f"on rank {report['rank']} of {world} at call 3" in result['message']


def test_accelerate_gather_over_partial_state(tmp_path):
    # as under `accelerate launch --cpu`: the group is made by accelerate's PartialState
    reports = run_group(tmp_path, 2, ['layouts'], kind='accelerate', env={'ACCELERATE_USE_CPU': 'true'})
    shards = LAYOUTS[2]['uneven']
    per_rank = [r['layouts']['uneven'] for r in reports]
    assert [o for e in per_rank for o in e['outputs']] == single_process(shards)
    assert [len(e['calls']) for e in per_rank] == [6, 6]


def test_torch_gather_without_a_process_group_is_a_clear_error():
    from mtflow.distributed import GatherError, torch_gather

    with pytest.raises(GatherError, match='init_process_group'):
        torch_gather()


def test_each_rank_forks_its_own_requests_over_a_real_group(group):
    """Issue 47, item 10: branching with ``gather_fn`` (it was refused): every rank's leaves and
    trees are its requests' alone, and the ranks called ``rollout_fn`` equally often."""
    world, reports = group
    entries = [r['branching'] for r in reports]
    assert not [e['error'] for e in entries if 'error' in e], entries
    for rank, entry in enumerate(entries):
        assert entry['together']['outputs'] == entry['alone']['outputs'], rank
        assert entry['together']['trees'] == entry['alone']['trees'], rank
    assert entries[0]['together']['leaves'] == [['a', 'a~3', 'a~4'], ['b', 'b~1', 'b~3']]
    assert len({len(e['together']['calls']) for e in entries}) == 1
