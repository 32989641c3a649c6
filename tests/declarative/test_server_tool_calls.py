"""Structured tool calls from a server drive a YAML scheduler exactly as calls in text do.

A real HTTP server (``tests/backends/chat_server.py``) answers chat completions with a scripted
"model" that calls the calculator and then answers; once as ``vllm serve --enable-auto-tool-choice
--tool-call-parser hermes`` does (the calls as OpenAI ``tool_calls``, ``content`` null), once with
the calls in the text. ``mtflow run`` with a hermes YAML scheduler gives the same trajectories
both ways: tool results, rewards, answers, the ids the model sampled, and the conversation as a
chat template that renders ``tool_calls`` shows it to the model. (Before, the structured run
stopped every request at turn 1 with ``stop_rule:no_tool_call``, exit 0.)"""
import json
import re

import pytest

pytest.importorskip('httpx')
pytest.importorskip('transformers')

from mtflow import Executor, RequestConfig, RolloutInferRequest  # noqa: E402
from mtflow.backends.scripted import ScriptedBackend  # noqa: E402
from mtflow.cli import main  # noqa: E402
from mtflow.core.protocol import (ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage,  # noqa: E402
                                  RolloutOutput)
from mtflow.core.trace import Trace  # noqa: E402
from mtflow.declarative import load_scheduler  # noqa: E402
from mtflow.run.trajectories import read_trajectories  # noqa: E402
from tests.backends.chat_server import ChatServer  # noqa: E402
from tests.tiny_model import make_tokenizer  # noqa: E402

SCHEDULER = r'''
name: calc
max_turns: 4
parser: hermes
tools:
  - name: calculator
    reward: {ok: 0.1, error: -0.5}
answer: {pattern: 'The answer is (\S+?)\.$', field: solution, compare: numeric}
stop: {correct_answer: true}
reward: rewards.py:score
'''
REWARDS = '''
def score(infer_request, infos):
    return 1.0 if infos.get('answer_correct') else 0.0
'''
PROMPTS = [('q1', 'What is 2 + 3 * 4?', 14), ('q2', 'What is (1 + 2) * 3?', 9), ('q3', 'Say hi.', None)]
#: renders tool_calls as Qwen2.5's template does (the text run's model writes exactly this form)
HERMES_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def call_text(expression):
    return f'<tool_call>\n{{"name": "calculator", "arguments": {json.dumps({"expression": expression})}}}\n</tool_call>'


def respond(request):
    """The scripted model: calls the calculator on the question's expression, then answers with
    the tool's result; a question without one is answered at once (no call)."""
    last = request.messages[-1]
    if last['role'] == 'tool':
        return f'The answer is {last["content"]}.'
    question = re.search(r'What is (.+)\?', last['content'])
    return call_text(question.group(1)) if question else 'Hi there.'


def serve(**kw):
    return ChatServer(ScriptedBackend(respond=respond, tokenizer=make_tokenizer()), model_name='calc-model', **kw)


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'calc.yaml').write_text(SCHEDULER)
    (tmp_path / 'rewards.py').write_text(REWARDS)
    lines = [{'uuid': u, 'prompt': q, 'data_dict': {'solution': s}} for u, q, s in PROMPTS]
    (tmp_path / 'prompts.jsonl').write_text(''.join(json.dumps(l) + '\n' for l in lines))
    return tmp_path


def run(server, out):
    config = (f'scheduler: calc.yaml\nbackend: openai\nmodel: calc-model\ndataset: prompts.jsonl\nout: {out}\n'
              f'backend_options: {{base_url: "{server.base_url}", flavor: vllm, prompt_mode: chat}}\n'
              'request_config: {max_tokens: 64, temperature: 0}\n')
    path = f'{out}.yaml'
    with open(path, 'w') as f:
        f.write(config)
    with pytest.warns(UserWarning, match='chat completions re-render'):
        assert main(['run', path, '--no-progress', '-q']) == 0
    return read_trajectories(f'{out}/trajectories.jsonl'), Trace.read_jsonl(f'{out}/trace.jsonl')


def rendered(messages):
    tok = make_tokenizer()
    return tok.apply_chat_template(messages, chat_template=HERMES_TEMPLATE, tokenize=False)


