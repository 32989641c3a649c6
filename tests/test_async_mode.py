"""Async mode (``Executor(..., mode='async')``): the lockstep driver's handlers driven per request.

Same outputs as lockstep whenever a reply depends only on the request; the concurrency bound;
stragglers that do not delay the others (asserted by the order of trace events, never by wall
time); faults, deadlines and interrupts as in lockstep; partial rollouts that resume exactly."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Dict, List

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mtflow
from benchmarks.longtail_sim import LongTailScheduler, SimEngine, Workload
from mtflow import Executor, RolloutInterrupted, Scheduler
from mtflow.engine.async_driver import UnfinishedRequest, Until
from tests.helpers import clone, dump, out, req
from tests.test_properties import PlanScheduler, build, plans_st

FAST = Workload(seed=5, min_turns=2, max_turns=5, reply_median=6, tool_median_s=0.001, tail_max=10)


def by_turn(request) -> int:
    return 1 + sum(1 for m in request.messages if m.get('role') == 'assistant')


class Replies:
    """A ``rollout_fn`` whose reply depends only on the request (uuid and turn); records the calls.
    ``gates``: uuid -> asyncio-free ``threading.Event`` the request's reply waits for (async)."""

    def __init__(self, sync: bool = False) -> None:
        self.calls: List[List[str]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.hold: Dict[str, Any] = {}
        self.fail: Dict[str, BaseException] = {}
        self.sync = sync

    def reply(self, r):
        t = by_turn(r)
        return out(f'{r.uuid} says {t}', [100 * t + k for k in range(3)], [-0.1 * t] * 3)

    async def __call__(self, requests, config):
        self.calls.append([r.uuid for r in requests])
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0)
            for r in requests:
                hold = self.hold.get(r.uuid)
                if hold is not None:
                    await hold()
                if r.uuid in self.fail:
                    raise self.fail[r.uuid]
            return [self.reply(r) for r in requests]
        finally:
            self.in_flight -= 1


class Steps(Scheduler):
    """``rK`` (or ``xK``) stops after K+1 turns; each step adds an observation with masked ids."""

    def __init__(self, step_hold=None, max_turns=10, **kw):
        super().__init__(max_turns=max_turns, **kw)
        self.step_hold = step_hold or {}
        self.finished = []

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= int(infer_request.uuid[1:]) + 1

    async def step(self, infer_request, response_choice, current_turn):
        hold = self.step_hold.get(infer_request.uuid)
        if hold is not None:
            await hold()
        infer_request.messages.append({'role': 'user', 'content': f'obs {current_turn}'})
        ids = list(response_choice.token_ids) + [7, 7]
        return {'infer_request': infer_request, 'response_token_ids': ids,
                'response_loss_mask': [1] * (len(ids) - 2) + [0, 0], 'rollout_infos': {f't{current_turn}': 1}}

    def on_request_finished(self, infer_request, reason, turn):
        self.finished.append(infer_request.uuid)


def both(make_scheduler, make_requests, make_rollout, **kw):
    outs = {}
    for mode in ('lockstep', 'async'):
        requests = make_requests()
        result = Executor(make_scheduler(), make_rollout(), None, mode=mode, on_error='return', **kw).run(requests)
        outs[mode] = (result, requests)
    return outs


# ---- same outputs ---------------------------------------------------------------------------------
def test_async_outputs_equal_lockstep_on_the_long_tail_workload():
    res = both(lambda: LongTailScheduler(FAST), lambda: FAST.requests(12), lambda: SimEngine(FAST, decode_s=0.0002))
    lock, asy = res['lockstep'][0], res['async'][0]
    assert lock.ok and asy.ok
    assert dump(asy.outputs) == dump(lock.outputs)
    assert dump(res['async'][1]) == dump(res['lockstep'][1]), 'the final requests too'
    assert asy.finish_reasons == lock.finish_reasons
    for uuid in lock.trace.uuids():  # same states, same triggers, same per-event fields but time
        strip = [(e.turn, e.src, e.dst, e.trigger, e.reason, e.tokens, e.extra) for e in lock.trace.for_request(uuid)]
        assert [(e.turn, e.src, e.dst, e.trigger, e.reason, e.tokens, e.extra)
                for e in asy.trace.for_request(uuid)] == strip
    assert asy.turns == lock.turns == max(FAST.turns(f'r{i:04d}') for i in range(12))
    assert asy.rollout_fn_calls == sum(FAST.turns(f'r{i:04d}') for i in range(12)), 'one call per request-turn'


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.filterwarnings('ignore:PlanScheduler. no max_turns')
@SETTINGS
@given(plans=plans_st(with_bare_ids=True), max_turns=st.sampled_from([None, 1, 2, 3]))
def test_async_agrees_with_lockstep_on_random_plans(plans, max_turns):
    """The contract's property scenarios (ids, masks, logprobs, continuations, hooks' done)."""
    by_uuid, requests, firsts, rollout_factory = build(plans)
    results = {}
    for mode in ('lockstep', 'async'):
        reqs = clone(requests)
        result = Executor(PlanScheduler(by_uuid), rollout_factory(), None, max_turns=max_turns, mode=mode,
                          on_error='return').run(reqs, clone(firsts))
        results[mode] = (dump(result.outputs), result.finish_reasons, [f.to_dict() for f in result.failures],
                         dump(reqs))
    assert results['async'] == results['lockstep']


