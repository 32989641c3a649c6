"""The multi-turn driver contract, case by case (docs/contract.md), through ``mtflow.run_multi_turn``."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest

import mtflow
from mtflow import Scheduler
from mtflow.core.protocol import RolloutInferRequest, RolloutOutput
from tests.helpers import Counter, Scripted, out, req


class Observe(Scheduler):
    """Every step adds a user observation (the next turn is a new assistant message)."""

    def __init__(self, extra: Dict[str, Any] = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.extra = extra or {}
        self.steps: List[tuple] = []

    def step(self, infer_request, response_choice, current_turn):
        self.steps.append((infer_request.uuid, current_turn))
        infer_request.messages.append({'role': 'user', 'content': f'observation {current_turn}'})
        return {'infer_request': infer_request, **self.extra}


class Tip(Scheduler):
    """Every step appends a tip to the assistant message (the next turn continues it) and returns
    the turn's ids followed by the tip's ids with mask 0, as ms-swift's MathTipsScheduler does."""
    TIP_IDS = [90, 91]

    def __init__(self, with_ids: bool = True, **kw: Any) -> None:
        super().__init__(**kw)
        self.with_ids = with_ids

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages[-1]['content'] += ' <tip>'
        result = {'infer_request': infer_request}
        if self.with_ids:
            ids = list(response_choice.token_ids) + self.TIP_IDS
            result['response_token_ids'] = ids
            result['response_loss_mask'] = [1] * len(response_choice.token_ids) + [0] * len(self.TIP_IDS)
            result['rollout_logprobs'] = [c['logprob'] for c in response_choice.logprobs['content']]
        return result


def run(requests, script, scheduler, max_turns=None, first=None):
    rollout = Scripted({u: outs[1:] for u, outs in script.items()})
    first = first if first is not None else [script[r.uuid][0] for r in requests]
    outputs = mtflow.run_multi_turn(requests, first, scheduler, rollout, None, max_turns=max_turns)
    return outputs, rollout


def test_new_message_each_turn_and_logprobs_replaced_by_the_first_ids():
    # Steps return no ids: the choice's logprobs are collected per turn, but when the request stops
    # with no id segment yet, its ids become the first segment and its logprobs replace the rest.
    r = req('a')
    outputs, rollout = run([r], {'a': [out('one', [1, 2, 3], [-.1, -.2, -.3]), out('two', [4, 5], [-.4, -.5])]},
                           Observe(max_turns=2))
    o = outputs[0]
    assert o.response_token_ids == [[4, 5]]
    assert o.response_loss_mask == [[1, 1]]
    assert o.rollout_logprobs == [[-.4, -.5]]
    assert o.rollout_infos == {'num_turns': 2}
    assert [m['role'] for m in o.messages] == ['user', 'assistant', 'user', 'assistant']
    assert o.messages[1]['content'] == 'one' and o.messages[3]['content'] == 'two'
    assert o.response.choices[0].message.content == 'two'  # the last turn's response
    assert rollout.calls == [['a'], []]  # one call per turn, plus the last empty one


def test_continuation_with_earlier_segments_extends_the_last_segment():
    r = req('a')
    outputs, _ = run([r], {'a': [out('first', [1, 2, 3], [-.1, -.2, -.3]), out(' more', [4, 5], [-.4, -.5])]},
                     Tip(max_turns=2))
    o = outputs[0]
    assert o.messages[-1] == {'role': 'assistant', 'content': 'first <tip> more'}
    assert len(o.messages) == 2
    assert o.response_token_ids == [[1, 2, 3, 90, 91, 4, 5]]
    assert o.response_loss_mask == [[1, 1, 1, 0, 0, 1, 1]]
    assert o.rollout_logprobs == [[-.1, -.2, -.3, -.4, -.5]]  # 5 logprobs == five 1s: kept


