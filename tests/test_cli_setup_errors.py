"""``mtflow run`` / ``mtflow validate``: setup mistakes a new user makes in the first hour, each
one line naming file, line and field (or the command-line option), found before the model loads
where it can be, never a traceback (``MTFLOW_DEBUG=1`` adds it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtflow.cli import main

ROOT = Path(__file__).resolve().parents[1]

SCHEDULERS = '''
import mtflow

class Echo(mtflow.Scheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'go on'})
        return {'infer_request': infer_request}

class Boom(mtflow.Scheduler):
    def __init__(self, **kw):
        super().__init__(**kw)
        raise ValueError('no API key set')

    def step(self, infer_request, response_choice, current_turn):
        return {'infer_request': infer_request}
'''


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv('MTFLOW_DEBUG', raising=False)
    (tmp_path / 'scheds.py').write_text(SCHEDULERS)
    (tmp_path / 'data.jsonl').write_text(json.dumps({'uuid': 'cd2', 'messages': [{'role': 'user', 'content': 'hi'}]})
                                         + '\n')
    (tmp_path / 'script.jsonl').write_text(''.join(json.dumps({'uuid': 'cd2', 'content': c}) + '\n' for c in 'ab'))
    (tmp_path / 'sched.yaml').write_text('name: s\nmax_turns: 2\n')

    def config(text, name='run.yaml'):
        (tmp_path / name).write_text(text)
        return name

    return config


BASE = 'backend: scripted\nmodel: script.jsonl\ndataset: data.jsonl\nout: out\n'


def _one_line(capsys):
    err = capsys.readouterr().err
    assert 'Traceback' not in err, err
    lines = [l for l in err.splitlines() if l.startswith('mtflow: ')]
    assert len(lines) == 1, err
    return lines[0]


def test_a_scheduler_whose_init_raises_is_one_line_naming_the_config_line(work, capsys):
    run = work(BASE + 'scheduler: scheds.py:Boom\n')
    assert main(['run', run, '--no-progress']) == 2
    assert _one_line(capsys) == ('mtflow: run.yaml:5: scheduler: building scheds.py:Boom raised ValueError: '
                                 'no API key set')


def test_a_scheduler_that_cannot_import_names_the_line(work, capsys):
    run = work(BASE + 'scheduler: no_such_pkg_i27.mod:Sched\n')
    assert main(['validate', run]) == 1
    out = capsys.readouterr().out
    assert "run.yaml:5: scheduler: scheduler 'no_such_pkg_i27.mod:Sched': cannot import 'no_such_pkg_i27.mod'" in out
    assert main(['run', run, '--no-progress']) == 2
    assert _one_line(capsys).startswith("mtflow: run.yaml:5: scheduler: scheduler 'no_such_pkg_i27.mod:Sched'")


def test_a_typo_in_scheduler_args_and_args_for_a_yaml_scheduler_are_errors(work, capsys):
    typo = work(BASE + 'scheduler: scheds.py:Echo\nscheduler_args: {max_turn: 3}\n')
    assert main(['validate', typo]) == 1
    out = capsys.readouterr().out
    assert ("run.yaml:6: scheduler_args.max_turn: unknown key 'max_turn' for scheds.py:Echo; did you mean "
            "'max_turns'? (known: infer_engine, max_turns, tokenizer, template, gym_env, use_gym_env)") in out
    assert main(['run', typo, '--no-progress']) == 2
    assert "unknown key 'max_turn'" in _one_line(capsys)
    yaml_args = work(BASE + 'scheduler: sched.yaml\nscheduler_args: {max_turns: 3}\n', 'yaml_args.yaml')
    assert main(['validate', yaml_args]) == 1
    assert ("yaml_args.yaml:6: scheduler_args: scheduler_args applies to a Python scheduler ('module:Class'); "
            'sched.yaml is a YAML scheduler: set its keys in that file') in capsys.readouterr().out


def test_command_line_values_are_blamed_on_the_option_and_a_dataset_directory_is_named(work, capsys, tmp_path):
    run = work(BASE + 'scheduler: scheds.py:Echo\nscheduler_args: {max_turns: 2}\n')
    assert main(['run', run, '--batch-size', '0', '--no-progress']) == 2
    assert _one_line(capsys) == 'mtflow: --batch-size 0: batch_size: Input should be greater than or equal to 1'
    (tmp_path / 'adir').mkdir()
    assert main(['run', run, '--dataset', 'adir', '--no-progress']) == 2
    line = _one_line(capsys)
    assert 'adir is a directory; give a JSONL file' in line and 'not found' not in line


def test_scripted_lines_keyed_by_the_dataset_uuid_serve_every_generation(work, capsys, tmp_path):
    run = work(BASE + 'scheduler: scheds.py:Echo\nscheduler_args: {max_turns: 2}\nnum_generations: 3\n')
    assert main(['run', run, '--no-progress', '-q']) == 0
    trajs = [json.loads(l) for l in (tmp_path / 'out' / 'trajectories.jsonl').read_text().splitlines()]
    assert sorted(t['uuid'] for t in trajs) == ['cd2#0', 'cd2#1', 'cd2#2']
    assert all([m['content'] for m in t['messages'] if m['role'] == 'assistant'] == ['a', 'b'] for t in trajs)


def test_model_directories_that_are_empty_or_missing_say_so(work, capsys, tmp_path):
    pytest.importorskip('transformers')
    (tmp_path / 'empty').mkdir()
    run = work('backend: hf\ndataset: data.jsonl\nout: out\nscheduler: scheds.py:Echo\n')
    assert main(['run', run, '--model', 'empty', '--no-progress']) == 2
    assert _one_line(capsys) == (f"mtflow: command line: --model: cannot load model '{tmp_path}/empty': not a transformers model "
                                 'directory: it has no config.json (it is empty; expected config.json, the tokenizer files and the '
                                 'weights, as save_pretrained writes them, or a .gguf file)')
    assert main(['run', run, '--model', 'nodir_i27', '--no-progress']) == 2
    line = _one_line(capsys)
    assert "there is no directory 'nodir_i27' here, and no hub model 'nodir_i27' in the local cache" in line
    assert 'huggingface.co' not in line


def _cli(args, cwd, debug=False, block=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop('MTFLOW_DEBUG', None)
    if debug:
        env['MTFLOW_DEBUG'] = '1'
    code = (f'import sys; sys.modules[{block!r}] = None; ' if block else 'import sys; ') + \
        'from mtflow.cli import main; sys.exit(main(sys.argv[1:]))'
    return subprocess.run([sys.executable, '-c', code, *args], cwd=str(cwd), env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_swift_backend_without_ms_swift_is_one_line_and_debug_shows_tracebacks(work, tmp_path):
    run = work(BASE + 'scheduler: scheds.py:Boom\n')
    proc = _cli(['run', run, '--backend', 'swift', '--model', str(tmp_path), '--no-progress'], tmp_path,
                block='swift')
    assert proc.returncode == 2 and 'Traceback' not in proc.stderr, proc.stderr
    assert "backend 'swift' needs the package 'swift" in proc.stderr
    debug = _cli(['run', run, '--no-progress'], tmp_path, debug=True)
    assert debug.returncode == 2
    assert 'Traceback (most recent call last)' in debug.stderr and 'ValueError: no API key set' in debug.stderr
    assert debug.stderr.rstrip().endswith('mtflow: run.yaml:5: scheduler: building scheds.py:Boom raised ValueError: '
                                          'no API key set')


def test_every_unknown_key_lists_the_known_keys_and_the_closest(work, capsys, tmp_path):
    """One message style in scheduler files (every nesting level), run configs and their
    request_config: the key, the closest known key, every known key."""
    (tmp_path / 'envs.yaml').write_text('name: x\nenv:\n  gymnasium: a.b:C\n')
    (tmp_path / 'oe.yaml').write_text('name: x\nenv:\n  openenv:\n    url: http://127.0.0.1:9\n    max_session: 3\n')
    run = work(BASE + 'scheduler: scheds.py:Echo\nnum_generation: 2\nrequest_config: {max_token: 3}\n')
    assert main(['validate', 'envs.yaml', 'oe.yaml', run]) == 1
    out = capsys.readouterr().out
    assert ("envs.yaml:3: env.gymnasium: unknown key 'gymnasium'; did you mean 'gym'? (known: impl, gym, openenv, "
            'textarena, skyrl_gym, gem, nemo_gym, verifiers, kwargs, observation_role)') in out
    assert "oe.yaml:5: env.openenv.max_session: unknown key 'max_session'; did you mean 'max_sessions'? (known: url," in out
    assert "run.yaml:6: num_generation: unknown key 'num_generation'; did you mean 'num_generations'? (known: scheduler," in out
    assert "run.yaml:7: request_config: unknown key 'max_token'; did you mean 'max_tokens'? (known: max_tokens," in out
