"""Every tool-call format the field uses, on real-shaped model outputs (``tests/data/tool_calls``):
each fixture is read by its parser into exactly the expected calls, errors and truncations (the XML
formats' text values typed by the tools' schemas, ``TOOL_SPECS``), and a call written in a format the
configured parser does not read is recognised (so the model gets feedback instead of silence)."""
from __future__ import annotations

import os

import pytest
import yaml

from mtflow.declarative.parsers import PARSERS, foreign_format, get_parser, parse_calls

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'tool_calls')
with open(os.path.join(HERE, 'expected.yaml'), encoding='utf-8') as _f:
    CASES = yaml.safe_load(_f)
TOOL_NAMES = {'get_weather', 'get_time', 'get_current_weather', 'get_current_temperature', 'search', 'calculator',
              'python'}


def _spec(name, **props):
    return {'type': 'function', 'function': {'name': name, 'parameters': {'type': 'object', 'properties': {
        k: {'type': t} for k, t in props.items()}}}}


#: the schemas the XML formats' text values are typed by
TOOL_SPECS = [_spec('get_weather', city='string', days='integer'), _spec('get_time'), _spec('python', code='string'),
              _spec('search', query='string', limit='integer', exact='boolean', threshold='number', filters='object',
                    fields='array', cursor=['string', 'null'])]
NEW_FAMILIES = {'qwen3_coder', 'glm45', 'kimi_k2', 'deepseek_v32', 'minimax_m2', 'harmony'}


def _parser(name):
    try:
        return get_parser(name)
    except (ImportError, RuntimeError) as exc:  # harmony without openai-harmony or its vocabulary
        pytest.skip(f'{name}: {exc}')


def _text(case):
    with open(os.path.join(HERE, case['file']), encoding='utf-8') as f:
        return f.read()


def test_every_format_has_fixtures():
    parsers = {PARSERS.get(c['parser']).name for c in CASES}
    assert {'hermes', 'llama3_json', 'pythonic', 'mistral', 'deepseek', 'react', 'json'} | NEW_FAMILIES <= parsers
    files = {c['file'] for c in CASES}
    assert files == {f for f in os.listdir(HERE) if f.endswith('.txt')}, 'every fixture file is used'


@pytest.mark.parametrize('case', CASES, ids=lambda c: f"{c['parser']}-{c['file']}")
def test_fixture(case):
    text = _text(case)
    parser = _parser(case['parser'])
    calls = parse_calls(parser, text, TOOL_SPECS)
    good = [[c.name, c.arguments] for c in calls if c.error is None]
    assert good == case['calls'], [(c.name, c.arguments, c.error) for c in calls]
    assert sum(1 for c in calls if c.error) == case.get('errors', 0), [c.error for c in calls]
    assert sum(1 for c in calls if not c.complete) == case.get('incomplete', 0)
    assert all(c.raw for c in calls)
    if not calls:  # what the scheduler checks when its parser finds nothing
        assert foreign_format(text, parser.name, TOOL_NAMES) == case.get('foreign')
