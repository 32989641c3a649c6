"""Policy versions: each generated turn carries the version of the weights that sampled it."""
from __future__ import annotations

import pytest

from benchmarks.longtail_sim import LongTailScheduler, SimEngine, Workload
from mtflow import Executor, RolloutInferRequest, Scheduler


class Bump(Scheduler):
    """Every step is a weight update: the trainer moves to version ``turn``."""

    def __init__(self, executor_box: list, max_turns: int = 3) -> None:
        super().__init__(max_turns=max_turns)
        self.box = executor_box

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= self.max_turns  # a reply cut at max_tokens goes on (the tiny model's are)

    def step(self, infer_request, response_choice, current_turn):
        self.box[0].set_policy_version(current_turn)
        infer_request.messages.append({'role': 'user', 'content': f'go on {current_turn}'})
        return {'infer_request': infer_request}


class BumpInStep(Bump):
    """:class:`Bump` whose requests take each turn's step together (an async barrier across the
    ``n`` requests), so that in async mode every request's turn ``t`` is issued after the update
    to version ``t - 1`` and before the next: without it, one request's call may finish turns
    ahead of the other's under load, and the slower one's update would go back in version."""

    def __init__(self, executor_box: list, n: int, max_turns: int = 3) -> None:
        super().__init__(executor_box, max_turns)
        self.n = n
        self.barriers: dict = {}

    async def step(self, infer_request, response_choice, current_turn):
        import asyncio
        barrier = self.barriers.setdefault(current_turn, asyncio.Barrier(self.n))
        await barrier.wait()
        return super().step(infer_request, response_choice, current_turn)


def _requests(n: int):
    return [RolloutInferRequest(messages=[{'role': 'user', 'content': f'count {i}'}], uuid=f'q{i}') for i in range(n)]


def _bumping(rollout_fn, request_config=None, in_step: int = 0, **options) -> Executor:
    """An executor whose every step is a weight update (:class:`Bump`; :class:`BumpInStep` for
    ``in_step`` requests), from version 0 (the trainer declares its starting weights: turns are
    stamped from there)."""
    box: list = []
    ex = Executor(BumpInStep(box, in_step) if in_step else Bump(box), rollout_fn, request_config, **options)
    box.append(ex)
    ex.set_policy_version(0)
    return ex


def _check_token_record_versions(**options) -> None:
    """Two requests over the tiny HF model: each turn's version is in ``rollout_infos`` and on
    the token record's turn."""
    pytest.importorskip('transformers')
    from mtflow.backends.hf import HFBackend
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    backend = HFBackend(make_model(tok, seed=1), tok, default_max_tokens=4)
    ex = _bumping(backend, {'max_tokens': 4, 'temperature': 0}, in_step=2, **options)
    reqs = _requests(2)
    out = ex.run(reqs).outputs
    for req, o in zip(reqs, out):
        assert o.rollout_infos['policy_versions'] == [0, 1, 2]
        assert [t.version for t in req.token_record.turns] == [0, 1, 2]


def test_an_update_between_two_turns_is_in_the_requests_infos():
    w = Workload(seed=0)
    ex = _bumping(SimEngine(w, 0.0001, 8), mode='async', max_concurrency=1)
    result = ex.run(_requests(1))
    assert result.outputs[0].rollout_infos['policy_versions'] == [0, 1, 2]
    assert ex.policy_version == 2


def test_plain_runs_stamp_nothing():
    w = Workload(seed=0)
    out = Executor(LongTailScheduler(w), SimEngine(w, 0.0001, 8), mode='async').run(w.requests(3)).outputs
    assert all('policy_versions' not in o.rollout_infos for o in out)


def test_a_backend_declared_version_wins():
    w = Workload(seed=0)
    engine = SimEngine(w, 0.0001, 8)
    engine.policy_version = 7
    ex = Executor(LongTailScheduler(w), engine, mode='async')
    ex.set_policy_version(1)
    out = ex.run(w.requests(2)).outputs
    assert all(set(o.rollout_infos['policy_versions']) == {7} for o in out)


def test_versions_only_go_forward():
    ex = Executor(Bump([]), SimEngine(Workload()), mode='async')
    ex.set_policy_version(3)
    with pytest.raises(ValueError, match='older than the current one'):
        ex.set_policy_version(2)
    with pytest.raises(ValueError, match='int >= 0'):
        ex.set_policy_version(-1)


def test_the_token_record_keeps_each_turns_version():
    _check_token_record_versions(mode='async')


@pytest.mark.parametrize('mode, n', [('lockstep', 1), ('async', 1), ('lockstep', 3)])
def test_lockstep_stamps_each_turn_as_async_does(mode, n):
    w = Workload(seed=0)
    ex = _bumping(SimEngine(w, 0.0001, 8), mode=mode)
    result = ex.run(_requests(n))
    # lockstep: every request's step moves to the turn just finished, and the next turn is issued
    # after all of them, so each request's turns are 0, 1, 2, as one request's are in async mode
    assert [o.rollout_infos['policy_versions'] for o in result.outputs] == [[0, 1, 2]] * n


def test_lockstep_reads_the_version_when_the_call_is_issued():
    w = Workload(seed=0)
    engine = SimEngine(w, 0.0001, 8)
    box: list = []

    def rollout_fn(requests, request_config=None):
        out = engine(requests, request_config)
        box[0].set_policy_version(box[0].policy_version + 10)  # an update during the call: the turn is old
        return out

    class TwoTurns(Scheduler):
        def check_finished(self, infer_request, response_choice, current_turn):
            return current_turn >= 2

        def step(self, infer_request, response_choice, current_turn):
            infer_request.messages.append({'role': 'user', 'content': 'more'})
            return {'infer_request': infer_request}

    ex = Executor(TwoTurns(max_turns=2), rollout_fn, skip_empty_calls=True)
    box.append(ex)
    ex.set_policy_version(1)
    out = ex.run(_requests(2)).outputs
    assert [o.rollout_infos['policy_versions'] for o in out] == [[1, 11]] * 2


def test_lockstep_plain_runs_and_first_turn_outputs_stamp_nothing_new():
    from mtflow.backends.scripted import ScriptedBackend

    w = Workload(seed=0)
    plain = Executor(LongTailScheduler(w), SimEngine(w, 0.0001, 8)).run(w.requests(3)).outputs
    assert all('policy_versions' not in o.rollout_infos for o in plain)
    for mode in ('lockstep', 'async'):
        backend = ScriptedBackend(outputs=['a reply'], cycle=True)
        first = backend(_requests(1))  # one request: in async mode two would race their updates
        ex = _bumping(backend, mode=mode)
        out = ex.run(_requests(1), first_turn_outputs=first).outputs
        assert out[0].rollout_infos['policy_versions'] == [1, 2], mode  # turn 1 was given, not issued


@pytest.mark.slow  # the tiny model on CPU: tens of seconds on a loaded machine
def test_lockstep_token_record_keeps_each_turns_version():
    _check_token_record_versions()
