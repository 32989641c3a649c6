"""A branched run on Ray actors (issue 47, item 10): every leaf reaches the sink exactly once and
each tree after its leaves, equal to one process's; an actor killed while it holds a fork's child
mid-tree has the whole prompt run again elsewhere, never a tree mixed from two runs or short of a
leaf. (``mtflow run CONFIG --ray N`` of a branched config: ``tests/distributed/test_ray_cli.py``.)"""
from __future__ import annotations

import functools
from typing import Any, Dict, List

import pytest

ray = pytest.importorskip('ray')
psutil = pytest.importorskip('psutil')

from mtflow import Executor  # noqa: E402
from mtflow.distributed import WorkerSpec, ray_run  # noqa: E402
from mtflow.run.trajectories import finished_to_record  # noqa: E402
from tests.distributed import ray_helpers as H  # noqa: E402
from tests.distributed.test_ray import cluster, comparable, path  # noqa: E402,F401 - the module's cluster

N = 8


def spec(gate: str = None) -> WorkerSpec:
    return WorkerSpec(make_backend=functools.partial(H.make_backend, N, gate, 'q5~1', 1),
                      make_scheduler=H.make_branched_scheduler, max_turns=10)


def single_process() -> tuple:
    records: Dict[str, Any] = {}

    def on_finished(f):
        records[f.uuid] = finished_to_record(f, index=f.root_index if f.root_index is not None else f.index)

    result = Executor(H.BranchedCountTurns(), H.make_backend(N), max_turns=10, on_error='return',
                      on_finished=on_finished).run(H.dataset(N))
    return records, {t['root']: t for t in result.trees}


def check(delivered: List[tuple]) -> None:
    """``delivered``: ``('leaf', RayRecord)`` and ``('tree', tree)`` in the order they came."""
    records, trees = single_process()
    leaves = [item for kind, item in delivered if kind == 'leaf']
    assert sorted(r.uuid for r in leaves) == sorted(records) and len({r.uuid for r in leaves}) == len(leaves)
    for rec in leaves:
        traj, events = records[rec.uuid]
        assert comparable(rec.trajectory) == comparable(traj), rec.uuid
        assert path(rec.events) == path(events), rec.uuid
    got = {item['root']: item for kind, item in delivered if kind == 'tree'}
    assert got == trees and len(got) == N
    seen = set()
    for kind, item in delivered:  # a tree comes after every one of its leaves
        if kind == 'leaf':
            seen.add(item.uuid)
        else:
            assert set(item['leaves']) <= seen, item['root']


def test_every_leaf_once_and_every_tree_whole(cluster):
    delivered: List[tuple] = []
    result = ray_run(H.dataset(N), spec(), num_actors=2, batch_size=3, sink=lambda r: delivered.append(('leaf', r)),
                     on_tree=lambda t: delivered.append(('tree', t)))
    check(delivered)
    assert result.delivered == 3 * N and result.actor_deaths == 0


def test_an_actor_killed_mid_tree_runs_the_whole_prompt_again(cluster, tmp_path):
    gate = tmp_path / 'gate'
    gate.mkdir()
    thread, killed = H.start_killer(gate)  # the actor holding q5's child q5~1 at its first call (forked before turn 2)
    delivered: List[tuple] = []
    result = ray_run(H.dataset(N), spec(str(gate)), num_actors=2, batch_size=3,
                     sink=lambda r: delivered.append(('leaf', r)), on_tree=lambda t: delivered.append(('tree', t)),
                     name_prefix='mtflow-branch-kill-test')
    thread.join(10)
    assert len(killed) == 1 and result.actor_deaths == 1
    check(delivered)  # the shard's prompts ran again whole: no tree mixed, none short, no leaf twice
    assert result.retried == 3 and result.duplicates_dropped == 0
