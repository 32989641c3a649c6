"""Interrupts lose nothing: a KeyboardInterrupt from ``rollout_fn``, a sync step or an async
step raises ``RolloutInterrupted`` whose ``.result`` holds every finished output unchanged and
the others partial (reason ``interrupted``), with no asyncio noise."""
from __future__ import annotations

import asyncio
import gc
import logging
import warnings

import pytest

import mtflow
from mtflow import RolloutInterrupted, Scheduler
from tests.helpers import Counter, dump, out, req


class Stops(Scheduler):
    """``rK`` stops by its hook at turn K+1; ``interrupt_at`` = (uuid, turn) raises Ctrl-C in its step."""

    def __init__(self, interrupt_at=None, **kw):
        super().__init__(**kw)
        self.interrupt_at = interrupt_at
        self.finished = []
        self.ended = []

    def on_turn_end(self, infer_request, response_choice, current_turn):
        return {'done': True} if current_turn == int(infer_request.uuid[1:]) + 1 else {}

    def _step(self, infer_request, turn):
        if (infer_request.uuid, turn) == self.interrupt_at:
            raise KeyboardInterrupt
        infer_request.messages.append({'role': 'user', 'content': f'obs {turn}'})
        return {'infer_request': infer_request, 'response_token_ids': [turn], 'response_loss_mask': [1]}

    def step(self, infer_request, response_choice, current_turn):
        return self._step(infer_request, current_turn)

    def on_request_finished(self, infer_request, reason, turn):
        self.finished.append((infer_request.uuid, reason, turn))

    def on_trajectory_end(self, requests, error):
        self.ended.append((len(requests), type(error).__name__))


class AsyncStops(Stops):

    async def step(self, infer_request, response_choice, current_turn):
        await asyncio.sleep(0)
        if infer_request.uuid == 'r3':
            # another request's step is suspended on the loop when the interrupt arrives
            await asyncio.sleep(0.05)
        return self._step(infer_request, current_turn)


def rollout():
    return Counter(lambda r, n: out(f'{r.uuid}:{n}', [10 + n], [-.5]))


def batch():
    return [req(f'r{i}') for i in range(4)]


def check(result, sched, clean):
    assert result.finish_reasons[:2] == ['done_by_hook', 'done_by_hook']
    assert result.finish_reasons[2:] == ['interrupted', 'interrupted']
    assert dump(result.outputs[:2]) == dump(clean.outputs[:2])  # finished outputs unchanged
    for o in result.outputs[2:]:  # partial outputs: what they had
        assert o is not None and o.messages[-1]['role'] in ('user', 'assistant')
    assert sorted(u for u, reason, _ in sched.finished) == ['r0', 'r1', 'r2', 'r3']
    assert sched.ended == [(4, 'RolloutInterrupted')]
    assert result.trace.finish_reasons() == {'done_by_hook': 2, 'interrupted': 2}


@pytest.mark.parametrize('cls, step_timeout_s', [(Stops, 600.0), (Stops, None), (AsyncStops, 600.0)])
def test_keyboard_interrupt_from_a_step(cls, step_timeout_s, caplog):
    clean = mtflow.Executor(cls(max_turns=4), rollout()).run(batch())
    sched = cls(interrupt_at=('r2', 2), max_turns=4)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, 'asyncio'):
        warnings.simplefilter('always')
        with pytest.raises(RolloutInterrupted) as info:
            mtflow.Executor(sched, rollout(), step_timeout_s=step_timeout_s).run(batch())
        gc.collect()
    result = info.value.result
    check(result, sched, clean)
    assert isinstance(info.value.cause, KeyboardInterrupt)
    assert result.outputs[2].rollout_infos['num_turns'] == 2  # its turn-2 output was applied
    assert not [w for w in caught if 'never awaited' in str(w.message)]
    assert not [r for r in caplog.records if 'destroyed' in r.getMessage() or 'never' in r.getMessage()]


def test_keyboard_interrupt_from_rollout_fn_with_a_deadline():
    clean = mtflow.Executor(Stops(max_turns=4), rollout()).run(batch())
    inner = rollout()

    def interrupting(requests, config):
        if len(inner.calls) == 2:
            raise KeyboardInterrupt
        return inner(requests, config)

    sched = Stops(max_turns=4)
    with pytest.raises(RolloutInterrupted) as info:  # rollout_fn runs in a worker thread here
        mtflow.Executor(sched, interrupting, rollout_timeout_s=60).run(batch())
    check(info.value.result, sched, clean)


def test_system_exit_keeps_propagating_with_the_result():
    inner = rollout()

    def exiting(requests, config):
        if len(inner.calls) == 2:
            raise SystemExit(3)
        return inner(requests, config)

    got = []
    with pytest.raises(SystemExit) as info:
        mtflow.Executor(Stops(max_turns=4), exiting, on_finished=got.append).run(batch())
    assert info.value.code == 3
    assert info.value.result.finish_reasons == ['done_by_hook', 'done_by_hook', 'interrupted', 'interrupted']
    assert len(got) == 4
