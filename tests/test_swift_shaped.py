"""A scheduler shaped like ms-swift's (its own base classes, dataclass requests and responses, a
pydantic output class), written here without mtflow's base class, runs unchanged, and the outputs
come back in the caller's own output class."""
from __future__ import annotations

import asyncio
from abc import ABC
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from pydantic import BaseModel, Field

import mtflow


@dataclass
class Msg:
    role: str
    content: Any


@dataclass
class Choice:
    index: int
    message: Msg
    finish_reason: Optional[str]
    logprobs: Optional[Dict[str, List[Dict[str, Any]]]] = None
    token_ids: Optional[List[int]] = None


@dataclass
class Response:
    model: str
    choices: List[Choice]
    usage: Any = None


@dataclass
class Request:
    messages: List[Dict[str, Any]]
    images: List[str] = field(default_factory=list)
    data_dict: Dict[str, Any] = field(default_factory=dict)
    uuid: Optional[str] = None


class Output(BaseModel):
    response: Any
    messages: Optional[List[Dict[str, Any]]] = None
    response_token_ids: List[List[int]] = Field(default_factory=list)
    response_loss_mask: List[List[int]] = Field(default_factory=list)
    rollout_infos: Dict[str, Any] = Field(default_factory=dict)
    rollout_logprobs: List[List[float]] = Field(default_factory=list)


class RolloutScheduler(ABC):
    """As ms-swift's: engine and max_turns in the constructor, attribute lookups fall through to the engine."""

    def __init__(self, infer_engine=None, max_turns=None, *args, **kwargs):
        self.infer_engine = infer_engine
        self.max_turns = max_turns

    async def on_trajectory_start(self, requests):
        pass

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        return {}

    def __getattr__(self, key):
        try:
            return object.__getattribute__(self, key)
        except AttributeError:
            engine = object.__getattribute__(self, 'infer_engine')
            if hasattr(engine, key):
                return getattr(engine, key)
            raise AttributeError(key)


class MultiTurnScheduler(RolloutScheduler):

    def step(self, infer_request, response_choice, current_turn):
        raise NotImplementedError

    def check_finished(self, infer_request, response_choice, current_turn):
        if response_choice.finish_reason == 'length':
            return True
        return bool(self.max_turns and current_turn >= self.max_turns)


class MathTips(MultiTurnScheduler):
    """The tip-and-recheck pattern: a wrong answer gets a tip appended and is continued."""
    TIP = ' But wait... let me check.'
    TIP_IDS = [77, 78, 79]

    def check_finished(self, infer_request, response_choice, current_turn):
        if infer_request.data_dict['answer'] in response_choice.message.content:
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages[-1]['content'] += self.TIP
        ids = list(response_choice.token_ids) + self.TIP_IDS
        mask = [1] * len(response_choice.token_ids) + [0] * len(self.TIP_IDS)
        lps = [c['logprob'] for c in response_choice.logprobs['content']]
        return {'infer_request': infer_request, 'response_token_ids': ids, 'response_loss_mask': mask,
                'rollout_logprobs': lps, 'rollout_infos': {'tips': current_turn}}

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        await asyncio.sleep(0)
        return {'rollout_infos': {'seen_turn': current_turn}}


def output(text, ids):
    lp = {'content': [{'token': str(i), 'logprob': -0.1 * i} for i in ids]}
    return Output(response=Response('m', [Choice(0, Msg('assistant', text), 'stop', lp, ids)]))


def test_an_ms_swift_shaped_subclass_runs_unchanged():
    requests = [
        Request(messages=[{'role': 'user', 'content': '1+1?'}], data_dict={'answer': '2'}, uuid='a'),
        Request(messages=[{'role': 'user', 'content': '2+2?'}], data_dict={'answer': '4'}, uuid='b'),
    ]
    answers = {'a': [output(' it is 2', [3, 4])], 'b': [output(' maybe 5', [5, 6]), output(' it is 4', [7])]}
    calls = []

    def rollout_fn(reqs, request_config):
        calls.append([r.uuid for r in reqs])
        return [answers[r.uuid].pop(0) for r in reqs]

    firsts = [output('I think 3', [1, 2]), output('I think 3', [1, 2])]
    outputs = mtflow.run_multi_turn(requests, firsts, MathTips(max_turns=4), rollout_fn, {'temperature': 1.0})

    assert all(type(o) is Output for o in outputs)
    a, b = outputs
    assert a.messages[-1]['content'] == 'I think 3 But wait... let me check. it is 2'
    assert a.response_token_ids == [[1, 2, 77, 78, 79, 3, 4]]
    assert a.response_loss_mask == [[1, 1, 0, 0, 0, 1, 1]]
    assert a.rollout_logprobs == [[-0.1, -0.2, -0.30000000000000004, -0.4]]
    assert a.rollout_infos == {'seen_turn': 2, 'tips': 1, 'num_turns': 2}
    assert b.rollout_infos['num_turns'] == 3 and b.response_token_ids == [[1, 2, 77, 78, 79, 5, 6, 77, 78, 79, 7]]
    assert isinstance(a.response, Response)  # the caller's own response objects pass through untouched
    assert calls == [['a', 'b'], ['b'], []]


def test_hooks_the_subclass_does_not_override_are_not_called():
    from mtflow.core.scheduler import HookSet

    class Plain(MultiTurnScheduler):

        def step(self, infer_request, response_choice, current_turn):
            return {'infer_request': infer_request}

    hooks = HookSet(Plain())
    assert hooks.on_turn_end is not None  # a look-alike base is user code: mtflow cannot know it is a no-op
    assert HookSet(MathTips()).step_is_async is False

    class Native(mtflow.Scheduler):

        def step(self, infer_request, response_choice, current_turn):
            return {'infer_request': infer_request}

    native = HookSet(Native())
    assert native.on_turn_end is None and native.check_finished is None and native.on_trajectory_start is None
