"""Tool-call parsers against real-world completions: nested JSON, several calls, broken JSON,
thinking text around calls, OpenAI-style string arguments, ReAct with text or JSON input."""
from __future__ import annotations

import pytest

from mtflow.declarative.parsers import (HermesParser, JSONParser, ReActParser, ToolCallParser, get_parser,
                                        parser_names, register_parser)

QWEN_TWO_CALLS = '''<think>
The user wants the weather in two cities. I should call get_weather twice, e.g. <tool_call> for each.
</think>

I'll look both up.
<tool_call>
{"name": "get_weather", "arguments": {"location": "Paris, FR", "units": {"temp": "celsius", "wind": "kmh"}}}
</tool_call>
<tool_call>
{"name": "get_weather", "arguments": {"location": "Tokyo, JP", "days": [1, 2, 3]}}
</tool_call>'''


def test_hermes_several_calls_nested_json_thinking_ignored():
    calls = HermesParser().parse(QWEN_TWO_CALLS)
    assert [c.name for c in calls] == ['get_weather', 'get_weather']
    assert calls[0].arguments == {'location': 'Paris, FR', 'units': {'temp': 'celsius', 'wind': 'kmh'}}
    assert calls[1].arguments == {'location': 'Tokyo, JP', 'days': [1, 2, 3]}
    assert all(c.error is None for c in calls)


def test_hermes_string_arguments_and_function_wrapper():
    text = ('<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
            '<tool_call>{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}</tool_call>')
    calls = HermesParser().parse(text)
    assert [(c.name, c.arguments) for c in calls] == [('calc', {'expression': '1+1'}), ('f', {'x': 1})]


def test_hermes_broken_json_is_a_call_with_an_error():
    text = ('ok <tool_call>{"name": "calc", "arguments": {"expression": "1+1"}</tool_call> and '
            '<tool_call>{"name": "good", "arguments": {}}</tool_call>')
    bad, good = HermesParser().parse(text)
    assert bad.error and 'invalid JSON' in bad.error and bad.name == ''
    assert good.error is None and good.name == 'good'


def test_hermes_unclosed_call_and_missing_name():
    calls = HermesParser().parse('<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "f", "argu')
    assert calls[0].error == 'the tool call has no "name"'
    assert 'no closing </tool_call>' in calls[1].error


def test_hermes_trailing_text_after_json_is_tolerated():
    calls = HermesParser().parse('<tool_call>{"name": "f", "arguments": {"a": 1}} extra words</tool_call>')
    assert calls[0].arguments == {'a': 1} and calls[0].error is None


def test_hermes_no_call():
    assert HermesParser().parse('The answer is 4.') == []
    assert HermesParser().parse('') == []


def test_react_json_input_up_to_observation():
    text = ('Thought: I need to multiply.\nAction: calculator\nAction Input: {"expression": "12 * (3 + 4)"}\n'
            'Observation: 84\nThought: done')
    (call, ) = ReActParser().parse(text)
    assert call.name == 'calculator' and call.arguments == {'expression': '12 * (3 + 4)'}


def test_react_plain_text_input_and_backticks():
    (call, ) = ReActParser().parse('Thought: x\nAction: `search`\nAction Input: capital of France')
    assert call.name == 'search' and call.arguments == 'capital of France'


def test_react_broken_json_and_action_without_input():
    (call, ) = ReActParser().parse('Action: calculator\nAction Input: {"expression": "1+"')
    assert call.name == 'calculator' and 'invalid JSON' in call.error
    (call, ) = ReActParser().parse('Thought: hmm\nAction: calculator\n')
    assert 'without a following "Action Input:"' in call.error


def test_react_final_answer_is_not_a_call():
    assert ReActParser().parse('Thought: I know it.\nFinal Answer: 42') == []


def test_react_several_actions():
    text = 'Action: a\nAction Input: {"x": 1}\nAction: b\nAction Input: {"y": [1, {"z": 2}]}'
    assert [(c.name, c.arguments) for c in ReActParser().parse(text)] == [('a', {'x': 1}), ('b', {'y': [1, {'z': 2}]})]


def test_json_parser_fenced_list_and_bare_object():
    text = 'Calling:\n```json\n[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": {"n": 1}}}]\n```'
    assert [(c.name, c.arguments) for c in JSONParser().parse(text)] == [('a', {}), ('b', {'k': {'n': 1}})]
    (call, ) = JSONParser().parse('{"name": "c", "arguments": {"q": "x"}}')
    assert call.name == 'c'
    assert JSONParser().parse('no json here') == []
    (bad, ) = JSONParser().parse('{"name": "c", "arguments": {')
    assert bad.error


def test_registry_and_custom_parser():
    class Upper(ToolCallParser):
        name = 'upper_test'

        def parse(self, text):
            return []

    register_parser('upper_test', Upper)
    assert 'upper_test' in parser_names()
    assert isinstance(get_parser('upper_test'), Upper)
    assert isinstance(get_parser('qwen'), HermesParser)
    with pytest.raises(KeyError, match='unknown parser'):
        get_parser('nope')


def test_render_tools_formats():
    tools = [{'type': 'function', 'function': {'name': 'calc', 'description': 'math', 'parameters': {}}}]
    assert '<tools>' in HermesParser().render_tools(tools) and '"calc"' in HermesParser().render_tools(tools)
    assert 'Action: the tool to use, one of [calc]' in ReActParser().render_tools(tools)
