"""Clear errors that name the request, the turn and the field, and never lose other requests."""
from __future__ import annotations

import pytest

import mtflow
from mtflow import MultiTurnRolloutError, Scheduler
from mtflow.core.errors import IllegalTransition
from mtflow.core.machine import FINISH, RequestRecord, StateGraph
from tests.helpers import Counter, out, req


class Configurable(Scheduler):

    def __init__(self, bad_uuid: str, result: dict = None, raise_in: str = None, **kw):
        super().__init__(**kw)
        self.bad_uuid, self.result, self.raise_in = bad_uuid, result, raise_in

    def step(self, infer_request, response_choice, current_turn):
        if infer_request.uuid == self.bad_uuid:
            if self.raise_in == 'step':
                raise ValueError('tool exploded')
            if self.result is not None:
                return dict(self.result, infer_request=self.result.get('infer_request', infer_request)) \
                    if 'infer_request' in self.result else dict(self.result)
        infer_request.messages.append({'role': 'user', 'content': 'obs'})
        return {'infer_request': infer_request}

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        if self.raise_in == 'on_turn_end' and infer_request.uuid == self.bad_uuid:
            raise KeyError('env missing')
        return {}


def run(sched, on_error='raise', n=3, max_turns=3):
    requests = [req(f'r{i}') for i in range(n)]
    rollout = Counter(lambda r, k: out(f'{r.uuid}-{k}', [k], [-.1]))
    ex = mtflow.Executor(sched, rollout, max_turns=max_turns, on_error=on_error)
    return ex.run(requests, [out(f'r{i}-0', [0], [-.1]) for i in range(n)]), rollout


@pytest.mark.parametrize(
    'result, field, words',
    [
        ({}, 'infer_request', 'has no infer_request'),
        ({'response_loss_mask': [1]}, 'response_loss_mask', 'without response_token_ids'),
        ({'response_token_ids': [1, 2], 'response_loss_mask': [1]}, 'response_loss_mask', 'has 1 values but'),
        ({'rollout_infos': ['not', 'a', 'dict']}, 'rollout_infos', 'must be a dict'),
    ])
def test_bad_step_results_name_uuid_turn_and_field(result, field, words):
    if result:
        result = {'infer_request': None, **result} if field == 'infer_request' else result
    sched = Configurable('r1', result=result if field == 'infer_request' else {**result, 'infer_request': None})
    if field != 'infer_request':
        # a valid request, a bad other field
        class WithRequest(Configurable):

            def step(self, infer_request, response_choice, current_turn):
                if infer_request.uuid == 'r1':
                    return {'infer_request': infer_request, **result}
                return super().step(infer_request, response_choice, current_turn)

        sched = WithRequest('none')
    with pytest.raises(MultiTurnRolloutError) as info:
        run(sched)
    err = info.value
    assert len(err.failures) == 1
    failure = err.failures[0]
    assert (failure.uuid, failure.turn, failure.phase) == ('r1', 1, 'step')
    assert failure.error.field == field
    message = str(failure.error)
    assert message.startswith(f"request r1, turn 1, field '{field}'") and words in message
    # the other requests completed in full; the failed one kept its turn-1 data
    assert [o.rollout_infos['num_turns'] for o in err.outputs] == [3, 1, 3]
    assert err.outputs[1].rollout_infos['mtflow_error']['phase'] == 'step'
    assert err.outputs[1].messages[-1] == {'role': 'assistant', 'content': 'r1-0'}
    assert 'r1' in str(err) and 'turn 1' in str(err)


def test_a_step_that_raises_finishes_only_that_request_with_reason_error(mtflow_trace):
    result, rollout = run(Configurable('r0', raise_in='step'), on_error='return')
    assert result.finish_reasons == ['error', 'max_turns', 'max_turns']
    assert isinstance(result.failures[0].error, ValueError)
    assert 'tool exploded' in result.failures[0].traceback
    # the pytest plugin's fixture sees the same run
    mtflow_trace.assert_path('r0', 'generating -> tool_step -> finished(error)')
    mtflow_trace.assert_path('r1', 'generating -> tool_step -> generating -> tool_step -> generating -> '
                             'finished(max_turns)')
    assert rollout.calls[0] == ['r1', 'r2']


