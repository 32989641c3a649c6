"""Async mode on the ms-swift differential scenarios: ms-swift 4.6's own schedulers (MathTips with
its id-backed continuations, GYM with its math environment) and a ReAct tool scheduler give the
same outputs, field for field, and send each request the same messages, in lockstep (which
matches ms-swift's driver, ``test_differential.py``) and in async mode (single rank)."""
from __future__ import annotations

import copy
from typing import Any, Dict, List

import pytest
from swift.rollout.multi_turn import GYMScheduler, MathTipsScheduler

import mtflow
from mtflow.engine.executor import Executor
from tests.swift.swift_helpers import ScriptedSwift, dump
from tests.swift.test_differential import (GYM_SCRIPT, MATH_SCRIPT, REACT_SCRIPT, TOK, ReActCalculator, gym_requests,
                                           math_requests, offline_gym, react_requests, start_gym)

__all__ = ['offline_gym']  # the fixture, imported for these tests


def per_request(rollout: ScriptedSwift) -> Dict[str, List[Any]]:
    """Each request's sent messages, call by call (async mode sends one request per call)."""
    sent: Dict[str, List[Any]] = {}
    for call, messages in zip(rollout.calls, rollout.sent):
        for uuid, m in zip(call, messages):
            sent.setdefault(uuid, []).append(m)
    return sent


def run_modes(make_scheduler, make_requests, script, max_turns=None, prepare=None) -> Dict[str, Any]:
    results = {}
    for mode in ('lockstep', 'async'):
        scheduler, requests = make_scheduler(), make_requests()
        if prepare is not None:
            prepare(scheduler, requests)
        rollout = ScriptedSwift(copy.deepcopy(script), tokenizer=TOK)
        first = rollout.first(requests)
        if mode == 'lockstep':
            outputs = mtflow.run_multi_turn(requests, first, scheduler, rollout, None, max_turns)
        else:
            ex = Executor(scheduler, rollout, None, max_turns=max_turns, scheduler_bounds_run=False, mode='async')
            outputs = ex.run(requests, first).outputs
            assert all(len(c) == 1 for c in rollout.calls), 'one request per rollout_fn call'
        results[mode] = {'outputs': dump(outputs), 'requests': dump(requests), 'sent': per_request(rollout),
                         'types': {type(o).__module__ for o in outputs}}
    assert results['async'] == results['lockstep']
    assert results['async']['types'] == {'swift.infer_engine.protocol'}, 'ms-swift outputs in both modes'
    return results


@pytest.mark.parametrize('max_turns', [None, 1, 3])
def test_math_tips_scheduler(max_turns: Any) -> None:
    run_modes(lambda: MathTipsScheduler(tokenizer=TOK, max_turns=max_turns), math_requests, MATH_SCRIPT, max_turns)


@pytest.mark.parametrize('max_turns', [None, 2, 4])
def test_react_tool_scheduler(max_turns: Any) -> None:
    script = dict(REACT_SCRIPT)
    if max_turns is None:
        script['a3'] = script['a3'][:4] + ['Final Answer: done']
    res = run_modes(lambda: ReActCalculator(tokenizer=TOK, max_turns=max_turns), react_requests, script, max_turns)
    assert len(res['async']['sent']['a3']) == (4 if max_turns is None else max_turns - 1)


def test_gym_scheduler_math_env(offline_gym: None) -> None:
    script = dict(GYM_SCRIPT)
    script['g2'] = script['g2'][:3] + ['<answer>14</answer>']
    run_modes(lambda: GYMScheduler(tokenizer=TOK, max_turns=None), gym_requests, script, prepare=start_gym)
