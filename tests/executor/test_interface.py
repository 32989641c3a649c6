"""The cross-issue interface of executor v2 (``/work/wt/INTERFACES.md``): ``on_finished`` with
``FinishedRequest``, the ``finalize_output`` hook, ``RolloutInterrupted``, the new finish reasons
and the deadline keywords."""
from __future__ import annotations

import pytest

import mtflow
from mtflow import FinishedRequest, RolloutInterrupted, Scheduler
from mtflow.core import machine as M
from tests.helpers import Counter, dump, out, req


class Stops(Scheduler):
    """Request ``rK`` stops by its hook at turn K+1; the rest go on to ``max_turns``."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.finished = []

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': f'obs {current_turn}'})
        return {'infer_request': infer_request, 'rollout_infos': {'last_step': current_turn}}

    def on_turn_end(self, infer_request, response_choice, current_turn):
        k = int(infer_request.uuid[1:])
        return {'done': True} if current_turn == k + 1 else {}

    def on_request_finished(self, infer_request, reason, turn):
        self.finished.append((infer_request.uuid, reason, turn))


def rollout():
    return Counter(lambda r, n: out(f'{r.uuid}:{n}', [n, n], [-.5, -.5]))


def batch(n=4):
    return [req(f'r{i}') for i in range(n)]


def test_on_finished_gets_every_request_once_with_its_own_events():
    got = []
    result = mtflow.Executor(Stops(max_turns=3), rollout(), on_finished=got.append).run(batch())
    assert [f.uuid for f in got] == ['r0', 'r1', 'r2', 'r3']  # in the order they finished
    assert all(isinstance(f, FinishedRequest) for f in got)
    assert [f.finish_reason for f in got] == ['done_by_hook', 'done_by_hook', 'done_by_hook', 'max_turns']
    for f in got:
        assert f.output is result.outputs[f.index]
        assert f.failure is None
        assert f.events == result.trace.for_request(f.uuid)
        assert f.events[-1].dst == M.FINISHED and f.events[-1].reason == f.finish_reason


def test_on_finished_without_trace_has_no_events_and_reports_failures():

    class Fails(Stops):

        def step(self, infer_request, response_choice, current_turn):
            if infer_request.uuid == 'r2':
                raise ValueError('boom')
            return super().step(infer_request, response_choice, current_turn)

    got = []
    result = mtflow.Executor(Fails(max_turns=3), rollout(), on_finished=got.append, trace=False,
                             on_error='return').run(batch())
    by_uuid = {f.uuid: f for f in got}
    assert len(got) == 4 and all(f.events == [] for f in got)
    assert by_uuid['r2'].finish_reason == 'error' and by_uuid['r2'].failure.phase == 'step'
    assert by_uuid['r2'].failure is result.failures[0]


def test_an_on_finished_that_raises_is_recorded_as_that_requests_failure():

    def on_finished(f):
        if f.uuid == 'r1':
            raise RuntimeError('writer broke')

    with pytest.raises(mtflow.MultiTurnRolloutError) as info:
        mtflow.Executor(Stops(max_turns=3), rollout(), on_finished=on_finished).run(batch())
    [failure] = info.value.failures
    assert (failure.uuid, failure.phase, str(failure.error)) == ('r1', 'on_finished', 'writer broke')
    assert len(info.value.outputs) == 4 and all(o is not None for o in info.value.outputs)


class Policy(Stops):
    """``finalize_output``: tags every output with its reason; r3's policy fails."""

    def __init__(self, fail_for=None, is_async=False, **kw):
        super().__init__(**kw)
        self.fail_for = fail_for
        self.calls = []

    def finalize_output(self, output, finish_reason, turn):
        uuid = output.messages[0]['content'].split()[-1]
        self.calls.append((uuid, finish_reason, turn))
        if uuid == self.fail_for:
            raise KeyError('policy')
        if uuid == 'r0':
            return None  # keep
        output.rollout_infos['policy_reason'] = finish_reason
        return output


