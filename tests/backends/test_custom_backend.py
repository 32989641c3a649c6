"""A backend of one's own, named like tools and environments are: ``backend: module:Class`` in a
run config (the module next to the config file), ``--backend module:Class``, or a name given to
:func:`mtflow.backends.register_backend` (docs/backends.md, "Writing a backend")."""
import json
import textwrap

import pytest

from mtflow import backends
from mtflow.backends import BACKENDS, BackendError, make_backend, register_backend
from mtflow.cli import main

BACKEND_MODULE = '''
from mtflow.backends import Backend, build_output

class EchoBackend(Backend):
    """Answers every request with its last message, upper-cased, and a fixed guess."""
    name = 'echo'

    def __init__(self, guess: int = 50, **_):
        super().__init__()
        self.guess = guess

    def generate(self, requests, options):
        return [build_output(f'ECHO {r.messages[-1]["content"][:20].upper()} I guess {self.guess}', None, 'stop')
                for r in requests]
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'my_backends.py').write_text(BACKEND_MODULE)
    (tmp_path / 'run.yaml').write_text(textwrap.dedent('''\
        scheduler: guess_number.yaml
        backend: my_backends:EchoBackend
        backend_options: {guess: 42}
        out: out
        limit: 2
        max_turns: 2
    '''))
    return tmp_path


def _lines(out_dir):
    return [json.loads(l) for l in (out_dir / 'trajectories.jsonl').read_text().splitlines() if l.strip()]


def test_a_run_config_names_its_own_backend_class_next_to_it(project):
    assert main(['run', 'run.yaml']) == 0
    lines = _lines(project / 'out')
    assert len(lines) == 2
    replies = [m['content'] for l in lines for m in l['messages'] if m['role'] == 'assistant']
    assert replies and all(r.startswith('ECHO ') and r.endswith('I guess 42') for r in replies)


def test_the_command_line_switches_to_a_backend_by_reference(project, monkeypatch):
    (project / 'run.yaml').write_text('scheduler: guess_number.yaml\nbackend: scripted\nout: out\nlimit: 1\n'
                                      'max_turns: 1\n')
    assert main(['run', 'run.yaml', '--backend', 'my_backends:EchoBackend']) == 0
    replies = [m['content'] for m in _lines(project / 'out')[0]['messages'] if m['role'] == 'assistant']
    assert replies == [replies[0]] and replies[0].startswith('ECHO ') and replies[0].endswith('I guess 50')


def test_a_reference_that_does_not_import_is_one_line_naming_file_line_and_field(project, capsys):
    (project / 'run.yaml').write_text('scheduler: guess_number.yaml\nout: out\nbackend: my_backends:NoSuchBackend\n')
    assert main(['validate', 'run.yaml']) != 0
    err = capsys.readouterr()
    text = err.out + err.err
    assert "run.yaml:3: backend: backend 'my_backends:NoSuchBackend': module 'my_backends' has no attribute" in text
    assert main(['run', 'run.yaml']) != 0
    text = ''.join(capsys.readouterr())
    assert "run.yaml:3: backend: backend 'my_backends:NoSuchBackend'" in text and 'Traceback' not in text


def test_register_backend_by_class_reference_or_the_old_table(project, monkeypatch):
    monkeypatch.syspath_prepend(str(project))
    from my_backends import EchoBackend  # noqa: E402  (written by the fixture)

    monkeypatch.setattr(backends, 'BACKENDS', dict(BACKENDS))
    register_backend('echo_cls', EchoBackend)
    register_backend('echo_ref', 'my_backends:EchoBackend')
    backends.BACKENDS['echo_table'] = EchoBackend  # docs of old said so: this raised TypeError
    for name in ('echo_cls', 'echo_ref', 'echo_table'):
        out = make_backend(name, guess=7)([_request('hello')])
        assert out[0].response.choices[0].message.content == 'ECHO HELLO I guess 7'
    with pytest.raises(BackendError, match="'echo_cls' is taken"):
        register_backend('echo_cls', EchoBackend)
    with pytest.raises(BackendError, match='register a class'):
        register_backend('bad', 42)


def test_a_reference_to_something_that_is_not_a_backend_is_refused(project, monkeypatch):
    monkeypatch.syspath_prepend(str(project))
    (project / 'not_backends.py').write_text('VALUE = 3\nclass NotCallable:\n    pass\n')
    with pytest.raises(BackendError, match='not a backend class'):
        make_backend('not_backends:VALUE')
    with pytest.raises(BackendError, match='not callable'):
        make_backend('not_backends:NotCallable')
    with pytest.raises(BackendError, match="no attribute 'Missing'"):
        make_backend('not_backends:Missing')


def _request(text):
    from mtflow.core.protocol import RolloutInferRequest

    return RolloutInferRequest(messages=[{'role': 'user', 'content': text}], uuid='r1')


def test_a_backend_from_an_installed_package_entry_point(tmp_path, monkeypatch):
    """Backends are in the one Registry: a package declares ``[mtflow.backends] name = module:Class``;
    it is listed without importing, and imported when a config names it."""
    import sys
    import textwrap

    from mtflow.backends import backend_names, check_backend_name
    from mtflow.core.registry import refresh_entry_points
    site = tmp_path / 'site'
    (site / 'mtflow_ep_backend').mkdir(parents=True)
    (site / 'mtflow_ep_backend' / '__init__.py').write_text(textwrap.dedent('''\
        from mtflow.backends import Backend, build_output

        class Loud(Backend):
            def generate(self, requests, request_config=None):
                return [build_output(r.messages[-1]['content'].upper(), [1], 'stop') for r in requests]
        '''))
    dist = site / 'mtflow_ep_backend-1.0.dist-info'
    dist.mkdir()
    (dist / 'METADATA').write_text('Metadata-Version: 2.1\nName: mtflow-ep-backend\nVersion: 1.0\n')
    (dist / 'entry_points.txt').write_text('[mtflow.backends]\nloud = mtflow_ep_backend:Loud\n'
                                           'broken = mtflow_ep_backend_missing:Nothing\n')
    monkeypatch.syspath_prepend(str(site))
    refresh_entry_points()
    try:
        assert 'loud' in backend_names() and 'mtflow_ep_backend' not in sys.modules
        assert check_backend_name('loud') == 'loud'
        out = make_backend('loud')([_request('hello')])
        assert out[0].response.choices[0].message.content == 'HELLO'
        with pytest.raises(BackendError, match='entry point mtflow.backends:broken.*mtflow-ep-backend'):
            make_backend('broken')
        with pytest.raises(BackendError, match="unknown backend 'lowd'; choose one of: hf, .*loud"):
            make_backend('lowd')
    finally:
        for name in [m for m in sys.modules if m.startswith('mtflow_ep_backend')]:
            del sys.modules[name]
        refresh_entry_points()


PLAIN_MODULE = '''
from mtflow.backends import build_output

class PlainBackend:
    """Not a mtflow Backend: a callable with its own async path, which async mode must use."""

    def __init__(self, **_):
        pass

    def __call__(self, requests, config):
        return [build_output('SYNC I guess 50', None, 'stop') for _ in requests]

    def async_rollout_fn(self):
        async def rollout(requests, config):
            return [build_output('ASYNC I guess 50', None, 'stop') for _ in requests]
        return rollout
'''


def test_async_mode_uses_the_async_path_of_a_backend_that_is_not_a_backend_subclass(project):
    (project / 'plain_backends.py').write_text(PLAIN_MODULE)
    assert main(['run', 'run.yaml', '--backend', 'plain_backends:PlainBackend', '--mode', 'async']) == 0
    replies = [m['content'] for l in _lines(project / 'out') for m in l['messages'] if m['role'] == 'assistant']
    assert replies and all(r == 'ASYNC I guess 50' for r in replies), replies
