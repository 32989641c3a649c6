"""Every input checked, never a crash: what hooks and engines return is validated with errors
naming uuid, turn and field; with ``on_error='return'`` nothing a scheduler or an engine returns
escapes as an exception (hypothesis fuzz); duplicate uuids are caught before the first turn."""
from __future__ import annotations

import asyncio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mtflow
from mtflow import MultiTurnRolloutError, Scheduler
from mtflow.engine.executor import DuplicateUuidError
from mtflow.core.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage, RolloutOutput
from tests.helpers import Counter, out, req


class Plain(Scheduler):

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': f'obs {current_turn}'})
        return {'infer_request': infer_request, 'response_token_ids': [7], 'response_loss_mask': [1]}


def run(sched, rollout=None, n=3, max_turns=3, **kw):
    rollout = rollout or Counter(lambda r, k: out(f'{r.uuid}-{k}', [k], [-.1]))
    return mtflow.Executor(sched, rollout, max_turns=max_turns, on_error='return', **kw).run(
        [req(f'r{i}') for i in range(n)])


def raw_output(content='x', token_ids=None, logprobs=None, finish_reason='stop'):
    """An output built without validation (what a buggy engine may hand back)."""
    choice = ChatCompletionResponseChoice.model_construct(
        index=0, message=ChatMessage.model_construct(role='assistant', content=content), finish_reason=finish_reason,
        logprobs=logprobs, token_ids=token_ids)
    return RolloutOutput.model_construct(response=ChatCompletionResponse.model_construct(choices=[choice]))


def only_failure(result, uuid='r1'):
    [failure] = result.failures
    assert failure.uuid == uuid and isinstance(failure.error, mtflow.RequestError)
    return failure


@pytest.mark.parametrize('bad, field', [
    (dict(token_ids=['1', 2]), 'response.choices[0].token_ids'),
    (dict(token_ids=[1.5]), 'response.choices[0].token_ids'),
    (dict(content=None), 'response.choices[0].message.content'),
    (dict(content=5), 'response.choices[0].message.content'),
    (dict(finish_reason=3), 'response.choices[0].finish_reason'),
    (dict(logprobs={'content': [{'token': 'a'}]}), 'response.choices[0].logprobs'),
    (dict(logprobs=[0.1]), 'response.choices[0].logprobs'),
])
def test_bad_engine_outputs_fail_that_request_naming_the_field(bad, field):
    def make(r, k):
        return raw_output(**bad) if (r.uuid, k) == ('r1', 1) else out(f'{r.uuid}-{k}', [k], [-.1])

    result = run(Plain(), Counter(make))
    failure = only_failure(result)
    assert (failure.turn, failure.phase, failure.error.field) == (1, 'apply', field)
    assert result.finish_reasons == ['max_turns', 'error', 'max_turns']


@pytest.mark.parametrize('returned, field, words', [
    ({'rollout_infos': 'text'}, 'rollout_infos', 'must be a dict'),
    ({'rollout_infos': 5}, 'rollout_infos', 'must be a dict'),
    ({'done': 'no'}, 'done', 'must be a bool'),
    ({'done': True, 'finish_reason': 7}, 'finish_reason', 'non-empty str'),
    ({'done': True, 'response_loss_mask': [1, 2]}, 'response_loss_mask', '0/1'),
    ({'done': True, 'rollout_logprobs': ['x']}, 'rollout_logprobs', 'floats'),
    (['not', 'a', 'dict'], 'on_turn_end', 'must return a dict'),
])
def test_bad_on_turn_end_results_name_uuid_turn_and_field(returned, field, words):

    class Hook(Plain):

        async def on_turn_end(self, infer_request, response_choice, current_turn):
            return returned if infer_request.uuid == 'r1' else {}

    failure = only_failure(run(Hook()))
    assert (failure.turn, failure.phase, failure.error.field) == (1, 'on_turn_end', field)
    assert str(failure.error).startswith(f"request r1, turn 1, field '{field}'") and words in str(failure.error)


@pytest.mark.parametrize('returned, field', [
    ({'response_token_ids': ['a'], 'response_loss_mask': [1]}, 'response_token_ids'),
    ({'response_token_ids': [1, 2], 'response_loss_mask': [1, 3]}, 'response_loss_mask'),
    ({'response_token_ids': [1], 'rollout_logprobs': 'x'}, 'rollout_logprobs'),
    ({'trace_info': 'x'}, 'trace_info'),
])
def test_bad_step_fields(returned, field):

    class Bad(Plain):

        def step(self, infer_request, response_choice, current_turn):
            if infer_request.uuid == 'r1':
                return {'infer_request': infer_request, **returned}
            return super().step(infer_request, response_choice, current_turn)

    failure = only_failure(run(Bad()))
    assert (failure.turn, failure.phase, failure.error.field) == (1, 'step', field)