def test_continuation_without_earlier_segments_starts_the_first_segment():
    r = req('a')
    outputs, _ = run([r], {'a': [out('first', [1, 2, 3], [-.1, -.2, -.3]), out(' more', [4, 5], [-.4, -.5])]},
                     Tip(with_ids=False, max_turns=2))
    o = outputs[0]
    assert o.messages[-1]['content'] == 'first <tip> more'
    assert o.response_token_ids == [[4, 5]]
    assert o.response_loss_mask == [[1, 1]]
    assert o.rollout_logprobs == [[-.4, -.5]]


def test_new_segment_after_earlier_segments():
    class IdsThenObserve(Observe):

        def step(self, infer_request, response_choice, current_turn):
            result = super().step(infer_request, response_choice, current_turn)
            result['response_token_ids'] = list(response_choice.token_ids)
            result['response_loss_mask'] = [1] * len(response_choice.token_ids)
            return result

    outputs, _ = run([req('a')], {'a': [out('x', [1, 2], [-.1, -.2]), out('y', [3], [-.3])]},
                     IdsThenObserve(max_turns=2))
    o = outputs[0]
    assert o.response_token_ids == [[1, 2], [3]]
    assert o.response_loss_mask == [[1, 1], [1]]
    assert o.rollout_logprobs == [[-.1, -.2], [-.3]]


def test_placeholder_assistant_message_is_removed():
    r = req('a', {'role': 'user', 'content': 'q'}, {'role': 'assistant', 'content': None})
    outputs, _ = run([r], {'a': [out('answer', [1], [-.1])]}, Observe(max_turns=1))
    assert outputs[0].messages == [{'role': 'user', 'content': 'q'}, {'role': 'assistant', 'content': 'answer'}]


def test_placeholder_returned_by_a_step_is_removed_and_the_turn_is_not_a_continuation():

    class Placeholder(Scheduler):

        def step(self, infer_request, response_choice, current_turn):
            infer_request.messages.append({'role': 'user', 'content': 'obs'})
            infer_request.messages.append({'role': 'assistant', 'content': None})
            return {'infer_request': infer_request}

    ex = mtflow.Executor(Placeholder(), Scripted({'a': [out('second', [2], [-.2])]}), max_turns=2)
    result = ex.run([req('a')], [out('first', [1], [-.1])])
    msgs = result.outputs[0].messages
    assert msgs[-2:] == [{'role': 'user', 'content': 'obs'}, {'role': 'assistant', 'content': 'second'}]
    assert result.trace.states('a') == ['pending', 'generating', 'tool_step', 'generating', 'finished']


class Hooked(Observe):

    def __init__(self, done: Any, checked: bool, **kw: Any) -> None:
        super().__init__(**kw)
        self.done, self.checked = done, checked
        self.check_calls = 0

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        return {} if self.done is None else {'done': self.done}

    def check_finished(self, infer_request, response_choice, current_turn):
        self.check_calls += 1
        return self.checked


def test_done_overrides_check_finished_which_is_still_called(mtflow_trace):
    # check_finished says stop, on_turn_end says go on: the request goes on until max_turns.
    sched = Hooked(done=False, checked=True)
    ex = mtflow.Executor(sched, Counter(lambda r, n: out(f't{n}', [n], [-.5])), max_turns=3)
    result = ex.run([req('a'), req('b')], [out('t0', [0], [-.5]), out('t0', [0], [-.5])])
    assert sched.check_calls == 6  # two requests x three turns
    mtflow_trace.assert_path('b', 'generating -> tool_step -> generating -> tool_step -> generating -> '
                             'finished(max_turns)')
    assert result.finish_reasons == ['max_turns', 'max_turns']
    assert [o.rollout_infos['num_turns'] for o in result.outputs] == [3, 3]

    # and the other way round: done=True stops although check_finished says go on
    sched = Hooked(done=True, checked=False)
    result = mtflow.Executor(sched, Counter(lambda r, n: out('x', [1])), max_turns=5).run([req('a')], [out('x', [1])])
    assert sched.check_calls == 1
    assert result.finish_reasons == ['done_by_hook']


def test_check_finished_stops_when_no_done_key():
    sched = Hooked(done=None, checked=True)
    result = mtflow.Executor(sched, Counter(lambda r, n: out('x'))).run([req('a')], [out('x', [1])])
    assert result.finish_reasons == ['check_finished'] and sched.steps == []


