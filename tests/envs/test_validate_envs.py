"""``mtflow validate`` on scheduler files and run configs naming each environment kind (impl,
gym, openenv, textarena) and a reasoning-gym dataset: valid ones pass without starting anything;
each mistake is reported with its file, line and field."""
from __future__ import annotations

import textwrap

import pytest

from mtflow.cli import main

VALID = {
    'impl.yaml': 'env: {impl: guess_number}\n',
    'gym.yaml': 'env:\n  gym: tests.envs.text_envs:make_timed\n  kwargs: {max_episode_steps: 2}\n',
    'openenv_url.yaml': 'env:\n  openenv: {url: "http://127.0.0.1:9", max_sessions: 4}\n',
    'openenv_launch.yaml': 'env:\n  openenv:\n    launch: tests.envs.openenv_app:app\n    replicas: 2\n',
    'textarena.yaml': 'env:\n  textarena: {id: Mastermind-v0-raw, kwargs: {max_turns: 3}}\n',
}

INVALID = {
    'two_kinds.yaml': ('env:\n  impl: guess_number\n  gym: tests.envs.text_envs:make_timed\n',
                       ':1: env: give exactly one of impl, gym, openenv, textarena, skyrl_gym, gem, nemo_gym, verifiers '
                       '(got impl, gym)'),
    'url_and_launch.yaml': ('name: x\nenv:\n  openenv:\n    url: http://127.0.0.1:9\n    launch: a.b:app\n',
                            ':3: env.openenv: give either url or launch'),
    'bad_scheme.yaml': ('env:\n  openenv: {url: "127.0.0.1:9"}\n', ":2: env.openenv: url '127.0.0.1:9' must start with http://"),
    'bad_option.yaml': ('env:\n  openenv:\n    url: http://127.0.0.1:9\n    sessions: 3\n',
                        ":4: env.openenv.sessions: unknown key 'sessions'"),
    'kwargs_openenv.yaml': ('env:\n  openenv: {url: "http://h:1"}\n  kwargs: {a: 1}\n',
                            ':3: env.kwargs: kwargs applies to impl and gym; put openenv options under openenv:'),
    'gym_name.yaml': ('env:\n  gym: CartPole\n', ":2: env.gym: gym: 'CartPole' must look like 'module:Class'"),
    'gym_missing.yaml': ('env:\n  gym: no_such_module_i15:Env\n', ":2: env.gym: cannot resolve 'no_such_module_i15:Env'"),
    'textarena_id.yaml': ('env:\n  textarena: {id: NoSuchGame-v0}\n',
                          ":2: env.textarena: cannot create environment 'NoSuchGame-v0'"),
}


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))

    def write(name, text):
        (tmp_path / name).write_text(text)
        return name
    return write


def test_valid_env_kinds_pass_without_starting_a_server(files, capsys, monkeypatch):
    pytest.importorskip('gymnasium')
    pytest.importorskip('openenv.core')
    pytest.importorskip('textarena')
    import subprocess
    names = [files(n, t) for n, t in VALID.items()]
    started = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):  # validating must launch no server
        started.append(args)
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, 'Popen', popen)
    assert main(['validate', *names]) == 0
    out = capsys.readouterr().out
    assert all(f'{n}: OK' in out for n in names)
    assert started == []


@pytest.mark.parametrize('name', sorted(INVALID))
def test_each_mistake_names_file_line_and_field(files, capsys, name):
    if name == 'textarena_id.yaml':
        pytest.importorskip('textarena')
    text, expected = INVALID[name]
    files(name, text)
    assert main(['validate', name]) == 1
    out = capsys.readouterr().out
    assert f'{name}{expected}' in out, out
    assert out.startswith(name)


def test_run_configs_naming_env_kinds_and_a_reasoning_gym_dataset(files, capsys):
    pytest.importorskip('reasoning_gym')
    pytest.importorskip('openenv.core')
    files('sched.yaml', VALID['openenv_launch.yaml'])
    files('run.yaml', textwrap.dedent('''\
        scheduler: sched.yaml
        backend: scripted
        dataset: {reasoning_gym: {name: leg_counting, size: 4, seed: 1}}
        num_generations: 2
        '''))
    files('bad_run.yaml', 'scheduler: bad_sched.yaml\nbackend: scripted\n')
    files('bad_sched.yaml', INVALID['url_and_launch.yaml'][0])
    files('bad_dataset.yaml', 'scheduler: sched.yaml\ndataset:\n  reasoning_gym: {name: leg_countin}\n')
    assert main(['validate', 'run.yaml', 'bad_run.yaml', 'bad_dataset.yaml']) == 1
    out = capsys.readouterr().out
    assert 'run.yaml: OK' in out
    assert 'bad_sched.yaml:3: env.openenv: give either url or launch' in out
    assert "bad_dataset.yaml:2: dataset: reasoning_gym.name: unknown task 'leg_countin' (similar: leg_counting" in out


def test_every_ready_config_and_scheduler_validates(capsys, monkeypatch):
    for module in ('openenv.core', 'reasoning_gym', 'textarena'):
        pytest.importorskip(module)
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    files = sorted(str(p.relative_to(root)) for p in [*root.glob('configs/*.yaml'), *root.glob('schedulers/*.yaml')])
    assert 'configs/reasoning_gym.yaml' in files and 'schedulers/openenv_guess.yaml' in files
    assert main(['validate', *files]) == 0, capsys.readouterr().out


def test_env_problems_come_with_every_other_problem_at_once(files, capsys):
    """Issue 12's rule for every env kind: the env section's build problem (here a gym class
    rejecting its kwargs) is reported beside the other sections' problems, each with its line."""
    pytest.importorskip('gymnasium')
    files('many.yaml', textwrap.dedent('''\
        parser: no_such_parser
        no_such_key: 1
        env:
          gym: tests.envs.text_envs:make_timed
          kwargs: {no_such_kwarg: 1}
        '''))
    assert main(['validate', 'many.yaml']) == 1
    out = capsys.readouterr().out
    assert 'many.yaml:1: parser:' in out, out
    assert "many.yaml:2: no_such_key: unknown key 'no_such_key'" in out, out
    assert "many.yaml:5: env.kwargs: cannot create environment 'tests.envs.text_envs:make_timed'" in out, out


def test_validate_lists_gym_and_openenv_launch_among_the_imports(files, capsys):
    pytest.importorskip('gymnasium')
    pytest.importorskip('openenv.core')
    names = [files('gym.yaml', VALID['gym.yaml']), files('launch.yaml', VALID['openenv_launch.yaml'])]
    assert main(['validate', *names]) == 0
    out = capsys.readouterr().out
    assert 'tests.envs.text_envs:make_timed  (env.gym)' in out, out
    assert 'tests.envs.openenv_app:app  (env.openenv.launch)' in out, out