def test_structured_tool_calls_give_the_trajectories_of_calls_in_text(project):
    with serve(tool_call_parser='hermes') as server:
        structured, structured_trace = run(server, 'structured')
        sent_back = [(m, b['messages'][k + 1]) for b in server.bodies for k, m in enumerate(b['messages'])
                     if m.get('tool_calls')]
    with serve() as server:
        text, text_trace = run(server, 'text')
    assert set(structured) == set(text) == {'q1', 'q2', 'q3'}
    for uuid in structured:
        s, t = structured[uuid], text[uuid]
        assert s.finish_reason == t.finish_reason
        assert s.rollout_infos['reward'] == t.rollout_infos['reward']
        for key in ('tool_calls', 'tool_errors', 'answer', 'answer_correct', 'turn_rewards'):
            assert s.rollout_infos.get(key) == t.rollout_infos.get(key), key
        assert s.response_token_ids == t.response_token_ids, 'the ids the model sampled, calls included'
        tools = [[(m['role'], m['name'], m['content']) for m in x.messages if m['role'] == 'tool'] for x in (s, t)]
        assert tools[0] == tools[1]
        assert rendered(s.messages) == rendered(t.messages), 'the model is shown the same conversation'
    q1 = structured['q1']
    assert q1.finish_reason == 'stop_rule:correct_answer' and q1.rollout_infos['reward'] == 1.0
    assert q1.rollout_infos['tool_calls'] == 1 and q1.rollout_infos['tool_errors'] == 0
    call, result = q1.messages[-3], q1.messages[-2]
    assert call['content'] == '' and call['tool_calls'][0]['function'] == {
        'name': 'calculator', 'arguments': json.dumps({'expression': '2 + 3 * 4'})}
    assert result == {'role': 'tool', 'content': '14', 'name': 'calculator',
                      'tool_call_id': call['tool_calls'][0]['id']}
    # the next turn sends the call and its answer back in OpenAI's shape
    assert sent_back and all(answer['tool_call_id'] == call['tool_calls'][0]['id'] for call, answer in sent_back)
    # a reply with neither a structured call nor one in text still stops as before
    assert structured['q3'].finish_reason == text['q3'].finish_reason == 'stop_rule:no_tool_call'
    # the trace says where the calls came from
    steps = [e for e in structured_trace if e.uuid == 'q1' and (e.extra or {}).get('calls')]
    assert steps and steps[0].extra['tool_calls_from'] == 'server' and 'text_calls_ignored' not in steps[0].extra
    assert not any('tool_calls_from' in (e.extra or {}) for e in text_trace)


def _output(content, tool_calls=None, ids=(5, 6)):
    message = ChatMessage(content=content, tool_calls=tool_calls)
    return RolloutOutput(response=ChatCompletionResponse(model='m', choices=[ChatCompletionResponseChoice(
        message=message, finish_reason='stop', token_ids=list(ids))]))


def _calc_call(expression, id_='c1', arguments=None):
    arguments = json.dumps({'expression': expression}) if arguments is None else arguments
    return {'id': id_, 'type': 'function', 'function': {'name': 'calculator', 'arguments': arguments}}


def _run(outputs, tmp_path):
    (tmp_path / 'calc.yaml').write_text(SCHEDULER.replace('reward: rewards.py:score\n', ''))
    replies = iter(outputs)
    result = Executor(load_scheduler(str(tmp_path / 'calc.yaml')), lambda reqs, cfg=None: [next(replies) for _ in reqs],
                      RequestConfig(max_tokens=32)).run(
        [RolloutInferRequest(messages=[{'role': 'user', 'content': 'What is 2 + 3 * 4?'}], uuid='u', data_dict={
            'solution': 14})])
    return result.outputs[0], result.trace


def test_structured_calls_win_over_calls_in_the_text_and_the_trace_says_so(tmp_path):
    """A server that returns the calls both structured and in ``content``: each call runs once."""
    out, trace = _run([_output(call_text('2 + 3 * 4'), [_calc_call('2 + 3 * 4')]), _output('The answer is 14.')],
                      tmp_path)
    assert out.rollout_infos['tool_calls'] == 1 and trace.finish_reason('u') == 'stop_rule:correct_answer'
    assert [m['content'] for m in out.messages if m['role'] == 'tool'] == ['14']
    step = next(e for e in trace if (e.extra or {}).get('calls'))
    assert step.extra['tool_calls_from'] == 'server' and step.extra['text_calls_ignored'] == 1


def test_a_malformed_structured_call_is_fed_back_not_run(tmp_path):
    out, _ = _run([_output('', [_calc_call('', arguments='{"expression": "2 +')]), _output('The answer is 14.')],
                  tmp_path)
    tool = next(m for m in out.messages if m['role'] == 'tool')
    assert tool['tool_call_id'] == 'c1' and tool['content'].startswith('Error: could not parse the tool call: the '
                                                                       'arguments are not valid JSON')
    assert 'hermes format' not in tool['content'], 'the server wrote the call: no text format to quote'
    assert out.rollout_infos['tool_error_kinds'] == {'parse': 1}


