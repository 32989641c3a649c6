"""The command line around run configs: `validate` and `graph` accept them, and CLI errors are
one line whether mtflow runs as `mtflow`, `python -m mtflow` or `python -m mtflow.cli`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mtflow.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_validate_checks_run_configs_and_the_scheduler_they_name(tmp_path, capsys):
    assert main(['validate', str(ROOT / 'configs' / 'default.yaml')]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith('default.yaml: OK') and lines[1].endswith(
        'chat template: the tokenizer\'s own (embedded): shows every part of a tool-use conversation; longest prompt 82 '
        '+ max_tokens 24 <= context 8192') or 'not on disk yet' in lines[1]

    bad_sched = tmp_path / 'sched.yaml'
    bad_sched.write_text('name: x\nmax_turns: 0\n')
    cfg = tmp_path / 'run.yaml'
    cfg.write_text(f'scheduler: {bad_sched.name}\nbackend: scripted\n')
    assert main(['validate', str(cfg)]) == 1
    out = capsys.readouterr().out
    assert f'{bad_sched}:2: max_turns' in out

    cfg.write_text('scheduler: sched.yaml\nbackend: nope\nbatch_size: 0\n')
    assert main(['validate', str(cfg)]) == 1
    out = capsys.readouterr().out
    assert f'{cfg}:2: backend: unknown backend' in out and f'{cfg}:3: batch_size' in out

    cfg.write_text('scheduler: missing.yaml\n')
    assert main(['validate', str(cfg)]) == 1
    assert 'no such scheduler file: missing.yaml' in capsys.readouterr().out


def test_graph_of_a_run_config_draws_its_scheduler(capsys):
    assert main(['graph', str(ROOT / 'configs' / 'default.yaml')]) == 0
    assert 'stop_rule:env_done' in capsys.readouterr().out


@pytest.mark.parametrize('entry', [['-m', 'mtflow'], ['-m', 'mtflow.cli']])
def test_cli_errors_are_one_line_under_python_m(entry, tmp_path):
    proc = subprocess.run([sys.executable, *entry, 'graph', str(tmp_path / 'nope.yaml')], capture_output=True,
                          text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f'mtflow: no such config file: {tmp_path / "nope.yaml"}'


def test_a_reader_that_closes_the_pipe_early_gets_no_traceback():
    """``mtflow diff A B | head -1`` printed ``BrokenPipeError`` with a traceback once head had
    its line; the command now stops quietly with 141 (128 + SIGPIPE, as a process the pipe ended)."""
    run = ROOT / 'tests' / 'data' / 'replay_example' / 'run'
    proc = subprocess.Popen([sys.executable, '-m', 'mtflow', 'diff', str(run), str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**__import__('os').environ, 'PYTHONPATH': str(ROOT)})
    proc.stdout.close()  # the reader is gone before the first line is written
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and 'Traceback' not in err and 'BrokenPipe' not in err, err
