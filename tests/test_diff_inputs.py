"""``mtflow diff`` of two runs whose requests share uuids but not their prompt or reference (issue
47, item 3): the model's turns may agree to the byte (a scripted or greedy model that ignores the
question), and the runs were still called ``identical``. A request that started from another
prompt or reference is not the same request: that is its own category, printed first, exit 1."""
from __future__ import annotations

import json

import pytest

from mtflow.cli import main

SCHED = 'name: s\nmax_turns: 2\nsystem_prompt: Answer.\n'
RUN = 'scheduler: sched.yaml\nbackend: scripted\nmodel: script.jsonl\nbackend_options: {cycle: true}\n' \
      'max_turns: 2\n'


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'sched.yaml').write_text(SCHED)
    (tmp_path / 'run.yaml').write_text(RUN)
    (tmp_path / 'script.jsonl').write_text(json.dumps({'content': '42', 'token_ids': [4, 2]}) + '\n')
    return tmp_path


def _run(project, name, rows):
    data = project / f'{name}.jsonl'
    data.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    assert main(['run', 'run.yaml', '--dataset', str(data), '--out', name, '-q', '--no-progress']) == 0
    return name


def _diff(capsys, *args):
    code = main(['diff', *args])
    return code, capsys.readouterr().out


def test_other_prompts_under_the_same_uuids_are_not_identical(project, capsys):
    rows = [{'uuid': f'q{i}', 'prompt': f'What is {i} + 1?', 'answer': str(i + 1)} for i in range(3)]
    a = _run(project, 'a', rows)
    b = _run(project, 'b', [dict(r, prompt=r['prompt'].replace('+', '*')) if r['uuid'] != 'q0' else r for r in rows])
    code, out = _diff(capsys, a, b)
    lines = out.splitlines()
    assert code == 1
    assert lines[0] == 'q1: started from another input: prompt message 1: {"role": "user", "content": "What is 1 + 1?"} ' \
                       'vs {"role": "user", "content": "What is 1 * 1?"}'
    assert lines[1].startswith('q2: started from another input: prompt message 1:')
    assert lines[-1] == ('different prompt or reference 2 (not the same requests: their turns are not compared), '
                         'identical 1, different 0, only in A 0, only in B 0')
    code, out = _diff(capsys, a, b, '--json')
    totals = json.loads(out.splitlines()[-1])['totals']
    assert code == 1 and totals['different_input'] == 2 and totals['identical'] == 1
    first = json.loads(out.splitlines()[0])
    assert first['turn'] == 0 and first['fields'] == ['prompt'] and first['detail'] == {'prompt_message': 1}


def test_another_reference_is_printed_before_the_turns_that_differ(project, capsys):
    rows = [{'uuid': f'q{i}', 'prompt': f'What is {i} + 1?', 'answer': str(i + 1)} for i in range(3)]
    a = _run(project, 'a', rows)
    (project / 'script.jsonl').write_text(json.dumps({'content': '7', 'token_ids': [7]}) + '\n')
    b = _run(project, 'b', [dict(r, answer='0') if r['uuid'] == 'q2' else r for r in rows])
    code, out = _diff(capsys, a, b)
    lines = out.splitlines()
    assert code == 1
    # first, though q0 comes before it; the turn where it then differs beside it
    assert lines[0] == ('q2: started from another input: reference: "3" vs "0"; then turn 1: text: "42" vs "7"; '
                        'token_ids differ at position 0 (4 vs 7)')
    assert lines[1].startswith('q0: turn 1: text: "42" vs "7"')
    assert lines[-1].startswith('different prompt or reference 1 (not the same requests')
    assert lines[-1].endswith('identical 0, different 2, only in A 0, only in B 0')
    code, out = _diff(capsys, a, b, '--fields', 'text')  # --fields narrows as before
    assert code == 1 and 'started from another input' not in out
