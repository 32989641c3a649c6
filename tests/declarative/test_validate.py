"""``mtflow validate`` on broken YAML files: each file states its expected problems in
``# expect: LINE PATH | message fragment`` comments; every expected problem must be reported
(all at once), at that line and field path, and nothing else."""
from __future__ import annotations

import glob
import json
import os
import re

import pytest

from mtflow.cli import main as cli
from mtflow.declarative import ConfigError, load_scheduler, validate_file

HERE = os.path.dirname(os.path.abspath(__file__))
BROKEN = sorted(glob.glob(os.path.join(HERE, '..', 'data', 'broken_yaml', '*.yaml')))
READY = sorted(glob.glob(os.path.join(HERE, '..', '..', 'schedulers', '*.yaml')))
_EXPECT = re.compile(r'^# expect: (\d+) (\S+) \| (.+)$', re.MULTILINE)


def expectations(path: str):
    with open(path, 'rb') as f:  # some broken files are not UTF-8 on purpose
        text = f.read().decode('utf-8', errors='replace')
    found = [(int(line), '' if p == '-' else p, frag) for line, p, frag in _EXPECT.findall(text)]
    assert found, f'{path} states no expectation'
    return found


def test_there_are_broken_files():
    assert len(BROKEN) >= 12


@pytest.mark.parametrize('path', BROKEN, ids=os.path.basename)
def test_each_broken_file_reports_its_problems(path):
    problems = validate_file(path)
    expected = expectations(path)
    got = [(p.line, p.path, p.message) for p in problems]
    assert len(got) == len(expected), f'expected {expected}, got {got}'
    for line, fpath, fragment in expected:
        assert any(l == line and (p == fpath or (not fpath and p == '')) and fragment in m for l, p, m in got), (
            f'missing {line} {fpath} {fragment!r} in {got}')
    assert all(p.file == path for p in problems)


def test_cli_prints_every_problem_and_fails(capsys):
    many = [p for p in BROKEN if p.endswith('many_problems.yaml')][0]
    ok = READY[0]
    rc = cli(['validate', ok, many])
    outtext = capsys.readouterr().out
    assert rc == 1
    assert f'{ok}: OK' in outtext
    lines = [l for l in outtext.splitlines() if l.startswith(many)]
    assert len(lines) == len(expectations(many)) == 6
    assert f'{many}:11: tools[0].timeout: unknown key' in outtext


def test_cli_missing_file_is_a_problem_not_a_traceback(capsys, tmp_path):
    rc = cli(['validate', str(tmp_path / 'nope.yaml')])
    assert rc == 1
    assert 'cannot read' in capsys.readouterr().out


@pytest.mark.parametrize('path', READY, ids=os.path.basename)
def test_ready_schedulers_are_valid(path):
    assert validate_file(path) == []


def test_load_scheduler_raises_with_all_problems():
    many = [p for p in BROKEN if p.endswith('many_problems.yaml')][0]
    with pytest.raises(ConfigError) as info:
        load_scheduler(many)
    assert len(info.value.problems) == 6
    assert 'many_problems.yaml:18: stop.regex.answer' in str(info.value)


def test_dict_source_and_references_next_to_the_yaml(tmp_path):
    (tmp_path / 'mytools.py').write_text('def shout(text: str) -> str:\n    """Shout.\n\n    Args:\n'
                                         '        text: what to shout\n    """\n    return text.upper()\n')
    cfg = tmp_path / 's.yaml'
    cfg.write_text('name: local\ntools:\n  - name: shout\n    impl: mytools:shout\n')
    assert validate_file(cfg) == []
    sched = load_scheduler(str(cfg))
    spec = sched.tool_specs[0]['function']
    assert spec['description'] == 'Shout.'
    assert spec['parameters']['properties']['text'] == {'type': 'string', 'description': 'what to shout'}
    with pytest.raises(ConfigError, match='unknown key'):
        load_scheduler({'name': 'x', 'bogus': 1})


def test_schema_command_prints_json_schema(capsys):
    assert cli(['schema']) == 0
    schema = json.loads(capsys.readouterr().out)
    props = schema['properties']
    for key in ('tools', 'parser', 'observation', 'stop', 'tips', 'env', 'max_turns', 'system_prompt'):
        assert key in props and props[key].get('description'), key
    assert schema['additionalProperties'] is False
    tool = schema['$defs']['ToolConfig']['properties']
    assert {'timeout_s', 'max_concurrency', 'max_observation', 'truncate_side'} <= set(tool)