def test_default_check_finished_stops_on_length_and_on_the_schedulers_max_turns():
    result = mtflow.Executor(Observe(), Counter(lambda r, n: out('x', [1], finish_reason='length'))).run(
        [req('a')], [out('x', [1])])
    assert result.finish_reasons == ['length'] and result.outputs[0].rollout_infos['num_turns'] == 2
    result = mtflow.Executor(Observe(max_turns=2), Counter(lambda r, n: out('x', [1]))).run([req('a')], [out('x', [1])])
    assert result.finish_reasons == ['max_turns'] and result.outputs[0].rollout_infos['num_turns'] == 2


@pytest.mark.parametrize('max_turns, expected_turns', [(None, 4), (0, 4), (1, 1), (3, 3)])
def test_max_turns(max_turns, expected_turns):

    class StopAtFour(Observe):

        def check_finished(self, infer_request, response_choice, current_turn):
            return current_turn >= 4

    rollout = Counter(lambda r, n: out(f'turn {n + 1}', [n + 1], [-.1]))
    outputs = mtflow.run_multi_turn([req('a')], [out('turn 1', [1], [-.1])], StopAtFour(), rollout, None,
                                    max_turns=max_turns)
    assert outputs[0].rollout_infos['num_turns'] == expected_turns
    assert len(rollout.calls) == expected_turns  # calls after turns 1..n-1, plus the final empty call


@pytest.mark.parametrize(
    'first, last, expected',
    [
        # kept: ids [1,2] x mask [[1,1]] and 2 logprobs
        (out('a', [9], [-.9]), out('b', [1, 2], [-.1, -.2]), [[-.1, -.2]]),
        # mismatched: 3 logprobs for 2 tokens
        (out('a', [9], [-.9]), out('b', [1, 2], [-.1, -.2, -.3]), []),
        # missing: no logprobs at all
        (out('a', [9], lp_shape='none'), out('b', [1, 2], lp_shape='none'), []),
        # logprobs dict without 'content' counts as none
        (out('a', [9], lp_shape='nocontent'), out('b', [1, 2], lp_shape='nocontent'), []),
    ])
def test_logprob_check(first, last, expected):
    outputs, _ = run([req('a')], {'a': [first, last]}, Observe(max_turns=2))
    assert outputs[0].rollout_logprobs == expected


def test_logprobs_without_any_ids_are_dropped():
    outputs, _ = run([req('a')], {'a': [out('a', None, [-.1]), out('b', None, [-.2])]}, Observe(max_turns=2))
    o = outputs[0]
    assert o.response_token_ids == [] and o.response_loss_mask == []
    assert o.rollout_logprobs == []


def test_logprobs_checked_against_ids_when_there_is_no_mask():

    class IdsNoMask(Observe):

        def step(self, infer_request, response_choice, current_turn):
            result = super().step(infer_request, response_choice, current_turn)
            result['response_token_ids'] = list(response_choice.token_ids)
            return result

    # turn 1: ids [1,2] (no mask) and logprobs [-.1,-.2]; turn 2 stops with no ids: 2 ids == 2 logprobs.
    outputs, _ = run([req('a')], {'a': [out('a', [1, 2], [-.1, -.2]), out('b', None, None)]}, IdsNoMask(max_turns=2))
    o = outputs[0]
    assert o.response_token_ids == [[1, 2]] and o.response_loss_mask == []
    assert o.rollout_logprobs == [[-.1, -.2]]


def test_step_result_fields_ids_mask_logprobs_infos():

    class Full(Observe):

        def step(self, infer_request, response_choice, current_turn):
            result = super().step(infer_request, response_choice, current_turn)
            result.update(
                response_token_ids=[7, 8, 9],
                response_loss_mask=[1, 0, 1],
                rollout_logprobs=[-.7, -.9],  # preferred over the choice's logprobs
                rollout_infos={'turn_seen': current_turn, 'kept': 'step'})
            return result

        async def on_turn_end(self, infer_request, response_choice, current_turn):
            return {'rollout_infos': {'hook': current_turn}}

    outputs, _ = run([req('a')], {'a': [out('a', [1, 2], [-.1, -.2]), out('b', [3], [-.3])]}, Full(max_turns=2))
    o = outputs[0]
    assert o.response_token_ids == [[7, 8, 9], [3]]
    assert o.response_loss_mask == [[1, 0, 1], [1]]
    assert o.rollout_logprobs == [[-.7, -.9], [-.3]]
    assert o.rollout_infos == {'turn_seen': 1, 'kept': 'step', 'hook': 2, 'num_turns': 2}


