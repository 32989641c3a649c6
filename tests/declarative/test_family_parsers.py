"""The tool-call and reasoning formats of the families RL-trained now (issue 46): Qwen3-Coder, GLM-4.5+,
Kimi-K2, DeepSeek-V3.2, MiniMax-M2 and gpt-oss (harmony, through openai-harmony).

For each family: what its parser writes (``render_calls``) reads back as the same calls, values of
every JSON type included; the XML formats' text values are typed by the tool's schema; a malformed
call and a call cut by ``max_tokens`` reach the model as the documented error and are never run;
its reasoning is split from the content (stop rules, answers and calls see the content) and kept in
the trajectory; and a two-turn ``mtflow run`` in the family's chat template passes
``mtflow check-tokens`` with the call and its result in the next prompt, ids exact.
(Real-shaped outputs of each family: ``tests/data/tool_calls``, read by ``test_parser_fixtures.py``.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtflow import Executor
from mtflow.accounting.segments_split import flat_sample, segments_of
from mtflow.cli import main
from mtflow.declarative import load_scheduler
from mtflow.declarative.parsers import get_parser, parse_calls
from mtflow.declarative.parsers.schema_types import typed_value
from mtflow.declarative.reasoning import ThinkTags, opens_thinking, reasoning_parser, split_reasoning
from tests.declarative.families import Family, families, harmony_family
from tests.helpers import Scripted, req

from .test_truncation_and_feedback import RAN
from .util import model_out, tok

FAMILIES = ['qwen3_coder', 'glm45', 'kimi_k2', 'deepseek_v32', 'minimax_m2', 'harmony']
RECORD = 'tests.declarative.test_truncation_and_feedback:record'  # a tool that records what it ran, in RAN


def parser_of(name):
    try:
        return get_parser(name)
    except (ImportError, RuntimeError) as exc:  # harmony without openai-harmony or its vocabulary
        pytest.skip(f'{name}: {exc}')


def family(name) -> Family:
    found = {f.parser: f for f in families()}
    if name == 'harmony':
        fam = harmony_family()
        if fam is None:
            pytest.skip('harmony: openai-harmony or its vocabulary is missing (scripts/test.sh installs both)')
        return fam
    return found[name]


# ---- what a parser writes, it reads back --------------------------------------------------------
ARGS = {'code': 'print("a \\"b\\"")\nfor i in range(2):\n    print(i)', 'city': 'Zürich 東京 😀',
        'days': 3, 'ratio': 0.25, 'exact': False, 'filters': {'lang': ['en', 'fr'], 'meta': {'n': None, 'k': [1, {}]}},
        'ids': [1, 2, 3], 'empty': ''}
SCHEMA = [{'type': 'function', 'function': {'name': 'f', 'parameters': {'type': 'object', 'properties': {
    'code': {'type': 'string'}, 'city': {'type': 'string'}, 'days': {'type': 'integer'}, 'ratio': {'type': 'number'},
    'exact': {'type': 'boolean'}, 'filters': {'type': 'object'}, 'ids': {'type': 'array'},
    'empty': {'type': 'string'}}}}}]


@pytest.mark.parametrize('name', FAMILIES)
def test_rendered_calls_read_back_as_the_same_calls(name):
    parser = parser_of(name)
    calls = [('f', ARGS), ('f', {'days': 7}), ('f', {})]
    text = parser.render_calls(calls)
    assert [(c.name, c.arguments, c.error, c.complete) for c in parse_calls(parser, text, SCHEMA)] == \
        [(n, a, None, True) for n, a in calls]
    if name != 'harmony':  # text around the calls (gpt-oss writes text only as messages of its own)
        between = f'First.\n{parser.render_calls(calls[:1])}\nThen.\n{parser.render_calls(calls[1:2])}\nDone.'
        assert [(c.name, c.arguments) for c in parse_calls(parser, between, SCHEMA)] == list(calls[:2])


@pytest.mark.parametrize('name', FAMILIES)
def test_the_tool_list_is_rendered_in_the_family_format(name):
    parser = parser_of(name)
    text = parser.render_tools(SCHEMA)
    assert 'f' in text and 'filters' in text
    if name == 'harmony':  # the package's own TypeScript-like signatures
        assert 'namespace functions' in text and 'type f = ' in text


def test_xml_values_are_typed_by_the_schema():
    assert typed_value(' 5 ', {'type': 'integer'}) == 5
    assert typed_value('5', {'type': 'string'}) == '5'
    assert typed_value('3.0', {'type': 'number'}) == 3 and typed_value('2.5', {'type': 'number'}) == 2.5
    assert typed_value('TRUE', {'type': 'boolean'}) is True
    assert typed_value("{'a': [1]}", {'type': 'object'}) == {'a': [1]}  # a Python literal too
    assert typed_value('null', {'type': 'integer'}) is None
    assert typed_value('7', {'type': ['integer', 'null']}) == 7
    assert typed_value('7', {'anyOf': [{'type': 'integer'}, {'type': 'string'}]}) == 7
    # a value that is not its type stays text: the argument check tells the model (not a guess run)
    assert typed_value('five', {'type': 'integer'}) == 'five' and typed_value('yes', {'type': 'boolean'}) == 'yes'
    assert typed_value('[1, 2]', None) == '[1, 2]' and typed_value('[1, 2]', None, 'json') == [1, 2]


# ---- malformed and truncated calls reach the model as the documented error ----------------------
MALFORMED = {
    'qwen3_coder': '<tool_call>\npython(code="x")\n</tool_call>',
    'glm45': '<tool_call>python\n<arg_key>code</arg_key>\n</tool_call>',
    'kimi_k2': '<|tool_calls_section_begin|><|tool_call_begin|>functions.python:0<|tool_call_argument_begin|>'
               '{code: x}<|tool_call_end|><|tool_calls_section_end|>',
    'deepseek_v32': '<｜DSML｜function_calls>\n<｜DSML｜invoke name="python">\n<｜DSML｜parameter name="code" '
                    'string="false">not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
    'minimax_m2': '<minimax:tool_call>\npython code\n</minimax:tool_call>',
    'harmony': '<|channel|>commentary to=functions.python <|constrain|>json<|message|>{code: x}<|call|>',
}


def _scheduler(parser, **kw):
    cfg = {'name': 'families', 'parser': parser, 'tools': [{'name': 'python', 'impl': RECORD}],
           'max_turns': 3, 'stop': {'on_length': False}}
    cfg.update(kw)
    return load_scheduler(cfg, tokenizer=tok())


@pytest.mark.parametrize('name', FAMILIES)
def test_a_malformed_call_is_fed_back_with_the_format_expected(name):
    parser_of(name)
    RAN.clear()
    res = Executor(_scheduler(name), Scripted({'a': [model_out(MALFORMED[name]), model_out('ok')]})).run([req('a')])
    o = res.outputs[0]
    tool = o.messages[2]
    assert tool['role'] == 'tool' and tool['content'].startswith('Error: could not parse the tool call: ')
    assert f'({name} format; write calls like: ' in tool['content']
    assert RAN == [] and o.rollout_infos['tool_error_kinds'] == {'parse': 1}


@pytest.mark.parametrize('name', FAMILIES)
def test_a_call_cut_by_max_tokens_is_never_run(name):
    parser = parser_of(name)
    whole = parser.render_calls([('python', {'code': 'print(sum(range(10)))'})])
    cut = whole[:whole.index('range(10)') + 5]  # the end of the value and the closing tags lost to the token limit
    RAN.clear()
    outs = [model_out(cut, finish_reason='length'), model_out('ok')]
    res = Executor(_scheduler(name), Scripted({'a': outs})).run([req('a')])
    tool = res.outputs[0].messages[2]
    assert RAN == [] and tool['role'] == 'tool'
    assert 'cut off by the token limit' in tool['content'] or 'could not parse the tool call' in tool['content']
    # the same call whole runs, its value as written
    res = Executor(_scheduler(name), Scripted({'a': [model_out(whole), model_out('ok')]})).run([req('a')])
    assert RAN == ['print(sum(range(10)))'] and res.outputs[0].messages[2]['content'] == 'ran'


# ---- reasoning ----------------------------------------------------------------------------------
def test_think_tags_opened_in_the_prompt_or_not():
    opened = ThinkTags(opened_in_prompt=True)
    assert split_reasoning('plan</think>\n\nanswer', opened) == split_reasoning('<think>plan</think>\n\nanswer',
                                                                              ThinkTags())
    assert split_reasoning('plan</think>\n\nanswer', opened).content == '\n\nanswer'
    assert split_reasoning('cut while thinking', opened).reasoning == 'cut while thinking'  # max_tokens in the think
    assert split_reasoning('cut while thinking', ThinkTags()).content == 'cut while thinking'
    assert split_reasoning('a continued turn', opened, continued=True).content == 'a continued turn'
    kimi = reasoning_parser('auto', 'kimi_k2', opened_in_prompt=True)
    assert split_reasoning('plan<|tool_calls_section_begin|>x', kimi).content == '<|tool_calls_section_begin|>x'
    assert split_reasoning('◁think▷hm◁/think▷ok', kimi).reasoning == 'hm'


SWITCHED = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n"
            "{% endif %}{% endif %}")  # as Qwen3.5's and GLM-4.7's templates switch thinking off


def test_the_template_says_whether_it_opens_thinking():
    glm, qwen = family('glm45'), family('qwen3_coder')
    assert opens_thinking(glm.tokenizer()) is True and opens_thinking(qwen.tokenizer()) is False
    assert opens_thinking(None) is None
    assert opens_thinking(qwen.tokenizer(), SWITCHED) is True
    assert opens_thinking(qwen.tokenizer(), SWITCHED, {'enable_thinking': False}) is False


def test_a_request_that_switches_thinking_off_is_read_as_content():
    """The template opens <think> unless the request's chat_template_kwargs say enable_thinking: false: an
    untagged reply is all thinking in the first case (no </think> came), the answer (and its call) in the second."""
    tokenizer = family('qwen3_coder').tokenizer()
    tokenizer.chat_template = SWITCHED
    reply = '<tool_call>\n{"name": "python", "arguments": {"code": "x"}}\n</tool_call>'
    sched = lambda: load_scheduler({'name': 'r', 'tools': [{'name': 'python', 'impl': RECORD}], 'max_turns': 2},  # noqa
                                   tokenizer=tokenizer)
    RAN.clear()
    on = Executor(sched(), Scripted({'a': [model_out(reply)]})).run([req('a')])
    assert RAN == [] and on.finish_reasons == ['stop_rule:no_tool_call']  # a call written while thinking
    off = Executor(sched(), Scripted({'a': [model_out(reply), model_out('done')]})).run(
        [req('a', chat_template_kwargs={'enable_thinking': False})])
    assert RAN == ['x'] and off.outputs[0].messages[2] == {'role': 'tool', 'name': 'python', 'content': 'ran'}


ANSWER = {'pattern': '<answer>(.*?)</answer>', 'field': 'solution', 'compare': 'exact'}


def test_stop_rules_answers_and_calls_see_the_content_unless_asked():
    thought = '<think>Maybe <answer>3</answer>? Final Answer: no. <tool_call>{"name": "python", "arguments": ' \
              '{"code": "x"}}</tool_call></think>The answer is <answer>4</answer>.'
    base = {'name': 'r', 'tools': [{'name': 'python', 'impl': RECORD}], 'answer': ANSWER,
            'stop': {'regex': {'final': 'Final Answer:'}}, 'max_turns': 2}
    RAN.clear()
    res = Executor(load_scheduler(base, tokenizer=tok()), Scripted({'a': [model_out(thought)]})).run(
        [req('a', data_dict={'solution': '4'})])
    o = res.outputs[0]
    assert RAN == [] and res.finish_reasons == ['stop_rule:no_tool_call']  # no call, no stop inside the thinking
    assert o.rollout_infos['answer'] == '4' and o.rollout_infos['answer_correct'] is True
    assert o.messages[-1] == {'role': 'assistant', 'content': 'The answer is <answer>4</answer>.',
                              'reasoning_content': thought[len('<think>'):thought.index('</think>')]}
    assert o.response_token_ids == [tok().encode(thought, add_special_tokens=False)]  # the ids whole
    opted = dict(base, stop={'regex': {'final': 'Final Answer:'}, 'include_reasoning': True},
                 answer=dict(ANSWER, include_reasoning=True))
    res = Executor(load_scheduler(opted, tokenizer=tok()), Scripted({'a': [model_out(thought)]})).run(
        [req('a', data_dict={'solution': '4'})])
    assert res.finish_reasons == ['stop_rule:final'] and res.outputs[0].rollout_infos['answer'] == '4'
    whole = Executor(load_scheduler(dict(base, reasoning='none'), tokenizer=tok()),
                     Scripted({'a': [model_out(thought)]})).run([req('a', data_dict={'solution': '4'})])
    assert whole.finish_reasons == ['stop_rule:final']  # reasoning: none reads the reply whole, as before
    assert whole.outputs[0].messages[-1] == {'role': 'assistant', 'content': thought}


def test_rewards_see_the_content_and_the_reasoning_apart():
    res = Executor(load_scheduler({'name': 'r', 'reward': f'{__name__}:seen', 'max_turns': 1}, tokenizer=tok()),
                   Scripted({'a': [model_out('<think>secret</think>shown')]})).run([req('a')])
    assert res.outputs[0].rollout_infos['reward'] == 1.0
    assert SEEN[-1] == {'role': 'assistant', 'content': 'shown', 'reasoning_content': 'secret'}


SEEN = []


def seen(infer_request, rollout_infos):
    SEEN.append(infer_request.messages[-1])
    return 1.0


def test_reasoning_key_is_checked(tmp_path):
    from mtflow.declarative import validate_file
    path = tmp_path / 's.yaml'
    path.write_text('name: s\nreasoning: thinkk\n')
    problems = validate_file(str(path))
    assert any(p.line == 2 and 'reasoning' in p.field and 'unknown reasoning parser' in p.message for p in problems)
    path.write_text('name: s\nreasoning: {parser: think, opened_in_prompt: yes}\n')
    assert any(p.line == 2 and 'opened_in_prompt' in p.field for p in validate_file(str(path)))


# ---- a two-turn run in the family's own template passes check-tokens ----------------------------
def family_run(fam: Family, tmp_path, out: str = 'run') -> Path:
    """``mtflow run`` of the family's two replies (a calculator call, then the answer), its run directory."""
    tok_dir = tmp_path / 'tok'
    fam.tokenizer().save_pretrained(tok_dir)
    (tmp_path / 'sched.yaml').write_text(f'name: {fam.parser}\nparser: {fam.parser}\ntools: [{{name: calculator}}]\n'
                                         'system_prompt: "Use the tools.\\n{tools}"\nmax_turns: 3\n')
    (tmp_path / 'prompts.jsonl').write_text(json.dumps({'uuid': 'q1', 'prompt': 'What is 2 + 3 * 4?'}) + '\n')
    (tmp_path / 'model.jsonl').write_text(''.join(json.dumps({'uuid': 'q1', 'turn': t, 'content': c}) + '\n'
                                                  for t, c in ((1, fam.call_turn), (2, fam.answer_turn))))
    (tmp_path / 'run.yaml').write_text(f'scheduler: sched.yaml\nbackend: scripted\nbackend_options: {{path: model.jsonl, '
                                       f'tokenizer: {tok_dir}}}\ndataset: prompts.jsonl\nout: {tmp_path / out}\n'
                                       'request_config: {max_tokens: 256}\n')
    assert main(['run', str(tmp_path / 'run.yaml'), '-q']) == 0
    return tmp_path / out