def test_an_async_hook_that_raises_does_not_stop_the_others():
    result, _ = run(Configurable('r2', raise_in='on_turn_end'), on_error='return')
    assert result.finish_reasons == ['max_turns', 'max_turns', 'error']
    assert result.failures[0].phase == 'on_turn_end' and isinstance(result.failures[0].error, KeyError)
    assert result.trace.path('r2') == 'pending -> generating -> finished(error)'


def test_rollout_fn_with_the_wrong_number_of_outputs_names_turn_and_field():

    def rollout(requests, config):
        return [out('x', [1])] * (len(requests) + 1) if requests else []

    ex = mtflow.Executor(Configurable('none'), rollout, max_turns=3)
    with pytest.raises(MultiTurnRolloutError) as info:
        ex.run([req('a'), req('b')], [out('x', [1]), out('y', [2])])
    failure = info.value.failures[0]
    assert failure.turn == 2 and failure.error.field == 'outputs'
    assert 'rollout_fn returned 3 output(s) for 2 request(s)' in str(failure.error)
    assert [o.rollout_infos['num_turns'] for o in info.value.outputs] == [2, 2]


def test_rollout_fn_that_raises_fails_the_requests_it_was_serving():

    def rollout(requests, config):
        if requests:
            raise ConnectionError('engine died')
        return []

    result = mtflow.Executor(Configurable('none'), rollout, max_turns=3, on_error='return').run(
        [req('a')], [out('x', [1], [-.1])])
    assert result.finish_reasons == ['error'] and result.failures[0].phase == 'rollout_fn'
    assert 'engine died' in str(result.failures[0].error)
    # turn 1's data is kept: the step collected its logprobs, the messages have its answer
    assert result.outputs[0].messages[1] == {'role': 'assistant', 'content': 'x'}


def test_continuation_with_none_token_ids_after_segments_is_a_defined_outcome():
    # The original loop raised a TypeError (list.extend(None)); mtflow adds no ids and the logprob
    # check, now short of tokens, drops the logprobs.
    class Tip(Scheduler):

        def step(self, infer_request, response_choice, current_turn):
            infer_request.messages[-1]['content'] += ' tip'
            return {'infer_request': infer_request, 'response_token_ids': [1, 2], 'response_loss_mask': [1, 1]}

    outputs = mtflow.run_multi_turn([req('a')], [out('a', [1, 2], [-.1, -.2])], Tip(),
                                    Counter(lambda r, n: out(' b', None, [-.3])), None, max_turns=2)
    assert outputs[0].response_token_ids == [[1, 2]]
    assert outputs[0].rollout_logprobs == []


def test_step_declared_sync_returning_a_coroutine_gets_a_hint():

    class Wrong(Scheduler):

        def step(self, infer_request, response_choice, current_turn):
            return self._step()

        async def _step(self):
            return {}

    with pytest.raises(MultiTurnRolloutError, match='declare step as async def'):
        run(Wrong(), n=1)


def test_scheduler_without_step_is_rejected_up_front():
    with pytest.raises(TypeError, match='has no step'):
        mtflow.Executor(object(), lambda r, c: [])


def test_illegal_transitions_raise():
    graph = StateGraph()
    record = RequestRecord(0, 'x', None)
    with pytest.raises(IllegalTransition, match="request x: illegal transition 'finish' from state 'pending'"):
        graph.move(record, FINISH, 1)
    assert record.state == 'pending'


def test_first_turn_outputs_of_the_wrong_length_fail_every_request_without_raising_mid_loop():
    rollout = Counter(lambda r, n: out('x'))
    with pytest.raises(MultiTurnRolloutError) as info:
        mtflow.Executor(Configurable('none'), rollout).run([req('a'), req('b')], [out('x', [1])])
    assert {f.uuid for f in info.value.failures} == {'a', 'b'}
    assert len(rollout.calls) == 1 and rollout.calls[0] == []