def test_empty_step_logprobs_fall_back_to_the_choice():

    class EmptyLps(Observe):

        def step(self, infer_request, response_choice, current_turn):
            result = super().step(infer_request, response_choice, current_turn)
            result['rollout_logprobs'] = []
            return result

    outputs, _ = run([req('a')], {'a': [out('a', [1], [-.1]), out('b', None, None)]}, EmptyLps(max_turns=2))
    # the choice's logprob was collected, but no ids or mask ever arrived: dropped by the check
    assert outputs[0].rollout_logprobs == []


def test_step_returning_a_new_request_object_replaces_it_in_the_input_list():

    class NewRequest(Scheduler):

        def step(self, infer_request, response_choice, current_turn):
            messages = [dict(m) for m in infer_request.messages] + [{'role': 'user', 'content': 'fresh'}]
            return {'infer_request': RolloutInferRequest(messages=messages, uuid=infer_request.uuid,
                                                         data_dict={'turn': current_turn})}

    requests = [req('a'), req('b')]
    originals = list(requests)
    rollout = Counter(lambda r, n: out('second', [2]))
    outputs = mtflow.run_multi_turn(requests, [out('first', [1]), out('first', [1])], NewRequest(), rollout, None,
                                    max_turns=2)
    assert requests[0] is not originals[0] and requests[0].data_dict == {'turn': 1}
    assert outputs[0].messages == requests[0].messages
    assert [m['content'] for m in outputs[0].messages] == ['question a', 'first', 'fresh', 'second']
    assert len(originals[0].messages) == 2  # the old request only got turn 1's answer


def test_one_output_per_request_in_input_order_with_different_lengths():
    sched = Observe()
    sched.check_finished = lambda r, c, t: t >= int(r.uuid[1:])
    requests = [req(f'r{n}') for n in (3, 1, 2)]
    rollout = Counter(lambda r, n: out(f'{r.uuid}-{n + 1}', [n + 1]))
    outputs = mtflow.run_multi_turn(requests, [out(f'{r.uuid}-1', [1]) for r in requests], sched, rollout, None)
    assert [o.rollout_infos['num_turns'] for o in outputs] == [3, 1, 2]
    assert [o.messages[-1]['content'] for o in outputs] == ['r3-3', 'r1-1', 'r2-2']
    assert rollout.calls == [['r3', 'r2'], ['r3'], []]  # only live requests, in input order


def test_outputs_use_the_class_of_the_first_turn_outputs():

    class MyOutput(RolloutOutput):
        pass

    first = MyOutput(**out('x', [1]).model_dump())
    outputs = mtflow.run_multi_turn([req('a')], [first], Observe(max_turns=1), Counter(lambda r, n: out('y')), None)
    assert type(outputs[0]) is MyOutput


def test_rollout_infos_keep_exactly_the_contract_keys_with_tracing_on():
    ex = mtflow.Executor(Observe(max_turns=2), Counter(lambda r, n: out('y', [2])), trace=True)
    result = ex.run([req('a')], [out('x', [1])])
    assert result.outputs[0].rollout_infos == {'num_turns': 2}
    assert result.trace.path('a') == 'pending -> generating -> tool_step -> generating -> finished(max_turns)'
    off = mtflow.Executor(Observe(max_turns=2), Counter(lambda r, n: out('y', [2])), trace=False).run(
        [req('a')], [out('x', [1])])
    assert off.trace is None
    assert off.outputs[0].model_dump(exclude={'response'}) == result.outputs[0].model_dump(exclude={'response'})