def test_finalize_output_may_replace_keep_or_fail_one_request():
    sched = Policy(fail_for='r3', max_turns=3)
    result = mtflow.Executor(sched, rollout(), on_error='return').run(batch())
    assert 'policy_reason' not in result.outputs[0].rollout_infos
    assert result.outputs[1].rollout_infos['policy_reason'] == 'done_by_hook'
    assert result.finish_reasons == ['done_by_hook', 'done_by_hook', 'done_by_hook', 'error']
    [failure] = result.failures
    assert (failure.uuid, failure.phase) == ('r3', 'finalize_output')
    # called once per request before on_request_finished, again only for r3's error output
    assert [c[0] for c in sched.calls] == ['r0', 'r1', 'r2', 'r3', 'r3']
    assert sched.calls[-1][1] == 'error'
    assert [f[:2] for f in sched.finished] == [('r0', 'done_by_hook'), ('r1', 'done_by_hook'),
                                               ('r2', 'done_by_hook'), ('r3', 'error')]
    assert result.outputs[3].rollout_infos['mtflow_error']['phase'] == 'finalize_output'


def test_async_finalize_output_is_awaited():

    class AsyncPolicy(Stops):

        async def finalize_output(self, output, finish_reason, turn):
            output.rollout_infos['tag'] = f'{finish_reason}@{turn}'

    result = mtflow.Executor(AsyncPolicy(max_turns=3), rollout()).run(batch(2))
    assert [o.rollout_infos['tag'] for o in result.outputs] == ['done_by_hook@1', 'done_by_hook@2']


def test_keyboard_interrupt_from_rollout_fn_keeps_every_finished_output():
    clean = mtflow.Executor(Stops(max_turns=4), rollout()).run(batch())
    inner = rollout()

    def interrupting(requests, config):
        if len(inner.calls) == 2:  # the third call: turn 3's outputs (r0 and r1 have finished)
            raise KeyboardInterrupt
        return inner(requests, config)

    sched = Stops(max_turns=4)
    got = []
    with pytest.raises(RolloutInterrupted) as info:
        mtflow.Executor(sched, interrupting, on_finished=got.append).run(batch())
    assert isinstance(info.value, KeyboardInterrupt)
    result = info.value.result
    assert result.finish_reasons == ['done_by_hook', 'done_by_hook', 'interrupted', 'interrupted']
    assert dump(result.outputs[:2]) == dump(clean.outputs[:2])
    partial = result.outputs[2]
    assert partial.messages[-1] == {'role': 'user', 'content': 'obs 2'}
    assert partial.rollout_infos == {'last_step': 2, 'num_turns': 2}
    assert [f.uuid for f in got] == ['r0', 'r1', 'r2', 'r3']
    assert sorted(sched.finished)[2:] == [('r2', 'interrupted', 2), ('r3', 'interrupted', 2)]
    assert result.trace.path('r3').endswith('tool_step -> generating -> finished(interrupted)')


def test_new_finish_reasons_and_deadline_keywords():
    assert {'timeout', 'interrupted'} <= set(M.FINISH_REASONS)
    assert M.reason_kind('timeout') == 'error' and M.reason_kind('stop_rule:x') == 'ok'
    assert M.reason_kind('max_turns') == 'limit' and M.reason_kind(None) == 'none'
    ex = mtflow.Executor(Stops(), rollout(), step_timeout_s=1.5, rollout_timeout_s=None)
    assert (ex.options.step_timeout_s, ex.options.rollout_timeout_s) == (1.5, None)
    assert mtflow.Executor(Stops(), rollout()).options.step_timeout_s == 600.0
    for bad in (0, -1, 'soon', True):
        with pytest.raises(ValueError, match='step_timeout_s'):
            mtflow.Executor(Stops(), rollout(), step_timeout_s=bad)
    with pytest.raises(TypeError):
        mtflow.Executor(Stops(), rollout(), None, 3)  # keyword-only after request_config
    assert mtflow.Executor(Stops(max_turns=2), rollout()).run(batch(1)).unfinished == []
