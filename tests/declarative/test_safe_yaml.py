"""The hostile-YAML reader (``mtflow.core.safe_yaml``) shared by scheduler files and run configs: alias
bombs are refused while composing (by construction, before anything walks the data), duplicate
keys name both lines, YAML 1.1 scalars stay strings, and the same rules hold for run configs and
for ``mtflow validate`` / ``mtflow run`` on them."""
from __future__ import annotations

import textwrap

import pytest

from mtflow.cli import main as cli
from mtflow.run.config import RunConfigError, load_run_config
from mtflow.core.safe_yaml import YamlLoadError, load_yaml


def bomb(width: int = 9, depth: int = 9) -> str:
    doc = 'l0: &l0 [' + ', '.join(['lol'] * width) + ']\n'
    for i in range(1, depth):
        doc += f'l{i}: &l{i} [' + ', '.join([f'*l{i - 1}'] * width) + ']\n'
    return doc


def test_alias_bomb_stops_at_the_alias_that_crosses_the_bound():
    with pytest.raises(YamlLoadError) as info:
        load_yaml(bomb(), max_nodes=1000)
    (p, ) = info.value.problems
    assert p.line == 4 and 'alias *l2 expands past 1000 nodes' in p.message  # 1 + 9 + 81 + 729 > 1000 at l3


def test_aliases_within_the_bound_are_fine_and_shared():
    data, _, problems = load_yaml('base: &b {timeout_s: 5}\ntools:\n  - {name: a, options: *b}\n  - {name: b, options: *b}\n')
    assert problems == [] and data['tools'][0]['options'] == data['tools'][1]['options'] == {'timeout_s': 5}


def test_yaml_1_2_scalars():
    data, _, _ = load_yaml('a: yes\nb: No\nc: on\nd: 1:30\ne: 010\nf: 0o17\ng: 0x1f\nh: 2024-01-01\ni: TRUE\nj: ~\n'
                           'k: 1e3\nl: .inf\nm: "1"\n')
    assert data == {'a': 'yes', 'b': 'No', 'c': 'on', 'd': '1:30', 'e': 10, 'f': 15, 'g': 31, 'h': '2024-01-01',
                    'i': True, 'j': None, 'k': 1000.0, 'l': float('inf'), 'm': '1'}


def test_size_limit_and_non_string_keys():
    with pytest.raises(YamlLoadError, match='the limit is 100'):
        load_yaml('x: ' + 'a' * 200, max_bytes=100)
    with pytest.raises(YamlLoadError) as info:
        load_yaml('a: 1\n1: one\ntrue: yes\n')
    assert [(p.line, p.message.split(';')[0]) for p in info.value.problems] == [
        (2, "key '1' is not a string"), (3, "key 'true' is not a string")]


def test_validate_on_an_alias_bomb_returns_promptly(tmp_path, capsys):
    f = tmp_path / 'lol.yaml'
    f.write_text('name: lol\n' + bomb())
    assert cli(['validate', str(f)]) == 1
    assert f'{f}:7: <root>: alias *l4 expands past 100000 nodes' in capsys.readouterr().out


RUN = textwrap.dedent('''\
    scheduler: guess_number.yaml
    backend: scripted
    batch_size: 2
    ''')


def test_run_configs_use_the_same_reader(tmp_path):
    f = tmp_path / 'run.yaml'
    f.write_text(RUN + 'batch_size: 4\n')
    with pytest.raises(RunConfigError, match=r'run.yaml:4: batch_size: duplicate key .batch_size. \(first at line 3\)'):
        load_run_config(f)
    f.write_text(RUN + bomb())
    with pytest.raises(RunConfigError, match='expands past 100000 nodes'):
        load_run_config(f)
    f.write_bytes(RUN.encode() + b'out: caf\xe9\n')
    with pytest.raises(RunConfigError, match='not UTF-8 text'):
        load_run_config(f)
    f.write_text(RUN.replace('batch_size: 2', 'batch_size: yes'))
    with pytest.raises(RunConfigError, match='batch_size'):
        load_run_config(f)
    f.write_text(RUN.replace('batch_size: 2', 'batch_size: true'))
    with pytest.raises(RunConfigError, match='batch_size'):
        load_run_config(f)


def test_mtflow_run_on_a_bombed_run_config_fails_fast(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'run.yaml').write_text(RUN + bomb())
    assert cli(['run', 'run.yaml', '-q']) == 2
    assert 'expands past 100000 nodes' in capsys.readouterr().err


def test_mtflow_run_checks_the_scheduler_before_loading_the_backend(tmp_path, capsys, monkeypatch):
    """Every problem of the scheduler is reported; the backend (here one that cannot load) is never built."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / 's.yaml').write_text('name: s\nmax_turns: yes\ntools:\n  - name: python\n    options: {timeout_s: -5}\n')
    (tmp_path / 'run.yaml').write_text('scheduler: s.yaml\nbackend: hf\nmodel: /no/such/model/dir\n')
    import mtflow.commands.run as run_cmd

    monkeypatch.setattr(run_cmd, 'build_backend', lambda cfg: pytest.fail('the backend was built'))
    assert cli(['run', 'run.yaml', '-q']) == 2
    err = capsys.readouterr().err
    assert 's.yaml:2: max_turns' in err
    assert "s.yaml:5: tools[0].options.timeout_s: python tool: option 'timeout_s'" in err


def test_validate_a_run_config_with_a_python_scheduler(tmp_path, capsys):
    (tmp_path / 'good.py').write_text('from mtflow import Scheduler\n\nclass Mine(Scheduler):\n    pass\n')
    (tmp_path / 'boom.py').write_text('raise RuntimeError("broken module")\n')
    (tmp_path / 'notsched.py').write_text('class Plain:\n    pass\n')
    cases = {'good.py:Mine': None, 'boom.py:Thing': 'importing', 'notsched.py:Plain': 'is not a scheduler'}
    for ref, expected in cases.items():
        f = tmp_path / 'run.yaml'
        f.write_text(f'scheduler: {ref}\nbackend: scripted\n')
        rc = cli(['validate', str(f)])
        out = capsys.readouterr().out
        if expected is None:
            assert rc == 0 and f'{f}: OK' in out and f'  {ref}  ({f}: scheduler)' in out
        else:
            assert rc == 1 and expected in out and f'{f}:1: scheduler:' in out  # the key's line (issue 27 item 8)
