"""``mtflow init NAME``: the package it writes passes its own printed test command in a fresh
directory, ``mtflow validate`` and ``mtflow run`` on it as it is; a taken directory or a bad name is
one line, and nothing is written."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from mtflow.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_init_then_its_printed_test_command_passes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(['init', 'demo']) == 0
    printed = capsys.readouterr().out
    line = next(l for l in printed.splitlines() if l.startswith('test it:'))
    cd, command = line[len('test it:'):].strip().split(' && ', 1)
    assert cd == 'cd demo'
    assert sorted(os.listdir('demo')) == ['README.md', 'data.jsonl', 'demo.yaml', 'demo_env.py', 'model.jsonl',
                                          'run.yaml', 'test_demo.py']
    done = subprocess.run(shlex.split(command) + ['-p', 'no:cacheprovider'], cwd=tmp_path / 'demo', capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert '2 passed' in done.stdout
    assert len((tmp_path / 'demo' / 'data.jsonl').read_text().splitlines()) == 5


def test_validate_and_run_pass_on_it_as_it_is(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(['init', 'my-env']) == 0
    monkeypatch.chdir(tmp_path / 'my-env')
    assert main(['validate', 'my-env.yaml', 'run.yaml']) == 0
    assert main(['run', 'run.yaml', '--no-progress']) == 0
    lines = [json.loads(l) for l in Path('runs/my-env/trajectories.jsonl').read_text().splitlines()]
    assert sorted(l['reward'] for l in lines) == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert all(l['rollout_infos']['tool_calls'] == 1 for l in lines)


@pytest.mark.parametrize('name, message', [
    ('9lives', "init: '9lives' is not a name for an environment"),
    ('a b', "init: 'a b' is not a name for an environment"),
    ('taken', 'init: taken already exists and is not an empty directory; nothing was written'),
])
def test_a_bad_name_or_a_taken_directory_is_one_line(tmp_path, monkeypatch, capsys, name, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'taken').mkdir()
    (tmp_path / 'taken' / 'mine.txt').write_text('keep me')
    assert main(['init', name]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ['taken'] and os.listdir(tmp_path / 'taken') == ['mine.txt']
