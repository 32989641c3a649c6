"""A backend option of the wrong type is one line before the backend is built, naming the flag or
the config line and the type the backend's constructor declares (``-o cycle=maybe`` ran the
scripted backend with a truthy string, exit 0); an error the constructor raises about an option
(``-o threads=lots`` on hf) names the flag or line it came from, not only the backend."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtflow.cli import main
from mtflow.run.config import load_run_config
from mtflow.run.preflight import check_backend_options

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv('MTFLOW_DEBUG', raising=False)
    (tmp_path / 'sched.yaml').write_text('name: s\nmax_turns: 2\n')
    (tmp_path / 'data.jsonl').write_text(json.dumps({'uuid': 'a', 'prompt': 'hi'}) + '\n')
    (tmp_path / 'model.jsonl').write_text(json.dumps({'content': 'hello'}) + '\n')
    return tmp_path


def _config(project: Path, options: str = '{}') -> str:
    (project / 'run.yaml').write_text('scheduler: sched.yaml\nbackend: scripted\nmodel: model.jsonl\n'
                                      f'backend_options: {options}\ndataset: data.jsonl\nout: out\n')
    return 'run.yaml'


def _line(capsys) -> str:
    err = capsys.readouterr().err
    assert 'Traceback' not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_a_wrong_type_on_the_command_line_names_the_flag_and_the_type(project, capsys):
    config = _config(project)
    assert main(['run', config, '-q', '-o', 'cycle=maybe']) == 2
    assert _line(capsys) == ("mtflow: command line: -o cycle=maybe: backend_options.cycle: backend scripted expects "
                             "bool, not 'maybe' (a str)")
    assert not (project / 'out').exists()  # refused before anything was opened or built
    assert main(['run', config, '-q', '--set', 'backend_options.honor_max_tokens=1']) == 2
    assert _line(capsys) == ('mtflow: command line: --set backend_options.honor_max_tokens=1: '
                             'backend_options.honor_max_tokens: backend scripted expects bool, not 1 (an int)')
    assert main(['run', config, '-q', '-o', 'cycle=true']) == 0  # the right type runs


def test_a_wrong_type_in_the_file_names_its_line_for_run_and_validate(project, capsys):
    config = _config(project, '\n  cycle: "no"\n  seed: 1.5')
    assert main(['run', config, '-q']) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["mtflow: run.yaml:5: backend_options.cycle: backend scripted expects bool, not 'no' "
                                "(a str)", 'run.yaml:6: backend_options.seed: backend scripted expects Optional[int], '
                                'not 1.5 (a float)']  # every problem, each on its line
    assert main(['validate', config]) == 1
    out = capsys.readouterr().out
    assert "run.yaml:5: backend_options.cycle: backend scripted expects bool, not 'no' (a str)" in out
    assert 'run.yaml:6: backend_options.seed: backend scripted expects Optional[int], not 1.5 (a float)' in out


def test_a_constructor_error_about_an_option_names_the_flag(project, capsys):
    config = _config(project)
    assert main(['run', config, '-q', '--backend', 'hf', '-o', 'threads=lots']) == 2
    assert _line(capsys) == ("mtflow: command line: -o threads=lots: backend_options.threads: hf backend: threads must "
                             "be 'auto', a positive int or null, not 'lots'")


@pytest.mark.parametrize('config', sorted(p.name for p in (ROOT / 'configs').glob('*.yaml')))
def test_the_bundled_configs_options_have_their_declared_types(config):
    cfg = load_run_config(str(ROOT / 'configs' / config))
    assert [p for p in check_backend_options(cfg) if 'expects' in p] == []