@pytest.mark.parametrize('name', FAMILIES)
def test_round_trip_in_the_family_template_passes_check_tokens(name, tmp_path):
    fam = family(name)
    run_dir = family_run(fam, tmp_path)
    assert main(['check-tokens', str(run_dir)]) == 0
    line = json.loads((run_dir / 'trajectories.jsonl').read_text().splitlines()[0])
    msgs = line['messages']
    assert line['finish_reason'] == 'stop_rule:no_tool_call' and [m['role'] for m in msgs[-3:]] == \
        ['assistant', 'tool', 'assistant']
    assert msgs[-2]['content'] == '14'  # the call ran
    assert msgs[-3].get('reasoning_content', '') == fam.reasoning.strip('\n') or \
        msgs[-3].get('reasoning_content', '') == fam.reasoning
    assert msgs[-1].get('reasoning_content', '').strip() == fam.answer_reasoning.strip()
    assert 'It is 14.' in msgs[-1]['content'] and (not fam.reasoning or fam.reasoning.strip() not in msgs[-3]['content'])
    (seg, ) = segments_of(line)
    tokenizer = fam.tokenizer()
    sample = flat_sample(seg)
    text = tokenizer.decode(list(seg['prompt_ids']) + sample['response_ids'], skip_special_tokens=False)
    # the next prompt holds the call exactly as sampled, then the result in the family's own frame
    assert fam.call_turn + fam.eos in text and fam.tool_frame in text
    assert text.index(fam.call_turn) < text.index(fam.tool_frame)


