"""Distributed ranks in step: every rank calls ``rollout_fn`` the same number of times, and the
outputs equal those of one rank running every request alone."""
from __future__ import annotations

import pytest

import mtflow
from tests.helpers import Counter, clone, dump, req
from tests.ranks import StopAfter, first_outputs, make_output, run_ranks


# rank -> request uuids (the number after the dash is how many turns that request takes)
LAYOUTS = {
    'uneven': [['r0-1', 'r0-4'], ['r1-2'], ['r2-6', 'r2-1', 'r2-3']],
    'idle rank': [['r0-3', 'r0-5'], [], ['r2-2']],
    'all idle but one': [[], [], ['r2-4']],
}


@pytest.mark.parametrize('layout', list(LAYOUTS))
def test_ranks_match_a_single_rank_and_call_rollout_fn_equally(layout):
    shards = LAYOUTS[layout]
    all_requests = [req(u) for shard in shards for u in shard]
    alone = mtflow.run_multi_turn(clone(all_requests), first_outputs(all_requests), StopAfter(), Counter(make_output),
                                  None)

    rollouts = [Counter(make_output) for _ in shards]

    def rank_main(rank, gather_fn):
        requests = [req(u) for u in shards[rank]]
        return mtflow.Executor(StopAfter(), rollouts[rank], gather_fn=gather_fn, rank=rank).run(
            requests, first_outputs(requests))

    results = run_ranks(len(shards), rank_main)
    merged = [o for res in results for o in res.outputs]
    assert dump(merged) == dump(alone)
    calls = [len(r.calls) for r in rollouts]
    assert len(set(calls)) == 1, calls
    longest = max(int(u.split('-')[1]) for shard in shards for u in shard)
    assert calls[0] == longest  # turns 2..longest, plus the final empty call
    # ranks whose requests are done call with [] while others work
    for shard, rollout in zip(shards, rollouts):
        if not shard:
            assert all(c == [] for c in rollout.calls)
    # traces carry their rank
    for rank, res in enumerate(results):
        assert all(e.rank == rank for e in res.trace)


def test_a_failing_request_on_one_rank_does_not_hang_the_others():

    class Flaky(StopAfter):

        def step(self, infer_request, response_choice, current_turn):
            if infer_request.uuid == 'r0-5' and current_turn == 2:
                raise RuntimeError('environment crashed')
            return super().step(infer_request, response_choice, current_turn)

    shards = [['r0-5', 'r0-2'], ['r1-4']]
    rollouts = [Counter(make_output) for _ in shards]

    def rank_main(rank, gather_fn):
        requests = [req(u) for u in shards[rank]]
        return mtflow.Executor(Flaky(), rollouts[rank], gather_fn=gather_fn, on_error='return').run(
            requests, first_outputs(requests))

    results = run_ranks(2, rank_main)
    assert results[0].finish_reasons == ['error', 'check_finished']
    assert results[1].finish_reasons == ['check_finished']
    assert len(rollouts[0].calls) == len(rollouts[1].calls) == 4
    failure = results[0].failures[0]
    assert (failure.uuid, failure.turn, failure.phase) == ('r0-5', 2, 'step')


def test_a_rollout_fn_returning_too_few_outputs_on_one_rank_keeps_ranks_in_step():
    shards = [['r0-3', 'r0-3b'], ['r1-4']]

    class Short(Counter):

        def __call__(self, requests, request_config):
            return super().__call__(requests, request_config)[:1]

    rollouts = [Short(make_output), Counter(make_output)]

    def rank_main(rank, gather_fn):
        requests = [req(u.replace('b', '')) for u in shards[rank]]
        return mtflow.Executor(StopAfter(), rollouts[rank], gather_fn=gather_fn, on_error='return').run(
            requests, first_outputs(requests))

    results = run_ranks(2, rank_main)
    assert results[0].finish_reasons == ['error', 'error']
    assert 'rollout_fn returned 1 output(s) for 2 request(s)' in str(results[0].failures[0].error)
    assert results[1].finish_reasons == ['check_finished']
    assert len(rollouts[0].calls) == len(rollouts[1].calls)