@pytest.mark.parametrize('returned', [None, 5, 'text'])
def test_rollout_fn_returning_no_list_fails_the_requests_it_served(returned):
    calls = []

    def rollout(requests, config):
        calls.append(len(requests))
        return returned if len(calls) == 2 else [out('x', [1]) for _ in requests]

    result = run(Plain(), rollout)
    assert result.finish_reasons == ['error'] * 3
    assert {(f.phase, f.turn, f.error.field) for f in result.failures} == {('rollout_fn', 2, 'outputs')}
    assert 'rollout_fn returned ' in str(result.failures[0].error)


def test_unreadable_messages_fail_that_request():

    class BadMessages(Plain):

        def step(self, infer_request, response_choice, current_turn):
            if infer_request.uuid == 'r1':
                infer_request.messages.append('not a message')
                return {'infer_request': infer_request}
            return super().step(infer_request, response_choice, current_turn)

    failure = only_failure(run(BadMessages()))
    assert (failure.phase, failure.error.field) == ('step', 'messages')
    result = mtflow.Executor(Plain(max_turns=2), Counter(lambda r, k: out('x', [1])), on_error='return').run(
        [req('a'), mtflow.RolloutInferRequest.model_construct(messages=[7], uuid='b')])
    assert result.finish_reasons == ['max_turns', 'error'] and result.failures[0].phase == 'input'


def test_check_finished_must_return_a_bool():

    class Check(Plain):

        def check_finished(self, infer_request, response_choice, current_turn):
            return 'no' if infer_request.uuid == 'r1' else current_turn >= 2

    result = run(Check())
    failure = only_failure(result)
    assert (failure.phase, failure.error.field) == ('check_finished', 'check_finished')
    assert result.finish_reasons == ['check_finished', 'error', 'check_finished']


def test_rollout_infos_as_key_value_pairs_are_accepted_as_ms_swift_does():

    class Pairs(Plain):

        async def on_turn_end(self, infer_request, response_choice, current_turn):
            return {'rollout_infos': [('seen', current_turn)]}

        def step(self, infer_request, response_choice, current_turn):
            result = super().step(infer_request, response_choice, current_turn)
            return {**result, 'rollout_infos': [('stepped', current_turn)]}

    result = run(Pairs())
    assert result.ok
    assert result.outputs[0].rollout_infos == {'seen': 3, 'stepped': 2, 'num_turns': 3}


def test_a_choice_whose_token_ids_are_not_ints_on_the_last_turn_is_an_error_not_an_illegal_transition():
    # the first version built the output after the move to finished, and a failure there tried a
    # second move: IllegalTransition('fail' from 'finished') escaped even with on_error='return'
    def make(r, k):
        return raw_output('x', token_ids=[object()]) if k == 2 else out('x', [1])

    result = run(Plain(), Counter(make), max_turns=3)
    assert result.finish_reasons == ['error'] * 3
    assert {f.phase for f in result.failures} == {'apply'}


def test_finalize_output_must_return_an_output():

    class Policy(Plain):

        def finalize_output(self, output, finish_reason, turn):
            return 'not an output' if output.messages[0]['content'].endswith('r1') else None

    result = run(Policy())
    failure = only_failure(result)
    assert (failure.phase, failure.error.field) == ('finalize_output', 'finalize_output')
    assert isinstance(result.outputs[1], RolloutOutput)


# ---- duplicate uuids -----------------------------------------------------------------------------


class Keyed(Plain):
    """Keeps per-request state by uuid, as the YAML scheduler does."""
    requires_unique_uuids = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.state = {}

    def step(self, infer_request, response_choice, current_turn):
        self.state.setdefault(infer_request.uuid, []).append(current_turn)
        return super().step(infer_request, response_choice, current_turn)


def test_duplicate_uuids_fail_the_later_copy_before_the_first_turn():
    requests = [req('a'), req('b'), req('a'), req('c')]
    rollout = Counter(lambda r, k: out(f'{r.uuid}-{k}', [k]))
    result = mtflow.Executor(Keyed(max_turns=2), rollout, on_error='return').run(requests)
    assert result.finish_reasons == ['max_turns', 'max_turns', 'error', 'max_turns']
    [failure] = result.failures
    assert (failure.index, failure.turn, failure.phase) == (2, 1, 'input')
    assert isinstance(failure.error, DuplicateUuidError)
    assert 'index 0 and index 2' in str(failure.error)
    assert rollout.calls[0] == ['a', 'b', 'c']  # the duplicate never ran
    assert result.outputs[2].messages == [{'role': 'user', 'content': 'question a'}]
    with pytest.raises(MultiTurnRolloutError, match='index 0 and index 2'):
        mtflow.Executor(Keyed(max_turns=2), rollout).run([req('a'), req('b'), req('a')])


def test_duplicate_uuids_are_checked_only_when_asked_for():
    rollout = Counter(lambda r, k: out(f'{r.uuid}-{k}', [k]))
    assert mtflow.Executor(Plain(max_turns=2), rollout).run([req('a'), req('a')]).ok
    with pytest.raises(MultiTurnRolloutError, match='uuid used by index 0 and index 1'):
        mtflow.Executor(Plain(max_turns=2), rollout, unique_uuids=True).run([req('a'), req('a')])


