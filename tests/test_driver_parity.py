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
- **record indexes** (a failure's ``index``): a fork's children are numbered as they are born, which
  is when each driver gets to the fork; everything is compared by uuid;
- **partial results**: a budget (``until=``) stops each driver where its own schedule has got to
  (lockstep has none), so which requests come back unfinished is not compared; resuming them is
  checked against an uninterrupted run in ``tests/test_async_mode.py``.

Branched scenarios (``docs/branching.md``) fork the requests where a generated policy says (a turn,
a state, tool calls, entropy; copies; a leaf budget, so trees are topped up mid-run): every leaf
and every tree record must be the same in every driver. A child's model turns come from its
root's plan, its ids moved by its uuid, so that branches answer apart.

Multi-agent scenarios (``docs/multi-agent.md``, at the end): episodes of several roles, each role a
request, a waiting role resting in ``tool_step``; every role's trajectory must be the same in every
driver.

970 scenarios in all (600 + 40 with deadlines + 60 with a context budget + 150 branched + 120
multi-agent), fixed by ``derandomize`` so that a failure reproduces.
"""
from __future__ import annotations

import asyncio
import base64
import io
from typing import Any, Dict, List, Optional, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zlib

from mtflow import ContextBudget, Executor, RequestConfig, Scheduler
from mtflow.engine.branching import branch_root
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
        plan = self.plans[branch_root(request.uuid)]  # a branch follows its root's plan
        return plan[turn - 1] if turn <= len(plan) else None

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        t = self._turn(infer_request, current_turn)
        result: Dict[str, Any] = {'rollout_infos': {f'seen_{current_turn}': len(infer_request.messages)}}
        if t is None or t['done'] or current_turn >= len(self.plans[branch_root(infer_request.uuid)]):
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
    the output's place fails that request only), whatever the batch it arrives in; a fork's child
    goes on from its parent's turn (``fork``), with its root's plan and ids moved by its uuid."""
    seen: Dict[str, int] = {}

    def rollout(requests, request_config=None):
        outputs: List[Any] = []
        for r in requests:
            turn = seen[r.uuid] = seen.get(r.uuid, 0) + 1
            plan = plans[branch_root(r.uuid)]
            t = plan[min(turn, len(plan)) - 1]
            if t['fault']:
                outputs.append(RuntimeError(f'backend cannot serve {r.uuid} turn {turn}'))
                continue
            shift = zlib.crc32(r.uuid.encode()) % 7 if r.uuid != branch_root(r.uuid) else 0
            outputs.append(out(f'{r.uuid}/{turn}', [i + shift for i in t['ids']], t['logprobs'], t['finish_reason']))
        return outputs

    def fork(parent: str, children: List[str]) -> None:
        for child in children:
            seen[child] = seen.get(parent, 0)

    rollout.fork = fork
    return rollout


def _event_view(events: List[Any]) -> List[tuple]:
    return [(e.turn, e.src, e.dst, e.trigger, e.reason, e.tokens) for e in events]


def _failure_view(failures: List[Any]) -> Dict[str, dict]:
    return {f.uuid: {k: v for k, v in f.to_dict().items() if k != 'index'} for f in failures}


def _without_versions(outputs: List[Any]) -> List[Any]:
    dumped = dump(outputs)
    for d in dumped:
        if d is not None:
            d['rollout_infos'].pop('policy_versions', None)
            d['rollout_infos'].get('mtflow_error', {}).pop('index', None)
    return dumped


def run_driver(driver: str, plans: List[List[dict]], options: Dict[str, Any]) -> Dict[str, tuple]:
    """Per uuid (a fork's children too): (output, finish reason, failure, final request, trace)
    under one driver; and, under ``'trees'``, the trees of a branched run by root."""
    by_uuid = {f'r{i}': plan for i, plan in enumerate(plans)}
    requests = [req(u) for u in by_uuid]
    scheduler = PlannedScheduler(by_uuid, options.get('max_turns'))
    kwargs = dict(options, on_error='return')
    config = kwargs.pop('request_config', None)
    if driver == 'stream':
        ex = Executor(scheduler, planned_rollout(by_uuid), config, mode='async', **kwargs)
        groups = list(ex.stream(requests, max_staleness=0, max_concurrency=3))
        assert len(groups) == len(requests)
        got: Dict[str, Any] = {'trees': {}}
        for g in groups:
            failures = _failure_view(g.failures)
            outputs = _without_versions(g.outputs)
            for k, uuid in enumerate(g.uuids):
                got[uuid] = (outputs[k], g.finish_reasons[k], failures.get(uuid), dump([g.requests[k]])[0],
                             _event_view(g.events[k]))
            got['trees'].update((t['root'], t) for t in g.trees)
        return got
    mode, _, concurrency = driver.partition('@')
    if mode == 'async':
        kwargs.update(mode='async', max_concurrency=int(concurrency))
    result = Executor(scheduler, planned_rollout(by_uuid), config, **kwargs).run(requests)
    failures = _failure_view(result.failures)
    outputs = _without_versions(result.outputs)
    got = {r.uuid: (outputs[i], result.finish_reasons[i], failures.get(r.uuid), dump([requests[i]])[0],
                    _event_view(result.trace.for_request(r.uuid)))
           for i, r in enumerate(requests)}  # the list run grows by each fork's children
    got['trees'] = {t['root']: t for t in result.trees}
    return got


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


@st.composite
def branch_st(draw) -> Dict[str, Any]:
    at = draw(st.sampled_from(['turn', 'tool_step', 'tool_calls', 'entropy']))
    if at == 'turn':
        where: Any = {'turn': draw(st.integers(1, 3))}
    elif at == 'tool_step':
        where = {'turn': draw(st.integers(1, 3)), 'state': 'tool_step'}
    elif at == 'tool_calls':
        where = 'tool_calls'
    else:  # the plans' turns have mean surprisal 0.125 (1 id), 0.1875 (2) or 0.25 (3)
        where = {'entropy': {'above': draw(st.sampled_from([0.15, 0.2]))}}
    return {'at': where, 'copies': draw(st.integers(2, 3)), 'leaves': draw(st.sampled_from([None, 2, 3, 5]))}


BRANCHED = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.filterwarnings('ignore::UserWarning')
@BRANCHED
@given(plans=scenario_st(max_requests=3), max_turns=st.sampled_from([None, 3]), branch=branch_st())
def test_drivers_agree_on_branched_scenarios(plans, max_turns, branch):
    """Forks at a turn, after a turn (tool_step), after tool calls, at high entropy, with and
    without a leaf budget (top-ups start mid-run): the same leaves and the same trees."""
    assert_parity(plans, {'max_turns': max_turns, 'branch': branch})


# ---- multi-agent episodes (docs/multi-agent.md) ------------------------------------------------
# Every role of an episode is a request of the run; a role waiting for the others rests in tool_step
# (its step answered Wait). The scenarios: turn-based (two or three roles in turn), simultaneous
# moves (every role acts, then the environment steps), message passing (a user simulator and an
# assistant), a role with its own scheduler (inner tool turns between its actions), a judge at the
# end, a failing role (its backend fails one of its turns: the others finish role_failed, kept), an
# environment that fails or names nobody (a deadlock), an episode cut by max_steps. Every driver
# must give the same per-role trajectories, finish reasons, failures and traces.

EPISODE_KINDS = ('turns', 'together', 'messages')


class PlannedEpisode:
    """An episode environment whose course is a plan: who acts at each step (turn-based in order,
    everyone at once, or a user and an assistant in turn), when it ends, the rewards, and whether
    it fails or names nobody at a step; ``suspend``: its methods really suspend."""

    def __init__(self, kind: str, seats: Tuple[str, ...], steps: int, fault: Optional[Tuple[str, int]],
                 suspend: bool) -> None:
        self.kind, self.seats, self.steps, self.fault, self.suspend = kind, seats, steps, fault, suspend
        self.roles = seats
        self.done_steps = 0
        self.next = 0

    async def _pause(self) -> None:
        if self.suspend:
            await asyncio.sleep(0)

    async def reset(self, episode):
        await self._pause()
        if self.kind == 'together':
            return {s: f'{episode.id}: go' for s in self.seats}
        return {self.seats[0]: f'{episode.id}: you start'}

    def acting(self):
        if self.fault is not None and self.fault == ('nobody', self.done_steps):
            return []
        return list(self.seats) if self.kind == 'together' else [self.seats[self.next]]

    async def step(self, actions):
        await self._pause()
        self.done_steps += 1
        if self.fault is not None and self.fault == ('raise', self.done_steps):
            raise RuntimeError(f'environment failed at step {self.done_steps}')
        said = ' | '.join(f'{s}={t}' for s, t in sorted(actions.items()))
        if self.done_steps >= self.steps:
            return {'done': True, 'rewards': {s: float(len(t) % 3) - 1.0 for s, t in actions.items()},
                    'info': {'steps': self.done_steps}}
        if self.kind == 'together':
            return {'observations': {s: f'step {self.done_steps}: {said}' for s in self.seats},
                    'rewards': {s: 0.5 for s in self.seats}}
        self.next = (self.next + 1) % len(self.seats)
        return {'observations': {self.seats[self.next]: f'step {self.done_steps}: {said}'}}


class InnerTurns(Scheduler):
    """A role's own scheduler: at the turns its plan names, the turn is an inner tool call (its own
    step adds a tool message) instead of an action."""

    def __init__(self, tool_turns: Tuple[int, ...]) -> None:
        super().__init__()
        self.tool_turns = tool_turns

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        return {'done': current_turn not in self.tool_turns, 'rollout_infos': {f'own_{current_turn}': True}}

    async def step(self, infer_request, response_choice, current_turn):
        await asyncio.sleep(0)
        infer_request.messages.append({'role': 'tool', 'content': f'tool result {current_turn}'})
        return {'infer_request': infer_request}


@st.composite
def episode_st(draw) -> Dict[str, Any]:
    kind = draw(st.sampled_from(EPISODE_KINDS))
    seats = ('user', 'assistant') if kind == 'messages' else (('a', 'b', 'c') if draw(st.booleans()) else ('a', 'b'))
    fault = None
    if draw(st.integers(0, 9)) == 0:
        fault = (draw(st.sampled_from(['raise', 'nobody'])), draw(st.integers(1, 3)))
    return {
        'kind': kind, 'seats': seats, 'episodes': draw(st.integers(1, 3)), 'steps': draw(st.integers(1, 5)),
        'fault': fault, 'suspend': draw(st.booleans()), 'judge': draw(st.integers(0, 3)) == 0,
        'tool_turns': tuple(draw(st.lists(st.integers(1, 4), max_size=2))) if draw(st.booleans()) else None,
        'max_steps': draw(st.sampled_from([None, None, 3])),
        'turns': draw(st.lists(turn_st(('observe', )), min_size=1, max_size=6)),
    }


def _episode_parts(plan: Dict[str, Any]):
    from mtflow.roles import EpisodeScheduler, PolicyRouter, Role, iter_episode_requests
    from mtflow.roles.judge import judged

    seats = plan['seats']
    roles = [Role(s, policy='p' if k % 2 == 0 else 'q',
                  scheduler=InnerTurns(plan['tool_turns']) if plan['tool_turns'] is not None and k == 0 else None)
             for k, s in enumerate(seats)]

    def env(info):
        return PlannedEpisode(plan['kind'], seats, plan['steps'], plan['fault'], plan['suspend'])

    if plan['judge']:
        roles.append(Role('judge', policy='q', train=False))
        env = judged(env, judges=list(seats))
    scheduler = EpisodeScheduler(env, roles, policies=['p', 'q'], max_steps=plan['max_steps'])
    turns = plan['turns']

    def policy(tag: str):
        seen: Dict[str, int] = {}

        def rollout(requests, request_config=None):
            answers = []
            for r in requests:
                n = seen[r.uuid] = seen.get(r.uuid, 0) + 1
                t = turns[(n + len(r.uuid)) % len(turns)]
                if t['fault'] and n > 1:
                    answers.append(RuntimeError(f'backend cannot serve {r.uuid} turn {n}'))
                    continue
                text = f'Score: {n}' if r.uuid.endswith('/judge') else f'{tag}:{r.uuid}/{n}'
                answers.append(out(text, t['ids'], t['logprobs'], t['finish_reason']))
            return answers

        return rollout

    router = PolicyRouter({'p': policy('P'), 'q': policy('Q')}, roles)
    prompts = [req(f'e{i}') for i in range(plan['episodes'])]
    groups = list(iter_episode_requests(prompts, roles))
    return scheduler, router, groups


def run_episode_driver(driver: str, plan: Dict[str, Any]) -> Dict[str, tuple]:
    scheduler, router, groups = _episode_parts(plan)
    kwargs = dict(max_turns=12, on_error='return')
    if driver == 'stream':
        ex = Executor(scheduler, router, mode='async', **kwargs)
        got = {}
        for g in ex.stream(groups, max_staleness=0, max_concurrency=2):
            failures = _failure_view(g.failures)
            outputs = _without_versions(g.outputs)
            for k, uuid in enumerate(g.uuids):
                got[uuid] = (outputs[k], g.finish_reasons[k], failures.get(uuid), dump([g.requests[k]])[0],
                             _event_view(g.events[k]))
        return got
    requests = [r for g in groups for r in g]
    mode, _, concurrency = driver.partition('@')
    if mode == 'async':
        kwargs.update(mode='async', max_concurrency=int(concurrency))
    result = Executor(scheduler, router, **kwargs).run(requests)
    failures = _failure_view(result.failures)
    outputs = _without_versions(result.outputs)
    return {r.uuid: (outputs[i], result.finish_reasons[i], failures.get(r.uuid), dump([requests[i]])[0],
                     _event_view(result.trace.for_request(r.uuid)))
            for i, r in enumerate(requests)}


EPISODES = settings(max_examples=120, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.filterwarnings('ignore::UserWarning')
@EPISODES
@given(plan=episode_st())
def test_drivers_agree_on_multi_agent_episodes(plan):
    """Turn-based, simultaneous and message-passing episodes, a role with inner tool turns, a
    judge, a failing role, a failing or silent environment, max_steps: the same per-role
    trajectories under lockstep, async (one slot too: a resting role gives its slot up) and a
    stream."""
    reference = run_episode_driver('lockstep', plan)
    assert all(v[1] is not None for v in reference.values())  # every role finished
    for driver in DRIVERS[1:]:
        got = run_episode_driver(driver, plan)
        assert got.keys() == reference.keys()
        for uuid, expected in reference.items():
            assert got[uuid] == expected, f'{driver} differs from lockstep for {uuid}'
