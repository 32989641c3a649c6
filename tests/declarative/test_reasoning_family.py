"""``reasoning:`` beside a parser whose family has its own (docs/declarative.md, "Reasoning"): a
split that cannot read the family's thinking lost Kimi-K2's calls (they follow an unclosed
``<think>``) or kept gpt-oss's analysis in the content, and the run finished ``complete``, exit 0.
Now such a pair is refused at its line, and ``reasoning: none`` keeps Kimi's calls."""
from __future__ import annotations

import json
import os
import textwrap

import pytest

from mtflow.cli import main

CALL = ('<think>Look it up.<|tool_calls_section_begin|><|tool_call_begin|>functions.capital:0'
        '<|tool_call_argument_begin|>{"country": "France"}<|tool_call_end|><|tool_calls_section_end|>')


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'env.py').write_text(textwrap.dedent('''\
        def capital(country: str) -> str:
            """The capital of a country.

            Args:
                country: its name.
            """
            return {'France': 'Paris'}[country]
        '''))
    (tmp_path / 'data.jsonl').write_text(json.dumps({'uuid': 'fr', 'prompt': 'Capital of France?', 'answer': 'Paris'}) + '\n')
    (tmp_path / 'model.jsonl').write_text(''.join(json.dumps(row) + '\n' for row in (
        {'uuid': 'fr', 'turn': 1, 'content': CALL}, {'uuid': 'fr', 'turn': 2, 'content': '<answer>Paris</answer>'})))
    (tmp_path / 'run.yaml').write_text('scheduler: s.yaml\nbackend: scripted\nmodel: model.jsonl\ndataset: data.jsonl\n'
                                       'out: out\nmax_turns: 3\n')
    return tmp_path


def _scheduler(project, parser: str, reasoning: str) -> None:
    (project / 's.yaml').write_text(textwrap.dedent(f'''\
        name: s
        parser: {parser}
        reasoning: {reasoning}
        tools:
          - {{name: capital, impl: env.py:capital}}
        answer: {{pattern: '<answer>(.*?)</answer>', field: answer, compare: exact}}
        '''))


def test_a_kimi_parser_with_the_think_split_is_refused_at_its_line(project, capsys):
    _scheduler(project, 'kimi_k2', 'think')
    assert main(['validate', 's.yaml']) == 1
    out = capsys.readouterr().out
    assert "s.yaml:3: reasoning: 'think' does not split what parser 'kimi_k2' reads: a Kimi-K2 reply's tool-call " \
           "section ends its thinking" in out and 'give reasoning: auto (here kimi) or none' in out
    assert main(['run', 'run.yaml', '-q']) == 2 and not (project / 'out').exists()


@pytest.mark.parametrize('reasoning', ['none', 'auto'])
def test_kimi_calls_after_an_unclosed_think_run(project, reasoning):
    _scheduler(project, 'kimi_k2', reasoning)
    assert main(['run', 'run.yaml', '-q']) == 0
    [line] = [json.loads(text) for text in open(project / 'out' / 'trajectories.jsonl')]
    assert [m['role'] for m in line['messages']].count('tool') == 1 and line['finish_reason'] != 'error'
    assert json.load(open(project / 'out' / 'summary.json'))['tool_calls'] == 1


def test_the_harmony_split_only_with_gpt_oss(project, capsys):
    pytest.importorskip('openai_harmony')
    if not os.environ.get('TIKTOKEN_ENCODINGS_BASE'):
        pytest.skip('no harmony vocabulary here (scripts/test.sh writes it)')
    _scheduler(project, 'hermes', 'harmony')
    assert main(['validate', 's.yaml']) == 1
    assert "s.yaml:3: reasoning: 'harmony' does not split what parser 'hermes' reads" in capsys.readouterr().out
    _scheduler(project, 'harmony', 'think')
    assert main(['validate', 's.yaml']) == 1
    assert "'think' does not split what parser 'harmony' reads: gpt-oss writes its thinking" in capsys.readouterr().out
    for parser in ('gpt_oss', 'harmony'):
        _scheduler(project, parser, 'harmony')
        assert main(['validate', 's.yaml']) == 0