def test_sync_rollout_fn_runs_in_a_thread_pool_and_agrees():
    barrier = threading.Barrier(3, timeout=60)
    calls = []

    def rollout(requests, config):  # every first-turn call waits for two others: they run at once
        calls.append([r.uuid for r in requests])
        if by_turn(requests[0]) == 1:
            barrier.wait()
        return [Replies().reply(r) for r in requests]

    result = Executor(Steps(), rollout, mode='async').run([req('r1'), req('r2'), req('r0')])
    assert result.ok and not barrier.broken
    assert all(len(c) == 1 for c in calls) and len(calls) == 2 + 3 + 1
    lock = Executor(Steps(), lambda rs, c: [Replies().reply(r) for r in rs]).run([req('r1'), req('r2'), req('r0')])
    assert dump(result.outputs) == dump(lock.outputs)


def test_first_turn_outputs_and_on_finished_and_one_gather_at_the_end():
    gathered, finished = [], []

    def gather(values):
        gathered.append(list(values))
        return list(values)

    rollout = Replies()
    requests = [req('r0'), req('r2'), req('r1')]
    first = [rollout.reply(r) for r in requests]
    result = Executor(Steps(), rollout, mode='async', gather_fn=gather, on_finished=finished.append).run(requests, first)
    assert result.ok and gathered == [[3]], 'gather_fn once, at the end, with the requests finished here'
    assert sorted(f.uuid for f in finished) == ['r0', 'r1', 'r2']
    assert all(f.events and f.events[-1].dst == 'finished' for f in finished)
    assert [f.uuid for f in finished][0] == 'r0', 'the one-turn request finished first'
    lock = Executor(Steps(), Replies()).run([req('r0'), req('r2'), req('r1')], first)
    assert dump(result.outputs) == dump(lock.outputs)


# ---- concurrency and stragglers ----------------------------------------------------------------------
def test_the_concurrency_bound_holds_and_is_reached():
    rollout = Replies()
    requests = [req(f'r{i % 3}') for i in range(10)]
    for i, r in enumerate(requests):
        r.uuid = f'r{i % 3}-{i}'
    sched = Steps()
    sched.check_finished = lambda r, c, t: t >= int(r.uuid[1]) + 1
    result = Executor(sched, rollout, mode='async', max_concurrency=3).run(requests)
    assert result.ok
    assert rollout.max_in_flight == 3, 'three calls were in flight at once, never more'
    assert all(len(c) == 1 for c in rollout.calls)
    # in the trace: at most three requests between their first move and their finish at any moment
    live, most = set(), 0
    for e in result.trace.events:
        if e.src == 'pending':
            live.add(e.uuid)
        if e.dst == 'finished':
            live.discard(e.uuid)
        most = max(most, len(live))
    assert most == 3
    assert [e.uuid for e in result.trace.events if e.src == 'pending'][:3] == ['r0-0', 'r1-1', 'r2-2']


def _gate():
    """An awaitable that returns once ``open`` was set (polled, so it works on any loop)."""
    flag = threading.Event()

    async def wait():
        for _ in range(60000):
            if flag.is_set():
                return
            await asyncio.sleep(0.001)
        raise TimeoutError('gate never opened')

    return flag, wait