def test_the_yaml_scheduler_asks_for_unique_uuids():
    from mtflow.declarative.scheduler import YamlScheduler
    assert YamlScheduler.requires_unique_uuids is True


# ---- fuzz ----------------------------------------------------------------------------------------

junk_leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=3),
                      st.just(object()))
junk = st.recursive(junk_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                    max_leaves=6)
KEYS = ['done', 'finish_reason', 'rollout_infos', 'response_token_ids', 'response_loss_mask', 'rollout_logprobs',
        'infer_request', 'trace_info']
hook_result = st.one_of(junk, st.dictionaries(st.sampled_from(KEYS), junk, max_size=4))


@st.composite
def engine_output(draw):
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return out('ok', [1], [-.1])
    if kind == 1:
        return draw(junk)
    return raw_output(content=draw(st.one_of(st.text(max_size=3), junk)),
                      token_ids=draw(st.one_of(st.lists(st.integers(0, 9), max_size=3), junk)),
                      logprobs=draw(st.one_of(st.none(), junk)), finish_reason=draw(st.one_of(st.just('stop'), junk)))


class Fuzzed(Scheduler):
    """Every hook returns what the fuzzer drew (or raises), by request and turn."""

    def __init__(self, draws, **kw):
        super().__init__(**kw)
        self.draws = draws

    def _get(self, hook, request, turn):
        value = self.draws.get((hook, request.uuid, turn), {})
        if isinstance(value, dict) and value.get('infer_request') == 'SELF':
            value = {**value, 'infer_request': request}
        if value == 'RAISE':
            raise RuntimeError(f'{hook} broke')
        return value

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        if current_turn == 2:
            await asyncio.sleep(0)  # some hooks really suspend
        return self._get('on_turn_end', infer_request, current_turn)

    def check_finished(self, infer_request, response_choice, current_turn):
        return self._get('check_finished', infer_request, current_turn) if (
            'check_finished', infer_request.uuid, current_turn) in self.draws else current_turn >= 3

    def step(self, infer_request, response_choice, current_turn):
        value = self._get('step', infer_request, current_turn)
        if value == {}:
            infer_request.messages.append({'role': 'user', 'content': 'obs'})
            return {'infer_request': infer_request}
        return value

    def finalize_output(self, output, finish_reason, turn):
        return self.draws.get(('finalize_output', finish_reason))


HOOKS = ['on_turn_end', 'check_finished', 'step']


@st.composite
def scenario(draw):
    draws = {}
    for hook in HOOKS:
        for uuid in ('r0', 'r1', 'r2'):
            for turn in (1, 2, 3):
                if draw(st.integers(0, 4)) == 0:
                    value = draw(st.one_of(hook_result, st.just('RAISE'),
                                           st.fixed_dictionaries({'infer_request': st.just('SELF')}, optional={
                                               k: junk for k in KEYS if k != 'infer_request'})))
                    draws[(hook, uuid, turn)] = value
    if draw(st.booleans()):
        draws[('finalize_output', draw(st.sampled_from(['check_finished', 'max_turns', 'error'])))] = draw(junk)
    outputs = {(u, k): draw(engine_output()) for u in ('r0', 'r1', 'r2') for k in (1, 2, 3) if draw(st.integers(0, 3)) == 0}
    count = draw(st.sampled_from([None, None, None, 0, 2, 4, 'junk']))
    return draws, outputs, count


def fuzz_rollout(outputs, count):
    calls = []

    def rollout_fn(requests, config):
        calls.append(len(requests))
        got = [outputs.get((r.uuid, len(calls)), out('ok', [1], [-.1])) for r in requests]
        if count == 'junk' and len(calls) == 2:
            return 5  # not a list at all
        if count is not None and len(calls) == 2 and requests:
            return got[:count] if count < len(got) else got + got[:count - len(got)]
        return got

    return rollout_fn


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(scenario())
def test_fuzz_with_on_error_return_nothing_escapes(case):
    draws, outputs, count = case
    result = mtflow.Executor(Fuzzed(draws), fuzz_rollout(outputs, count), max_turns=3, on_error='return').run(
        [req(f'r{i}') for i in range(3)])
    assert len(result.outputs) == 3 and all(o is not None for o in result.outputs)
    assert all(isinstance(r, str) for r in result.finish_reasons)
    assert all(isinstance(o.rollout_infos, dict) for o in result.outputs)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(scenario())
def test_fuzz_with_on_error_raise_only_multi_turn_rollout_error(case):
    draws, outputs, count = case
    try:
        result = mtflow.Executor(Fuzzed(draws), fuzz_rollout(outputs, count), max_turns=3).run(
            [req(f'r{i}') for i in range(3)])
    except MultiTurnRolloutError as err:
        assert len(err.outputs) == 3 and all(o is not None for o in err.outputs) and err.failures
    else:
        assert result.ok
