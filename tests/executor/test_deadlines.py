"""Every step has a deadline: a hanging step (async or sync), hook or ``rollout_fn`` call
finishes only its own requests with reason ``timeout``; the others are exactly what a
fault-free run gives, every rank stays in step, and the process can still exit."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import mtflow
from mtflow import Scheduler
from tests.helpers import Counter, dump, out, req
from tests.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 1.0
# The issue asks for "the deadline plus a second"; CI is a loaded 2-core machine, so the bound
# asserted is looser. What matters: the run does not wait for the hang (an hour).
SLACK = 8.0
HANG = 3600


class Tools(Scheduler):
    """A step per turn; request ``hang_uuid`` hangs at turn ``hang_turn`` (async or sync)."""

    def __init__(self, hang_uuid=None, hang_turn=2, is_async=False, **kw):
        super().__init__(**kw)
        self.hang_uuid, self.hang_turn = hang_uuid, hang_turn
        self.release = threading.Event()
        self.finished = []

    def _hangs(self, request, turn):
        return request.uuid == self.hang_uuid and turn == self.hang_turn

    def _result(self, request, turn):
        request.messages.append({'role': 'user', 'content': f'obs {turn}'})
        return {'infer_request': request, 'response_token_ids': [turn], 'response_loss_mask': [1],
                'rollout_infos': {'steps': turn}}

    def on_request_finished(self, infer_request, reason, turn):
        self.finished.append((infer_request.uuid, reason, turn))


class SyncTools(Tools):

    def step(self, infer_request, response_choice, current_turn):
        if self._hangs(infer_request, current_turn):
            self.release.wait(HANG)  # a tool that never returns
            infer_request.messages.append({'role': 'user', 'content': 'LATE WRITE'})
        return self._result(infer_request, current_turn)


class AsyncTools(Tools):

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.cancelled = []

    async def step(self, infer_request, response_choice, current_turn):
        if self._hangs(infer_request, current_turn):
            try:
                await asyncio.sleep(HANG)
            except asyncio.CancelledError:
                self.cancelled.append(infer_request.uuid)
                raise
        await asyncio.sleep(0)  # really suspend, so the loop runs these
        return self._result(infer_request, current_turn)


def rollout():
    return Counter(lambda r, n: out(f'{r.uuid}:{n}', [10 + n], [-.5]))


def batch(n=4):
    return [req(f'r{i}') for i in range(n)]


@pytest.mark.parametrize('cls', [AsyncTools, SyncTools])
def test_a_hanging_step_times_out_that_request_only(cls, mtflow_trace):
    clean = mtflow.Executor(cls(max_turns=4), rollout()).run(batch())
    sched = cls('r1', max_turns=4)
    t = time.monotonic()
    result = mtflow.Executor(sched, rollout(), step_timeout_s=DEADLINE, on_error='return').run(batch())
    elapsed = time.monotonic() - t
    sched.release.set()
    assert DEADLINE <= elapsed < DEADLINE + SLACK
    assert result.finish_reasons == ['max_turns', 'timeout', 'max_turns', 'max_turns']
    assert dump([result.outputs[i] for i in (0, 2, 3)]) == dump([clean.outputs[i] for i in (0, 2, 3)])
    [failure] = result.failures
    assert (failure.uuid, failure.turn, failure.phase) == ('r1', 2, 'step')
    assert isinstance(failure.error, mtflow.StepTimeout) and 'within 1 s' in str(failure.error)
    # the timed-out request keeps what it had before the step; nothing written later reaches it
    partial = result.outputs[1]
    assert partial.rollout_infos['num_turns'] == 2 and partial.rollout_infos['mtflow_error']['phase'] == 'step'
    assert partial.messages[-1] == {'role': 'assistant', 'content': 'r1:2'}
    assert ('r1', 'timeout', 2) in sched.finished
    assert result.trace.path('r1') == 'pending -> generating -> tool_step -> generating -> tool_step -> finished(timeout)'
    if cls is AsyncTools:
        assert sched.cancelled == ['r1']
    else:
        time.sleep(0.2)  # the abandoned thread finished its late write: the output did not change
        assert partial.messages[-1] == {'role': 'assistant', 'content': 'r1:2'}


def test_a_hanging_async_on_turn_end_times_out():

    class SlowHook(AsyncTools):

        async def on_turn_end(self, infer_request, response_choice, current_turn):
            if infer_request.uuid == 'r0' and current_turn == 1:
                await asyncio.Event().wait()
            return {'rollout_infos': {'seen': current_turn}}

    result = mtflow.Executor(SlowHook(max_turns=2), rollout(), step_timeout_s=DEADLINE, on_error='return').run(
        batch(2))
    assert result.finish_reasons == ['timeout', 'max_turns']
    assert result.failures[0].phase == 'on_turn_end'


def test_a_rollout_fn_call_past_its_deadline_fails_the_requests_it_served():
    inner = rollout()
    gate = threading.Event()

    def slow(requests, config):
        if len(inner.calls) == 1:  # the second call (turn 2) hangs
            gate.wait(HANG)
        return inner(requests, config)

    t = time.monotonic()
    result = mtflow.Executor(SyncTools(max_turns=3), slow, rollout_timeout_s=DEADLINE, on_error='return').run(
        batch(3))
    gate.set()
    assert time.monotonic() - t < DEADLINE + SLACK
    assert result.finish_reasons == ['timeout'] * 3
    assert {f.phase for f in result.failures} == {'rollout_fn'}
    assert all(o.rollout_infos['num_turns'] == 2 for o in result.outputs)  # as for any rollout_fn failure


def test_ranks_stay_in_step_when_one_ranks_step_hangs():
    shards = [['a0', 'a1'], ['b0', 'b1', 'b2']]
    rollouts = [rollout(), rollout()]
    scheds = [SyncTools('a1', max_turns=3), SyncTools(max_turns=3)]

    def rank_main(rank, gather_fn):
        return mtflow.Executor(scheds[rank], rollouts[rank], gather_fn=gather_fn, rank=rank,
                               step_timeout_s=DEADLINE, on_error='return').run([req(u) for u in shards[rank]])

    results = run_ranks(2, rank_main)
    scheds[0].release.set()
    assert results[0].finish_reasons == ['max_turns', 'timeout']
    assert results[1].finish_reasons == ['max_turns'] * 3
    assert len(rollouts[0].calls) == len(rollouts[1].calls)


SCRIPT = '''
import sys, threading, time
sys.path.insert(0, {root!r})
import mtflow
from tests.helpers import Counter, out, req

class Hangs(mtflow.Scheduler):
    def step(self, infer_request, response_choice, current_turn):
        if infer_request.uuid == 'r0':
            threading.Event().wait()  # never returns
        infer_request.messages.append({{'role': 'user', 'content': 'ok'}})
        return {{'infer_request': infer_request}}

result = mtflow.Executor(Hangs(max_turns=2), Counter(lambda r, n: out('x', [1])), step_timeout_s=1.0,
                         on_error='return').run([req('r0'), req('r1')])
print(result.finish_reasons, flush=True)
'''


def test_a_process_whose_sync_step_hangs_still_exits():
    code = textwrap.dedent(SCRIPT.format(root=str(ROOT)))
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['timeout', 'max_turns']"


def test_no_deadline_runs_sync_steps_in_the_drivers_thread():
    seen = []

    class Where(SyncTools):

        def step(self, infer_request, response_choice, current_turn):
            seen.append(threading.current_thread() is threading.main_thread())
            return super().step(infer_request, response_choice, current_turn)

    mtflow.Executor(Where(max_turns=2), rollout(), step_timeout_s=None).run(batch(2))
    assert seen == [True, True]
    seen.clear()
    mtflow.Executor(Where(max_turns=2), rollout()).run(batch(2))
    assert seen == [False, False]  # under a deadline: a worker thread