def test_replay_diff_rescore_and_viewers_read_runs_with_reasoning(tmp_path, capsys):
    run_dir = family_run(family('glm45'), tmp_path)
    assert 'reasoning_content' in (run_dir / 'trajectories.jsonl').read_text()
    assert main(['replay', str(run_dir), '--out', str(tmp_path / 'again'), '-q']) == 0
    assert main(['diff', str(run_dir), str(tmp_path / 'again')]) == 0  # the same run, reasoning and all
    assert main(['check-tokens', str(tmp_path / 'again')]) == 0
    assert main(['rescore', str(run_dir), '--out', str(tmp_path / 'rescored'), '-q']) == 0
    capsys.readouterr()
    assert main(['trace', 'show', str(run_dir / 'trace.jsonl'), '--trajectories',
                 str(run_dir / 'trajectories.jsonl'), '--detail', 'q1']) == 0
    assert 'assistant reasoning: The user wants 2 + 3 * 4.' in capsys.readouterr().out
    page = tmp_path / 'page.html'
    assert main(['trace', 'html', str(run_dir / 'trace.jsonl'), '--trajectories', str(run_dir / 'trajectories.jsonl'),
                 '-o', str(page)]) == 0
    assert 'reasoning_content' in page.read_text()


def test_the_gateway_types_xml_values_by_the_clients_tools():
    from mtflow.gateway.wire import split_calls
    text = 'Sure.\n' + get_parser('glm45').render_calls([('f', {'days': 3, 'city': '5'})])
    content, calls = split_calls(text, get_parser('glm45'), 1, 'session-1', SCHEMA)
    assert content == 'Sure.' and [(n, a) for _, n, a in calls] == [('f', {'days': 3, 'city': '5'})]
    _, untyped = split_calls(text, get_parser('glm45'), 1, 'session-1')  # no tools: GLM reads JSON where it parses
    assert [a for _, _, a in untyped] == [{'days': 3, 'city': 5}]