def test_streamed_tool_call_pieces_are_joined():
    """A streamed chat reply (``resumable=True``) carries its calls as ``delta.tool_calls`` pieces:
    the id and name first, the JSON arguments in parts; they are joined into the reply's calls."""
    from mtflow.backends.openai_stream import StreamedReply

    reply = StreamedReply("request 'u'", token_mode=False, prefix=None)
    pieces = [{'index': 0, 'id': 'chatcmpl-tool-9', 'type': 'function', 'function': {'name': 'calculator',
                                                                                     'arguments': ''}},
              {'index': 0, 'function': {'arguments': '{"expression": '}},
              {'index': 0, 'function': {'arguments': '"2 + 3 * 4"}'}},
              {'index': 1, 'type': 'function', 'function': {'name': 'calculator', 'arguments': '{}'}}]
    for k, piece in enumerate(pieces):
        event = {'choices': [{'index': 0, 'delta': {'tool_calls': [piece]}, 'token_ids': [k],
                              'finish_reason': 'tool_calls' if k == len(pieces) - 1 else None}]}
        reply.feed('data: ' + json.dumps(event))
    message = reply.output().response.choices[0].message
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ('chatcmpl-tool-9', 'calculator', '{"expression": "2 + 3 * 4"}'), ('call_1', 'calculator', '{}')]



@pytest.mark.parametrize('field', ['reasoning', 'reasoning_content'])
def test_streamed_reasoning_pieces_are_the_replys_reasoning(field):
    """Streamed (``resumable=True``), a server's reasoning comes as ``delta.reasoning`` pieces (vLLM >= 0.11;
    ``reasoning_content`` before) before the content's: joined, they are the reply's ``reasoning_content``."""
    from mtflow.backends.openai_stream import StreamedReply

    reply = StreamedReply("request 'u'", token_mode=False, prefix=None)
    deltas = [{field: 'I will '}, {field: 'compute it.'}, {'content': 'It is '}, {'content': '14.'}]
    for k, delta in enumerate(deltas):
        event = {'choices': [{'index': 0, 'delta': delta, 'token_ids': [k],
                              'finish_reason': 'stop' if k == len(deltas) - 1 else None}]}
        reply.feed('data: ' + json.dumps(event))
    message = reply.output().response.choices[0].message
    assert (message.reasoning_content, message.content) == ('I will compute it.', 'It is 14.')

def thinking(request):
    """The scripted model of a template that opens <think> in its prompt: its thinking, </think>, then the reply."""
    thought = 'I have the result.' if request.messages[-1]['role'] == 'tool' else 'I will compute it.'
    return f'{thought}</think>\n{respond(request)}'


@pytest.mark.parametrize('field', ['reasoning', 'reasoning_content'])
def test_a_server_that_splits_the_reasoning_keeps_it_and_its_content_is_read_as_content(project, field):
    """vllm serve --reasoning-parser: the reply's reasoning comes as message.reasoning (vLLM >= 0.11;
    reasoning_content before) and content holds no tag. The trajectory keeps the server's reasoning, and mtflow's
    own split (the template opens <think> here: an untagged reply would be all thinking) leaves the content alone.
    (Before: the reasoning was dropped and the content read as thinking, so no call ran and no answer counted.)"""
    (project / 'calc.yaml').write_text(SCHEDULER + 'reasoning: {parser: think, opened_in_prompt: true}\n')
    with ChatServer(ScriptedBackend(respond=thinking, tokenizer=make_tokenizer()), model_name='calc-model',
                    reasoning_field=field) as server:
        lines, _ = run(server, 'split')
        assert all('</think>' not in (m.get('content') or '') for b in server.bodies for m in b.get('messages', []))
    q1 = lines['q1']
    assert q1.finish_reason == 'stop_rule:correct_answer' and q1.rollout_infos['reward'] == 1.0
    assert q1.rollout_infos['tool_calls'] == 1 and q1.rollout_infos['answer'] == '14'
    call, result, answer = q1.messages[-3:]
    assert call['reasoning_content'] == 'I will compute it.' and call_text('2 + 3 * 4') in call['content']
    assert result['content'] == '14'
    assert answer == {'role': 'assistant', 'content': '\nThe answer is 14.', 'reasoning_content': 'I have the result.'}
    assert lines['q3'].finish_reason == 'stop_rule:no_tool_call'
    assert lines['q3'].messages[-1]['reasoning_content'] == 'I will compute it.'
