"""The actor side of the Ray fan-out without Ray: :class:`ShardWorker` streams each request as
the executor finishes it (grouped per moment, dataset indices, the actor's slot as rank), ends
with the shard's figures, and lets an exception that escapes the executor out."""
from __future__ import annotations

import functools

import pytest

from mtflow.distributed import ShardWorker, WorkerSpec
from tests.distributed import ray_helpers as H


def worker(n: int = 8) -> ShardWorker:
    return ShardWorker(WorkerSpec(functools.partial(H.make_backend, n), H.make_scheduler, max_turns=10), slot=3)


def test_a_shard_streams_its_requests_with_dataset_indices_then_its_figures():
    data = H.dataset(8)
    shard = [(i, data[i]) for i in (5, 6, 7, 4)]  # q5: 2 turns, q6: 3, q7: 4, q4: 1
    items = list(worker().run_shard(shard))
    kinds = [k for k, _ in items]
    assert kinds[-1] == 'done' and set(kinds[:-1]) == {'finished'}
    records = [r for k, group in items[:-1] for r in group]
    assert [r['uuid'] for r in records] == ['q4', 'q5', 'q6', 'q7']  # in the order they finished
    for r in records:
        index = int(r['uuid'][1:])
        assert r['index'] == r['trajectory']['index'] == index
        assert r['trajectory']['rank'] == 3 and {e['rank'] for e in r['events']} == {3}
        assert {e['index'] for e in r['events']} == {index}
        assert r['trajectory']['num_turns'] == H.turns_of(index) and r['failure'] is None
    assert items[-1][1]['rollout_fn_calls'] >= 4  # one per turn of the longest request (q7: 4)


def test_an_exception_past_the_executor_leaves_the_generator():

    class Exploding(H.CountTurns):

        def step(self, infer_request, response_choice, current_turn):
            raise SystemExit('environment pulled the plug')

    w = ShardWorker(WorkerSpec(functools.partial(H.make_backend, 4), lambda tok: Exploding(), max_turns=10), slot=0)
    data = H.dataset(4)
    with pytest.raises(SystemExit, match='pulled the plug'):
        list(w.run_shard([(i, data[i]) for i in range(4)]))


def test_close_closes_the_scheduler_then_the_backend():
    """What the driver asks of each live actor before it kills it (a scheduler may hold
    processes of its own, e.g. launched OpenEnv servers)."""
    closed = []

    class Closing(H.CountTurns):

        def close(self):
            closed.append('scheduler')

    def backend():
        b = H.make_backend(2)
        b.close = lambda: closed.append('backend')
        return b

    w = ShardWorker(WorkerSpec(backend, lambda tok: Closing(), max_turns=10), slot=0)
    data = H.dataset(2)
    list(w.run_shard([(i, data[i]) for i in range(2)]))
    w.close()
    assert closed == ['scheduler', 'backend']


def test_each_record_carries_the_turns_replay_serves():
    from mtflow.run.turn_log import expand_turns

    data = H.dataset(8)
    items = list(worker().run_shard([(i, data[i]) for i in (5, 6, 7)]))
    records = [r for k, group in items if k == 'finished' for r in group]
    assert len(records) == 3
    for r in records:
        line = r['trajectory']
        turns = expand_turns(line)
        assert len(turns) == line['num_turns'] == H.turns_of(int(r['uuid'][1:]))
        assistant = [m['content'] for m in line['messages'] if m['role'] == 'assistant']
        assert [t['text'] for t in turns] == assistant and len({t['prompt'] for t in turns}) == len(turns)
