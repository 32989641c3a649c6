"""Bounded runs, the opt-in rank consistency check, and the lifecycle hooks."""
from __future__ import annotations

import random
import warnings

import pytest

import mtflow
from mtflow import Scheduler
from mtflow.engine.executor import RankMismatchError
from tests.helpers import Counter, dump, out, req
from tests.ranks import run_ranks


class Observe(Scheduler):

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': f'obs {current_turn}'})
        return {'infer_request': infer_request}


class NeverDone(Observe):
    """Overrides check_finished (never true) and on_turn_end (done: False): the first version
    ignored the scheduler's max_turns then and ran forever."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return False

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        return {'done': False}


def rollout():
    return Counter(lambda r, n: out(f'{r.uuid}:{n}', [n]))


# ---- bounds --------------------------------------------------------------------------------------


def test_the_schedulers_max_turns_bounds_a_native_run_whatever_it_overrides():
    result = mtflow.Executor(NeverDone(max_turns=3), rollout()).run([req('a'), req('b')])
    assert result.finish_reasons == ['max_turns', 'max_turns']
    assert [o.rollout_infos['num_turns'] for o in result.outputs] == [3, 3]
    # the tighter of the executor's and the scheduler's bound wins
    result = mtflow.Executor(NeverDone(max_turns=3), rollout(), max_turns=2).run([req('a')])
    assert result.outputs[0].rollout_infos['num_turns'] == 2


def test_a_run_with_no_bound_anywhere_is_capped_with_a_warning():
    with pytest.warns(RuntimeWarning, match='turn_cap=5'):
        result = mtflow.Executor(NeverDone(), rollout(), turn_cap=5).run([req('a')])
    assert result.finish_reasons == ['turn_cap'] and result.outputs[0].rollout_infos['num_turns'] == 5
    assert result.trace.path('a').endswith('finished(turn_cap)')


def test_run_multi_turn_keeps_ms_swifts_semantics_for_the_schedulers_max_turns():
    # ms-swift's driver: only the caller's max_turns bounds it; done=False wins over the
    # scheduler's own max_turns. mtflow then stops only at the safety cap.
    ex = mtflow.Executor(NeverDone(max_turns=2), rollout(), scheduler_bounds_run=False, turn_cap=4)
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # the scheduler has a bound of its own: no warning
        result = ex.run([req('a')], [out('a:0', [0])])
    assert result.finish_reasons == ['turn_cap']
    outputs = mtflow.run_multi_turn([req('a')], [out('a:0', [0])], NeverDone(max_turns=2), rollout(), None,
                                    max_turns=3)
    assert outputs[0].rollout_infos['num_turns'] == 3


# ---- ranks ---------------------------------------------------------------------------------------


class Flaky(Observe):
    """A check_finished that differs per rank (as when it depends on a rank-local RNG or clock)."""

    def __init__(self, rank, **kw):
        super().__init__(**kw)
        self.rng = random.Random(f'rank-{rank}')

    def check_finished(self, infer_request, response_choice, current_turn):
        return self.rng.random() < 0.5


def same_batch():
    return [req(f'r{i}') for i in range(6)]


def test_rank_check_raises_on_every_rank_naming_turn_and_ranks():

    def rank_main(rank, gather_fn):
        try:
            mtflow.Executor(Flaky(rank, max_turns=6), rollout(), gather_fn=gather_fn, rank=rank,
                            check_ranks=True).run(same_batch())
        except RankMismatchError as err:
            return err
        return None

    errors = run_ranks(3, rank_main)
    assert all(isinstance(e, RankMismatchError) for e in errors)
    assert len({(e.turn, tuple(e.ranks)) for e in errors}) == 1  # every rank raised the same
    err = errors[0]
    assert err.turn == 2 and f'turn {err.turn}' in str(err) and 'disagree' in str(err)
    assert err.ranks and all(f'rank {r}' in str(err) for r in range(3))
    result = err.result  # nothing lost: finished outputs and the failed live ones
    assert len(result.outputs) == 6 and all(o is not None for o in result.outputs)
    assert 'error' in result.finish_reasons


def test_rank_check_passes_when_ranks_agree_and_changes_nothing():

    class Same(Observe):

        def check_finished(self, infer_request, response_choice, current_turn):
            return current_turn >= int(infer_request.uuid[1:]) % 3 + 1

    def rank_main(rank, gather_fn, check):
        return mtflow.Executor(Same(max_turns=6), rollout(), gather_fn=gather_fn, rank=rank,
                               check_ranks=check).run(same_batch())

    checked = run_ranks(3, lambda rank, g: rank_main(rank, g, True))
    plain = run_ranks(3, lambda rank, g: rank_main(rank, g, False))
    for a, b in zip(checked, plain):
        assert dump(a.outputs) == dump(b.outputs) and a.finish_reasons == b.finish_reasons


# ---- lifecycle -----------------------------------------------------------------------------------


class Ends(Observe):

    def __init__(self, fail=None, **kw):
        super().__init__(**kw)
        self.fail = fail
        self.ended = []

    def step(self, infer_request, response_choice, current_turn):
        if infer_request.uuid == self.fail:
            raise RuntimeError('tool broke')
        return super().step(infer_request, response_choice, current_turn)

    async def on_trajectory_end(self, requests, error):
        self.ended.append(([r.uuid for r in requests], error))


def test_on_trajectory_end_runs_once_with_the_batch_and_the_error():
    sched = Ends(max_turns=2)
    mtflow.Executor(sched, rollout()).run([req('a'), req('b')])
    assert sched.ended == [(['a', 'b'], None)]
    sched = Ends(fail='b', max_turns=2)
    with pytest.raises(mtflow.MultiTurnRolloutError) as info:
        mtflow.Executor(sched, rollout()).run([req('a'), req('b')])
    [(uuids, error)] = sched.ended
    assert uuids == ['a', 'b'] and error is info.value
    sched = Ends(fail='b', max_turns=2)
    mtflow.Executor(sched, rollout(), on_error='return').run([req('a'), req('b')])
    assert sched.ended[0][1] is None  # nothing is raised


def test_a_failing_on_trajectory_end_is_reported():

    class Broken(Observe):

        def on_trajectory_end(self, requests, error):
            raise ValueError('close failed')

    result = mtflow.Executor(Broken(max_turns=1), rollout(), on_error='return').run([req('a')])
    assert [(f.phase, str(f.error)) for f in result.failures] == [('on_trajectory_end', 'close failed')]
