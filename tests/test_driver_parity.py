"""Driver parity: lockstep, async (several ``max_concurrency``) and a stream at ``max_staleness=0``
give identical trajectories for the same deterministic inputs.

Each scenario is generated (hypothesis): per request and turn, the model's ids and logprobs, its
finish reason, a backend fault for that request only, and what the step does (an observation, a
tool message, an image, a continuation of the assistant message, raising, or missing its
deadline); hooks that stop early, per-turn rewards, and a context budget that compacts. Every
driver must give the same messages, token ids, loss masks, logprobs, finish reasons, failures,
infos (rewards and per-turn rewards included), final requests and per-request trace.

Differences that are intended, and so not compared:

- **order**: a stream hands out groups as they finish; outputs are compared per uuid;
- **policy versions**: a stream stamps every turn with its policy version
  (``rollout_infos['policy_versions']``, all 0 here) even when none was set; the runs do not;
- **times**: the trace's durations and timestamps;
- **partial results**: a budget (``until=``) stops each driver where its own schedule has got to
  (lockstep has none), so which requests come back unfinished is not compared; resuming them is
  checked against an uninterrupted run in ``tests/test_async_mode.py``.

700 scenarios in all (600 + 40 with deadlines + 60 with a context budget), fixed by
``derandomize`` so that a failure reproduces.
"""
from __future__ import annotations

import asyncio
import base64
import io
from typing import Any, Dict, List, Optional, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtflow import ContextBudget, Executor, RequestConfig, Scheduler
from tests.helpers import dump, out, req

STEP_KINDS = ('observe', 'tool', 'image', 'continue', 'raise')


def _png() -> str:
    from PIL import Image
    buf = io.BytesIO()
    Image.new('RGB', (2, 2), 'red').save(buf, format='PNG')
    return 'data:image/png;base64,' + base64.b64encode(buf.getvalue()).decode()


PNG = _png()


@st.composite
def turn_st(draw, step_kinds: Tuple[str, ...]) -> Dict[str, Any]:
    ids = draw(st.lists(st.integers(1, 60), min_size=1, max_size=3))
    return {
        'ids': ids,
        'logprobs': [-0.125 * (i + 1) for i in range(len(ids))],
        'finish_reason': draw(st.sampled_from(['stop'] * 7 + ['length'])),
        'fault': draw(st.integers(0, 15)) == 0,  # the backend fails this request's turn only
        'step': draw(st.sampled_from(step_kinds)),
        'done': draw(st.sampled_from([None] * 7 + [True])),  # on_turn_end stops early
        'reward': draw(st.sampled_from([None, 0.0, 0.5, 1.0])),
    }


def scenario_st(step_kinds: Tuple[str, ...] = STEP_KINDS, max_requests: int = 5):
    plan = st.lists(turn_st(step_kinds), min_size=1, max_size=5)
    return st.lists(plan, min_size=1, max_size=max_requests)


class PlannedScheduler(Scheduler):
    """Steps, stops and rewards as each request's plan says."""

    def __init__(self, plans: Dict[str, List[dict]], max_turns: Optional[int]) -> None:
        super().__init__(max_turns=max_turns)
        self.plans = plans

    def _turn(self, request: Any, turn: int) -> Optional[dict]:
        plan = self.plans[request.uuid]
        return plan[turn - 1] if turn <= len(plan) else None

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        t = self._turn(infer_request, current_turn)
        result: Dict[str, Any] = {'rollout_infos': {f'seen_{current_turn}': len(infer_request.messages)}}
        if t is None or t['done'] or current_turn >= len(self.plans[infer_request.uuid]):
            result['done'] = True
        return result

    def turn_reward(self, infer_request, response_choice, current_turn):
        t = self._turn(infer_request, current_turn)
        return None if t is None else t['reward']

    async def step(self, infer_request, response_choice, current_turn):
        t = self._turn(infer_request, current_turn)
        kind = t['step']
        if kind == 'raise':
            raise RuntimeError(f'step failed for {infer_request.uuid} at turn {current_turn}')
        if kind == 'timeout':
            await asyncio.sleep(30)  # past the step deadline: cancelled
        if kind == 'continue':
            infer_request.messages[-1]['content'] += ' [go on]'
        elif kind == 'tool':
            await asyncio.sleep(0)  # really suspends: the step runs as a task
            infer_request.messages.append({'role': 'tool', 'content': f'tool {current_turn}'})
        elif kind == 'image':
            infer_request.messages.append({'role': 'user', 'content': f'<image> look {current_turn}'})
            infer_request.images.append(PNG)
        else:
            infer_request.messages.append({'role': 'user', 'content': f'obs {current_turn} with some words'})
        return {'infer_request': infer_request, 'rollout_infos': {f'step_{current_turn}': kind}}


