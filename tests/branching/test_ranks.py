"""Branching across ranks and through ``run_multi_turn`` (issue 47, item 10): each rank forks its
own requests, the ranks stay in step through ``gather_fn`` (every rank calls ``rollout_fn`` as
often, an idle rank too), and each rank's leaves and trees are exactly what the same requests
give in one process; ``run_multi_turn`` (the ms-swift drop-in, whose default ``gather_fn`` is
passed explicitly) forks in a single process; ms-swift's own driver refuses a ``branch:`` section
in one line instead of ignoring it (``tests/swift/test_branch_refused.py``)."""
from __future__ import annotations

import json
from typing import Any, Dict, List

import mtflow
from mtflow import Branching, Executor
from tests.branching.helpers import ToolLoop, model
from tests.helpers import dump, req
from tests.ranks import run_ranks

BRANCH = Branching(at={'turn': 2}, copies=2, leaves=3)
STOP_AT = {'a': 1, 'b~1': 3, 'c': 4}  # a ends before its fork (its budget tops the tree up); b~1 before the others
SHARDS = [['a', 'b'], ['c'], []]  # rank 2 holds nothing and joins every turn with []


class Calls:
    """``model`` counting this rank's calls (``[]`` ones included)."""

    def __init__(self) -> None:
        self.calls: List[List[str]] = []

    def __call__(self, requests, request_config=None):
        self.calls.append([r.uuid for r in requests])
        return model(requests, request_config)


def _run(uuids: List[str], gather_fn: Any = None, rank: int = 0) -> Dict[str, Any]:
    rollout = Calls()
    result = Executor(ToolLoop(stop_at=STOP_AT), rollout, max_turns=4, branch=BRANCH, gather_fn=gather_fn,
                      rank=rank).run([req(u) for u in uuids])
    return {'outputs': json.loads(json.dumps(dump(result.outputs), default=str)), 'trees': result.trees,
            'uuids': [o.rollout_infos.get('uuid') for o in result.outputs], 'calls': rollout.calls,
            'leaves': [t['leaves'] for t in result.trees]}


def test_each_rank_forks_its_own_requests_in_step_with_the_others():
    ranks = run_ranks(len(SHARDS), lambda rank, gather: _run(SHARDS[rank], gather, rank))
    for rank, shard in enumerate(SHARDS):
        alone = _run(shard)
        assert ranks[rank]['outputs'] == alone['outputs'], rank
        assert ranks[rank]['trees'] == alone['trees'], rank
    # a ended at turn 1, before its fork: two copies of its prompt top its tree up; b~1 ended at turn
    # 3 with a share of 1 (none to give back); b kept 2, and the top-up for its unspent one is b~3
    assert ranks[0]['leaves'] == [['a', 'a~3', 'a~4'], ['b', 'b~1', 'b~3']]
    assert ranks[1]['leaves'] == [['c', 'c~1', 'c~3']] and ranks[2]['trees'] == []
    # in step: every rank called rollout_fn as often, the idle one always with nothing
    assert len({len(r['calls']) for r in ranks}) == 1
    assert all(call == [] for call in ranks[2]['calls'])


def test_run_multi_turn_forks_in_one_process():
    scheduler = ToolLoop(stop_at=STOP_AT)
    scheduler.branch = BRANCH  # as a YAML scheduler's branch: section sets it
    requests = [req('a'), req('b')]
    outputs = mtflow.run_multi_turn(requests, None, scheduler, model, None, 4)
    assert [r.uuid for r in requests] == ['a', 'b', 'a~3', 'a~4', 'b~1', 'b~3']  # the children's requests appended
    alone = Executor(ToolLoop(stop_at=STOP_AT), model, max_turns=4, branch=BRANCH).run([req('a'), req('b')])
    assert dump(outputs) == dump(alone.outputs) and len(outputs) == 6