def test_a_slow_generation_does_not_delay_the_others():
    flag, wait = _gate()
    rollout = Replies()
    rollout.hold['x0'] = wait  # the straggler's first generation waits until the others are done
    sched = Steps()
    real_finished = sched.on_request_finished

    def finished(r, reason, turn):
        real_finished(r, reason, turn)
        if {'r1', 'r2', 'r3'} <= set(sched.finished):
            flag.set()

    sched.on_request_finished = finished
    result = Executor(sched, rollout, mode='async').run([req('x0'), req('r1'), req('r2'), req('r3')])
    assert result.ok and sched.finished[-1] == 'x0'
    events = [(e.uuid, e.dst) for e in result.trace.events]
    straggler_output = events.index(('x0', 'finished'))
    for uuid in ('r1', 'r2', 'r3'):
        assert events.index((uuid, 'finished')) < straggler_output
    # and the others went through all their turns (r3: 4 generations) while x0 was still generating
    assert sum(1 for u, d in events[:straggler_output] if u == 'r3' and d == 'generating') == 4


def test_a_slow_tool_step_does_not_delay_the_others():
    flag, wait = _gate()
    sched = Steps(step_hold={'r1': wait})
    sched.on_request_finished = lambda r, reason, turn: (sched.finished.append(r.uuid),
                                                          flag.set() if len(sched.finished) == 3 else None)
    result = Executor(sched, Replies(), mode='async').run([req('r1'), req('r2'), req('r3'), req('r0')])
    assert result.ok
    events = [(e.uuid, e.src, e.dst) for e in result.trace.events]
    r1_step_done = events.index(('r1', 'tool_step', 'generating'))
    assert all(events.index((u, 'generating', 'finished')) < r1_step_done for u in ('r0', 'r2', 'r3'))
    assert sched.finished[-1] == 'r1'


# ---- faults, deadlines, interrupts --------------------------------------------------------------------
def test_a_failing_call_or_step_fails_only_its_request():
    rollout = Replies()
    rollout.fail['r1'] = RuntimeError('engine lost r1')

    class Flaky(Steps):

        async def step(self, infer_request, response_choice, current_turn):
            if infer_request.uuid == 'r3' and current_turn == 2:
                raise ValueError('tool broke')
            return await super().step(infer_request, response_choice, current_turn)

    result = Executor(Flaky(), rollout, mode='async', on_error='return').run([req('r1'), req('r2'), req('r3')])
    assert result.finish_reasons == ['error', 'check_finished', 'error']
    assert [(f.uuid, f.phase, f.turn) for f in sorted(result.failures, key=lambda f: f.index)] == [
        ('r1', 'rollout_fn', 1), ('r3', 'step', 2)]
    assert result.outputs[2].rollout_infos['t1'] == 1, 'the failed request keeps what it had'
    with pytest.raises(mtflow.MultiTurnRolloutError) as info:
        Executor(Flaky(), rollout, mode='async').run([req('r1'), req('r2')])
    assert len(info.value.failures) == 1 and info.value.outputs[1] is not None


def test_deadlines_time_out_only_the_late_request():
    flag, wait = _gate()
    rollout = Replies()
    rollout.hold['r1'] = wait  # never opened: the call misses rollout_timeout_s
    sched = Steps(step_hold={'r2': wait})  # this step misses step_timeout_s
    result = Executor(sched, rollout, mode='async', on_error='return', rollout_timeout_s=0.3,
                      step_timeout_s=0.3).run([req('r1'), req('r2'), req('r0')])
    assert result.finish_reasons == ['timeout', 'timeout', 'check_finished']
    assert {(f.uuid, f.phase) for f in result.failures} == {('r1', 'rollout_fn'), ('r2', 'step')}
    flag.set()


def test_an_interrupt_keeps_every_finished_output():

    class Interrupting(Steps):

        async def step(self, infer_request, response_choice, current_turn):
            if infer_request.uuid == 'r3' and current_turn == 2:
                raise KeyboardInterrupt
            return await super().step(infer_request, response_choice, current_turn)

    with pytest.raises(RolloutInterrupted) as info:
        Executor(Interrupting(), Replies(), mode='async').run([req('r0'), req('r3'), req('r1')])
    result = info.value.result
    assert result.finish_reasons[0] == 'check_finished' and result.finish_reasons[1] == 'interrupted'
    assert result.outputs[0].messages[-1]['content'] == 'r0 says 1'
    assert result.outputs[1].rollout_infos['t1'] == 1


