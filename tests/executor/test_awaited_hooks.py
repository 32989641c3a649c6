"""An awaitable that a sync-looking hook returns (``on_request_finished``, ``finalize_output``,
an async ``rollout_fn``'s result) goes through the coroutine fast path (``Caller.awaited``): one
that has nothing to await costs a ``send``, no loop run; one that suspends runs on the loop under
``step_timeout_s``; its exception or timeout is recorded as before."""
from __future__ import annotations

import asyncio

import pytest

import mtflow
from mtflow import Scheduler
from mtflow.core.calls import Caller
from tests.helpers import Counter, out, req


class Finishing(Scheduler):
    """Two turns; ``on_request_finished`` is async and does what ``how`` says."""

    def __init__(self, how: str, **kw):
        super().__init__(max_turns=2, **kw)
        self.how = how
        self.finished = []

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': f'obs {current_turn}'})
        return {'infer_request': infer_request, 'response_token_ids': [current_turn], 'response_loss_mask': [1]}

    async def on_request_finished(self, infer_request, reason, turn):
        if self.how == 'suspends':
            await asyncio.sleep(0)
        elif self.how == 'hangs':
            await asyncio.sleep(3600)
        elif self.how == 'raises':
            raise ValueError(f'cannot close {infer_request.uuid}')
        self.finished.append((infer_request.uuid, reason, turn))


def rollout():
    return Counter(lambda r, n: out(f'{r.uuid}:{n}', [n], [-.5]))


def run(how, **kw):
    sched = Finishing(how)
    result = mtflow.Executor(sched, rollout(), on_error='return', **kw).run([req('a'), req('b')])
    return sched, result


def test_a_hook_with_nothing_to_await_runs_no_loop(monkeypatch):
    def no_loop(*a, **k):
        raise AssertionError('the event loop ran for a coroutine that never suspended')

    monkeypatch.setattr(Caller, 'run_awaitables', no_loop)
    sched, result = run('returns')
    assert sched.finished == [('a', 'max_turns', 2), ('b', 'max_turns', 2)]
    assert result.failures == []


def test_a_hook_that_suspends_is_resumed_on_the_loop():
    sched, result = run('suspends')
    assert sched.finished == [('a', 'max_turns', 2), ('b', 'max_turns', 2)]
    assert result.failures == []


@pytest.mark.parametrize('how, kind', [('hangs', mtflow.StepTimeout), ('raises', ValueError)])
def test_a_hook_that_hangs_or_raises_is_recorded_and_the_outputs_kept(how, kind):
    sched, result = run(how, step_timeout_s=0.2)
    assert [(f.uuid, f.phase, type(f.error)) for f in result.failures] == [('a', 'on_request_finished', kind),
                                                                          ('b', 'on_request_finished', kind)]
    assert result.finish_reasons == ['max_turns', 'max_turns']
    assert [o.response.choices[0].message.content for o in result.outputs] == ['a:2', 'b:2']
