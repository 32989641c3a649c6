"""A call cut off by ``max_tokens`` is malformed and never run (whatever ``on_length`` says); a
call in a format the scheduler does not read gets an error observation naming both formats; a
parse error names the format expected."""
from __future__ import annotations

from mtflow import Executor
from mtflow.declarative import load_scheduler
from tests.helpers import Scripted, req

from .util import model_out, tok

ME = __name__
RAN = []


def record(code: str) -> str:
    """Record a call.

    Args:
        code: anything
    """
    RAN.append(code)
    return 'ran'


def scheduler(**kw):
    cfg = {'name': 'trunc', 'parser': kw.pop('parser', 'hermes'),
           'tools': [{'name': 'python', 'impl': f'{ME}:record'}], 'max_turns': 3}
    cfg.update(kw)
    return load_scheduler(cfg, tokenizer=tok())


def run(s, texts, finish_reasons=None):
    finish_reasons = finish_reasons or ['stop'] * len(texts)
    outs = [model_out(t, finish_reason=f) for t, f in zip(texts, finish_reasons)]
    return Executor(s, Scripted({'a': outs})).run([req('a')])


CUT = 'Let me run it.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(sum(range(10)))"}}'


def test_truncated_call_is_not_run_with_on_length_false():
    RAN.clear()
    s = scheduler(stop={'on_length': False})
    res = run(s, [CUT, 'done'], ['length', 'stop'])
    o = res.outputs[0]
    assert RAN == []  # never executed
    assert o.messages[2]['role'] == 'tool' and 'cut off by the token limit' in o.messages[2]['content']
    assert o.rollout_infos['tool_error_kinds'] == {'parse': 1}
    assert res.finish_reasons == ['stop_rule:no_tool_call']


def test_truncated_call_stops_with_length_by_default():
    RAN.clear()
    res = run(scheduler(), [CUT], ['length'])
    assert RAN == [] and res.finish_reasons == ['length']


def test_unclosed_call_of_a_reply_that_stopped_normally_still_runs():
    """A stop string (``</tool_call>``) may have eaten the closing tag: the JSON is whole, so it runs."""
    RAN.clear()
    res = run(scheduler(), [CUT, 'done'])
    assert RAN == ['print(sum(range(10)))']
    assert res.outputs[0].messages[2] == {'role': 'tool', 'name': 'python', 'content': 'ran',
                                          'tool_call_id': res.outputs[0].messages[2]['tool_call_id']}


def test_call_in_another_format_gets_feedback_not_silence():
    RAN.clear()
    mistral = '[TOOL_CALLS] [{"name": "python", "arguments": {"code": "1"}}]'
    res = run(scheduler(), [mistral, 'ok'])
    o = res.outputs[0]
    assert RAN == []
    text = o.messages[2]['content']
    assert 'looks like a mistral tool call' in text and 'reads the hermes format' in text
    assert '<tool_call>' in text  # the expected format is shown to the model
    assert res.finish_reasons == ['stop_rule:no_tool_call'] and o.rollout_infos['num_turns'] == 2


def test_plain_answer_is_not_mistaken_for_a_call():
    res = run(scheduler(), ['The answer is {"x": 1}.'])
    assert res.finish_reasons == ['stop_rule:no_tool_call'] and res.outputs[0].rollout_infos['tool_calls'] == 0


def test_parse_error_names_the_expected_format():
    res = run(scheduler(parser='react', observation={'mode': 'message', 'role': 'user'}),
              ['Action: python\nAction Input: {"code": "1"', 'ok'])
    text = res.outputs[0].messages[2]['content']
    assert 'invalid JSON' in text and 'react format' in text and 'Action Input:' in text


def test_other_formats_run_end_to_end():
    RAN.clear()
    outs = {
        'llama3_json': '<|python_tag|>{"name": "python", "parameters": {"code": "a"}}<|eom_id|>',
        'mistral': '[TOOL_CALLS]python[ARGS]{"code": "b"}',
        'deepseek': '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>python\n```json\n{"code": "c"}\n```'
                    '<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        'pythonic': '[python(code="d")]',
    }
    for parser, text in outs.items():
        res = run(scheduler(parser=parser), [text, 'done'])
        assert res.finish_reasons == ['stop_rule:no_tool_call'], parser
    assert RAN == ['a', 'b', 'c', 'd']