def planned_rollout(plans: Dict[str, List[dict]]):
    """A deterministic backend: each request's turn is answered from its plan (an exception in
    the output's place fails that request only), whatever the batch it arrives in."""
    seen: Dict[str, int] = {}

    def rollout(requests, request_config=None):
        outputs: List[Any] = []
        for r in requests:
            turn = seen[r.uuid] = seen.get(r.uuid, 0) + 1
            plan = plans[r.uuid]
            t = plan[min(turn, len(plan)) - 1]
            if t['fault']:
                outputs.append(RuntimeError(f'backend cannot serve {r.uuid} turn {turn}'))
                continue
            outputs.append(out(f'{r.uuid}/{turn}', t['ids'], t['logprobs'], t['finish_reason']))
        return outputs

    return rollout


def _event_view(events: List[Any]) -> List[tuple]:
    return [(e.turn, e.src, e.dst, e.trigger, e.reason, e.tokens) for e in events]


def _failure_view(failures: List[Any]) -> Dict[str, dict]:
    return {f.uuid: f.to_dict() for f in failures}


def _without_versions(outputs: List[Any]) -> List[Any]:
    dumped = dump(outputs)
    for d in dumped:
        if d is not None:
            d['rollout_infos'].pop('policy_versions', None)
    return dumped


def run_driver(driver: str, plans: List[List[dict]], options: Dict[str, Any]) -> Dict[str, tuple]:
    """Per uuid: (output, finish reason, failure, final request, trace) under one driver."""
    by_uuid = {f'r{i}': plan for i, plan in enumerate(plans)}
    requests = [req(u) for u in by_uuid]
    scheduler = PlannedScheduler(by_uuid, options.get('max_turns'))
    kwargs = dict(options, on_error='return')
    config = kwargs.pop('request_config', None)
    if driver == 'stream':
        ex = Executor(scheduler, planned_rollout(by_uuid), config, mode='async', **kwargs)
        groups = list(ex.stream(requests, max_staleness=0, max_concurrency=3))
        assert len(groups) == len(requests)
        got = {}
        for g in groups:
            [uuid] = g.uuids
            failure = _failure_view(g.failures).get(uuid)
            got[uuid] = (_without_versions(g.outputs)[0], g.finish_reasons[0], failure, dump([g.requests[0]])[0],
                         _event_view(g.events[0]))
        return got
    mode, _, concurrency = driver.partition('@')
    if mode == 'async':
        kwargs.update(mode='async', max_concurrency=int(concurrency))
    result = Executor(scheduler, planned_rollout(by_uuid), config, **kwargs).run(requests)
    failures = _failure_view(result.failures)
    outputs = _without_versions(result.outputs)
    return {u: (outputs[i], result.finish_reasons[i], failures.get(u), dump([requests[i]])[0],
                _event_view(result.trace.for_request(u)))
            for i, u in enumerate(by_uuid)}


DRIVERS = ('lockstep', 'async@1', 'async@3', 'async@8', 'stream')


def assert_parity(plans: List[List[dict]], options: Dict[str, Any]) -> None:
    reference = run_driver('lockstep', plans, options)
    for driver in DRIVERS[1:]:
        got = run_driver(driver, plans, options)
        assert got.keys() == reference.keys()
        for uuid, expected in reference.items():
            assert got[uuid] == expected, f'{driver} differs from lockstep for {uuid}'


MAIN = settings(max_examples=600, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.filterwarnings('ignore::UserWarning')
@MAIN
@given(plans=scenario_st(), max_turns=st.sampled_from([None, 2, 3]))
def test_drivers_agree_on_generated_scenarios(plans, max_turns):
    """Tool steps, step failures, backend faults, continuations, images, early stops, per-turn
    rewards, the turn bound."""
    assert_parity(plans, {'max_turns': max_turns})


TIMEOUTS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.filterwarnings('ignore::UserWarning')
@TIMEOUTS
@given(plans=scenario_st(STEP_KINDS + ('timeout', ), max_requests=3))
def test_drivers_agree_when_steps_miss_their_deadline(plans):
    """A step past ``step_timeout_s`` times out its request the same way in every driver (the
    deadline is wall time: these scenarios are fewer, and the other steps take no time)."""
    assert_parity(plans, {'max_turns': 4, 'step_timeout_s': 0.5})


def _words(request: Any) -> int:
    return sum(len(str(m.get('content') or '').split()) for m in request.messages)


COMPACTION = settings(max_examples=60, deadline=None, derandomize=True,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.filterwarnings('ignore::UserWarning')
@COMPACTION
@given(plans=scenario_st(('observe', 'tool', 'continue'), max_requests=3), limit=st.integers(10, 20),
       policy=st.sampled_from(['drop_observations', 'stop']))
def test_drivers_agree_when_the_context_budget_compacts(plans, limit, policy):
    """A context budget over a word count: a prompt over it is compacted (observations dropped:
    the ``compacting`` state) or finishes ``context_full``."""
    budget = ContextBudget(context_length=limit, count_tokens=_words, policy=policy, keep_last_turns=1,
                           placeholder='-')
    assert_parity(plans, {'max_turns': 4, 'context': budget, 'request_config': RequestConfig(max_tokens=2)})
