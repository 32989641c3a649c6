"""The scripted backend: outputs replayed from a JSONL file, keyed by request and turn or in order."""
import json

import pytest

from mtflow import Executor, RequestConfig, RolloutInferRequest, Scheduler
from mtflow.backends import BackendError, make_backend
from mtflow.backends.scripted import ScriptedBackend


def _write(path, *lines):
    path.write_text(''.join((l if isinstance(l, str) else json.dumps(l)) + '\n' for l in lines))
    return path


def _req(uuid):
    return RolloutInferRequest(messages=[{'role': 'user', 'content': 'q'}], uuid=uuid)


def test_lines_replay_in_order_with_ids_logprobs_and_reasons(tmp_path):
    script = _write(tmp_path / 's.jsonl', {'content': 'one', 'token_ids': [1, 2], 'logprobs': [-0.5, -0.25],
                                           'tokens': ['o', 'ne']}, '"two"',
                    {'content': 'three', 'finish_reason': 'length'})
    backend = make_backend('scripted', model=str(script))
    outs = backend([_req('a'), _req('b')], RequestConfig(logprobs=True))
    first = outs[0].response.choices[0]
    assert first.message.content == 'one' and first.token_ids == [1, 2] and first.finish_reason == 'stop'
    assert first.logprobs == {'content': [{'token': 'o', 'logprob': -0.5}, {'token': 'ne', 'logprob': -0.25}]}
    second = outs[1].response.choices[0]
    assert second.message.content == 'two' and second.token_ids is None and second.logprobs is None
    third = backend([_req('a')], RequestConfig())[0].response.choices[0]
    assert third.finish_reason == 'length'
    assert backend.stats.completion_tokens == 2 and backend.stats.calls == 2
    with pytest.raises(BackendError, match=r"ran out of outputs at request 'c', turn 1"):
        backend([_req('c')], RequestConfig())


def test_logprobs_only_when_asked(tmp_path):
    script = _write(tmp_path / 's.jsonl', {'content': 'x', 'token_ids': [3], 'logprobs': [-1.0]})
    assert make_backend('scripted', model=str(script))([_req('a')])[0].response.choices[0].logprobs is None


def test_keyed_lines_answer_their_request_and_turn(tmp_path):
    script = _write(tmp_path / 's.jsonl', {'uuid': 'b', 'turn': 2, 'content': 'b2'},
                    {'uuid': 'b', 'content': 'b-any'}, {'content': 'free'})
    backend = ScriptedBackend(script)
    assert [o.response.choices[0].message.content for o in backend([_req('a'), _req('b')])] == ['free', 'b-any']
    assert backend([_req('b')])[0].response.choices[0].message.content == 'b2'


def test_cycle_repeats_the_unkeyed_lines():
    backend = ScriptedBackend(outputs=['x', 'y'], cycle=True)
    texts = [o.response.choices[0].message.content for o in backend([_req(str(i)) for i in range(5)])]
    assert texts == ['x', 'y', 'x', 'y', 'x']


@pytest.mark.parametrize('line, message', [
    ('{"content": 1}', r's\.jsonl:2: each line needs a string "content"'),
    ('{"content": "a", "finish_reason": "eos"}', r's\.jsonl:2: finish_reason must be'),
    ('{"content": "a", "token_ids": ["x"]}', r's\.jsonl:2: token_ids must be a list of ints'),
    ('{nope', r's\.jsonl:2: not valid JSON'),
])
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    script = _write(tmp_path / 's.jsonl', '"fine"', line)
    with pytest.raises(BackendError, match=message):
        ScriptedBackend(script)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(BackendError, match='file not found'):
        ScriptedBackend(tmp_path / 'none.jsonl')


class _TwoTurns(Scheduler):

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'again'})
        return {'infer_request': infer_request}


def test_drives_the_executor_turn_by_turn(tmp_path):
    script = _write(tmp_path / 's.jsonl', {'uuid': 'a', 'turn': 1, 'content': 'a1', 'token_ids': [1]},
                    {'uuid': 'a', 'turn': 2, 'content': 'a2', 'token_ids': [2, 3], 'logprobs': [-1, -2]})
    result = Executor(_TwoTurns(), ScriptedBackend(script), RequestConfig(logprobs=True), max_turns=2).run([_req('a')])
    out = result.outputs[0]
    assert [m['content'] for m in out.messages] == ['q', 'a1', 'again', 'a2']
    assert out.response_token_ids == [[2, 3]] and out.rollout_logprobs == [[-1, -2]]
    assert result.finish_reasons == ['max_turns']
