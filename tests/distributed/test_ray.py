"""Ray fan-out on a real local cluster (``ray.init(num_cpus=2)``, 2 actors, the scripted backend):
the trajectories equal a single process's; an actor killed (``ray.kill``) while it holds a
request mid-rollout loses nothing and writes nothing twice; and every Ray process this test
started is gone after ``ray.shutdown()``."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Dict, List

import pytest

ray = pytest.importorskip('ray')
psutil = pytest.importorskip('psutil')

from mtflow import Executor  # noqa: E402
from mtflow.distributed import RayRunError, WorkerSpec, ray_run  # noqa: E402
from mtflow.run.trajectories import finished_to_record  # noqa: E402
from tests.distributed import ray_helpers as H  # noqa: E402

N = 12


def ray_processes() -> List[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)]


def assert_gone(procs: List[psutil.Process], timeout: float = 60.0) -> None:
    gone, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, [(p.pid, p.name()) for p in alive]


@pytest.fixture(scope='module')
def cluster():
    before = {p.pid for p in ray_processes()}
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address='127.0.0.1', object_store_memory=100 * 1024**2,
             runtime_env={'env_vars': {'PYTHONPATH': str(Path(__file__).resolve().parents[2])}})
    try:
        yield
    finally:
        started = [p for p in ray_processes() if p.pid not in before]
        ray.shutdown()
        assert_gone(started)


def spec(gate: str = None) -> WorkerSpec:
    return WorkerSpec(make_backend=functools.partial(H.make_backend, N, gate), make_scheduler=H.make_scheduler,
                      max_turns=10)


def single_process() -> Dict[str, Dict[str, Any]]:
    """The reference: one executor over the whole dataset, records made the same way."""
    records = {}

    def on_finished(f):
        records[f.uuid] = finished_to_record(f)

    ex = Executor(H.CountTurns(), H.make_backend(N), max_turns=10, on_error='return', on_finished=on_finished)
    ex.run(H.dataset(N))
    return records


def comparable(trajectory: Dict[str, Any]) -> Dict[str, Any]:
    # the shard's replay record (`turns`, docs/replay.md) has no counterpart in the plain
    # executor's finished_to_record used as the reference; tests/distributed/test_ray_cli.py
    # compares it with a local run's
    return {k: v for k, v in trajectory.items() if k not in ('rank', 'turns')}


def path(events: List[Dict[str, Any]]) -> List[tuple]:
    return [(e['turn'], e['from'], e['to'], e['trigger'], e['reason']) for e in events]


def check_against_single_process(records: List[Any]) -> None:
    reference = single_process()
    uuids = [r.uuid for r in records]
    assert sorted(uuids) == sorted(reference) and len(set(uuids)) == len(uuids)  # each exactly once
    for rec in records:
        traj, events = reference[rec.uuid]
        assert comparable(rec.trajectory) == comparable(traj), rec.uuid
        assert path(rec.events) == path(events), rec.uuid
        assert {e['index'] for e in rec.events} == {traj['index']}
        assert {e['rank'] for e in rec.events} == {rec.actor} == {rec.trajectory['rank']}


def test_two_actors_produce_a_single_process_trajectories(cluster):
    records = []
    result = ray_run(H.dataset(N), spec(), num_actors=2, batch_size=3, sink=records.append)
    check_against_single_process(records)
    assert result.delivered == N and result.shards == 4 and result.actor_deaths == 0
    assert sum(result.per_actor.values()) == N  # which actor ran what depends on who was idle first
    assert result.finish_reasons == {'check_finished': N}
    assert result.rollout_fn_calls > 0 and result.backend == 'scripted (gated)'


def test_an_actor_killed_mid_rollout_loses_nothing_and_writes_nothing_twice(cluster, tmp_path):
    gate = tmp_path / 'gate'
    gate.mkdir()
    records = []
    # kill the actor that holds q5 at its turn 2, once q4 (same shard, done at turn 1, so streamed
    # before q5's turn 2 began) has reached the driver
    thread, killed = H.start_killer(gate, lambda: any(r.uuid == 'q4' for r in list(records)))
    result = ray_run(H.dataset(N), spec(str(gate)), num_actors=2, batch_size=3, sink=records.append,
                     name_prefix='mtflow-kill-test')
    thread.join(10)
    assert len(killed) == 1
    check_against_single_process(records)
    assert result.actor_deaths == 1 and result.restarts == 1
    # q5's shard (q3, q4, q5: 4, 1 and 2 turns) was cut: q4 had finished at turn 1 and was
    # streamed before the kill; q3 and q5 ran again on another actor
    assert result.retried == 2
    by_uuid = {r.uuid: r for r in records}
    assert by_uuid['q4'].attempt == 1 and by_uuid['q3'].attempt == by_uuid['q5'].attempt == 2
    assert result.duplicates_dropped == 0 and result.given_up == 0


def test_skip_runs_only_what_is_not_done(cluster):
    records = []
    done = [f'q{k}' for k in range(0, N, 2)]
    result = ray_run(H.dataset(N), spec(), num_actors=2, batch_size=4, sink=records.append, skip=done)
    assert sorted(r.uuid for r in records) == sorted(f'q{k}' for k in range(1, N, 2))
    assert result.skipped == len(done) and result.delivered == N - len(done)


def test_an_actor_that_cannot_start_is_a_clear_error(cluster):

    def broken_backend():
        raise RuntimeError('no such model: /models/missing')

    with pytest.raises(RayRunError, match='could not start.*no such model'):
        ray_run(H.dataset(2), WorkerSpec(broken_backend, H.make_scheduler), num_actors=1)