# ---- partial rollouts -----------------------------------------------------------------------------------
def test_a_partial_rollout_resumes_to_the_same_outputs():
    n = 16
    whole = Executor(LongTailScheduler(FAST), SimEngine(FAST, decode_s=0.0002)).run(FAST.requests(n))
    ex = Executor(LongTailScheduler(FAST), SimEngine(FAST, decode_s=0.0002), mode='async', max_concurrency=6)
    first = ex.run(FAST.requests(n), until=Until(finished=5))
    assert sum(o is not None for o in first.outputs) >= 5 and first.unfinished
    assert all(isinstance(u, UnfinishedRequest) for u in first.unfinished)
    states = {u.state for u in first.unfinished}
    assert states <= {'pending', 'generating', 'continuing'} and 'pending' in states
    assert any(u.record.ids for u in first.unfinished), 'some carry segments already'
    done = {u: o for u, o in zip([f'r{i:04d}' for i in range(n)], first.outputs) if o is not None}
    second = ex.run(first.unfinished, until={'finished': 4})
    done.update({u.uuid: o for u, o in zip(first.unfinished, second.outputs) if o is not None})
    third = ex.run(second.unfinished)
    assert not third.unfinished and third.ok
    done.update({u.uuid: o for u, o in zip(second.unfinished, third.outputs)})
    assert dump([done[f'r{i:04d}'] for i in range(n)]) == dump(whole.outputs)


def test_a_generation_cancelled_before_it_ran_still_reports():
    """Regression: r0's last reply and r1's step land in the same batch. r0 meets the budget
    (finished=1) and r1's next generation was issued in that batch; the stop cancels it before it
    ever ran. That task must still report (as parked), or the driver waits forever."""
    gates: Dict[asyncio.AbstractEventLoop, asyncio.Future] = {}  # keyed by the loop: ids of closed loops recur

    def gate() -> asyncio.Future:  # one future per run's loop, opened by one timer: both wake together
        loop = asyncio.get_running_loop()
        if loop not in gates:
            gates[loop] = loop.create_future()
            loop.call_later(0.05, gates[loop].set_result, None)
        return gates[loop]

    rollout = Replies()
    rollout.hold['r0'] = lambda: gate()
    # no step deadline: wait_for would put the step's end a loop iteration after r0's reply
    ex = Executor(Steps(step_hold={'r1': lambda: gate()}), rollout, mode='async', step_timeout_s=None)
    first = ex.run([req('r0'), req('r1')], until=Until(finished=1))
    assert first.finish_reasons == ['check_finished', None]
    [left] = first.unfinished
    assert (left.uuid, left.state, left.turn) == ('r1', 'generating', 2)
    assert first.rollout_fn_calls == 2, 'the cancelled generation made no call'
    rest = ex.run(first.unfinished)
    assert rest.ok and rest.finish_reasons == ['check_finished']
    lock = Executor(Steps(), Replies()).run([req('r1')])
    assert dump(rest.outputs) == dump(lock.outputs)


def test_a_time_budget_parks_the_slow_request_and_it_resumes():
    flag, wait = _gate()
    rollout = Replies()
    rollout.hold['r3'] = lambda: wait() if not flag.is_set() else asyncio.sleep(0)
    ex = Executor(Steps(), rollout, mode='async')
    first = ex.run([req('r0'), req('r3'), req('r1')], until=Until(seconds=1.0))
    assert first.finish_reasons == ['check_finished', None, 'check_finished'] and first.outputs[1] is None
    [left] = first.unfinished
    assert (left.uuid, left.state, left.turn) == ('r3', 'generating', 1)
    flag.set()
    fresh = req('r2')
    resumed = ex.run([fresh, left])  # with a new request beside it
    assert resumed.ok and resumed.finish_reasons == ['check_finished', 'check_finished']
    lock = Executor(Steps(), Replies()).run([req('r3')])
    assert dump([resumed.outputs[1]]) == dump(lock.outputs)


def test_bad_options():
    with pytest.raises(ValueError, match="mode must be"):
        Executor(Steps(), Replies(), mode='fast')
    with pytest.raises(ValueError, match='max_concurrency'):
        Executor(Steps(), Replies(), mode='async', max_concurrency=0)
    with pytest.raises(ValueError, match="mode='async' only"):
        Executor(Steps(), Replies(), max_concurrency=4)
    with pytest.raises(ValueError, match="need Executor\\(mode='async'\\)"):
        Executor(Steps(), Replies()).run([req('r0')], until=Until(finished=1))
    with pytest.raises(ValueError, match='finished'):
        Until()
    with pytest.raises(ValueError, match='unknown key'):
        Executor(Steps(), Replies(), mode='async').run([req('r0')], until={'requests': 3})


def test_the_async_driver_is_core_and_imports_no_outer_layer():
    import ast
    from pathlib import Path

    from tests.executor.test_one_source import OUTER

    tree = ast.parse((Path(mtflow.__file__).parent / 'engine' / 'async_driver.py').read_text())
    names = {n.module or '' for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in names if m.split('.')[0] in OUTER or m.startswith('mtflow.') and m.split('.')[1] in OUTER}
