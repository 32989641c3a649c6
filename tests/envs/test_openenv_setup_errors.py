"""OpenEnv configuration mistakes found before the model generates anything, each in one line
naming the file, line and field, through ``mtflow validate`` and ``mtflow run`` with real servers
(``tests/envs/openenv_app.py``, launched by the scheduler or by the test).

- a wrong ``action_field`` (the server rejects every action with ``VALIDATION_ERROR``): used to
  end every request on ``max_turns`` with reward 0.0 and no error; now ``validate`` checks it
  against the server's action schema and a step that hits it fails its request, naming the field;
- an unreachable or malformed ``url``, a ``launch`` module that does not exist, ``batch_size``
  larger than ``max_sessions``: used to pass ``validate`` and fail only after turn 1 of every
  request; now ``validate`` reports the static ones and ``mtflow run`` opens a session on each
  server before the model loads."""
from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip('openenv.core', reason="needs the 'openenv' extra (openenv 0.10)")

from mtflow import Executor
from mtflow.cli import main
from mtflow.declarative import load_scheduler
from mtflow.declarative.envs.openenv_env import OpenEnvActionError
from tests.envs.test_openenv import APP, ROOT, requests
from tests.helpers import out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))

    def write(name, text):
        (tmp_path / name).write_text(text)
        return name

    lines = [{'uuid': f'p{i}', 'messages': [{'role': 'system', 'content': 'Play.'}], 'seed': 10 + i} for i in range(2)]
    write('data.jsonl', ''.join(json.dumps(l) + '\n' for l in lines))
    write('script.jsonl', json.dumps({'content': 'guess 5'}) + '\n')
    return write


def _run_config(files, sched, extra=''):
    return files('run.yaml', f'scheduler: {sched}\nbackend: scripted\nmodel: script.jsonl\ndataset: data.jsonl\n'
                             f'out: out\nmax_turns: 3\n{extra}')


def test_a_wrong_action_field_is_a_validate_error_and_fails_the_run_before_turn_1(files, capsys, tmp_path):
    sched = files('sched.yaml', f'name: digits\nmax_turns: 3\nenv:\n  openenv:\n    launch: {APP}\n'
                                '    action_field: msg\n')
    assert main(['validate', sched]) == 1
    err = capsys.readouterr()
    assert ("sched.yaml:6: env.openenv.action_field: action_field 'msg' is not a field of the server's action "
            'schema; it has: metadata, message (required: message)') in err.out + err.err
    run = _run_config(files, sched)
    assert main(['run', run, '--no-progress']) == 2  # a configuration error, before the model loads
    err = capsys.readouterr().err
    assert "sched.yaml:6: env.openenv.action_field: action_field 'msg'" in err and 'Traceback' not in err
    assert not (tmp_path / 'out' / 'trajectories.jsonl').exists() or not (tmp_path / 'out' / 'trajectories.jsonl').read_text()


def test_a_step_the_server_rejects_for_its_schema_fails_the_request_naming_the_field():
    """Past the checks (a server whose schema could not be read): the step's VALIDATION_ERROR is a
    configuration error of that request, not an observation with reward 0.0."""
    command = ['{python}', '-m', 'uvicorn', APP, '--host', '127.0.0.1', '--port', '{port}', '--log-level', 'warning']
    sched = load_scheduler({'name': 'digits', 'max_turns': 3,  # a command: validate does not ask its schema
                            'env': {'openenv': {'launch': command, 'action_field': 'msg'}}}, base_dir=str(ROOT))
    try:
        result = Executor(sched, lambda reqs, cfg: [out('guess 5') for _ in reqs], max_turns=3,
                          on_error='return').run(requests(['a', 'b']))
    finally:
        sched.close()
    assert result.finish_reasons == ['error', 'error']
    for failure in result.failures:
        assert isinstance(failure.error, OpenEnvActionError)
        msg = str(failure.error)
        assert 'Invalid message (code: VALIDATION_ERROR)' in msg and "action_field 'msg'" in msg
        assert 'it has: metadata, message' in msg and failure.turn == 1


@pytest.mark.parametrize('openenv, message', [
    ('{url: "http://127.0.0.1:99999"}', "sched.yaml:3: env.openenv: url 'http://127.0.0.1:99999': the port must be 1..65535"),
    ('{url: "http://127.0.0.1:9 "}', "sched.yaml:3: env.openenv: url 'http://127.0.0.1:9 ' contains whitespace"),
    ('{launch: "no_such_module_i27:app"}',
     "sched.yaml:3: env.openenv.launch: no module named 'no_such_module_i27' (launch 'no_such_module_i27:app'"),
])
def test_validate_reports_a_malformed_url_or_a_missing_launch_module(files, capsys, openenv, message):
    sched = files('sched.yaml', f'name: s\nenv:\n  openenv: {openenv}\n')
    assert main(['validate', sched]) == 1
    captured = capsys.readouterr()
    assert message in captured.out + captured.err


def test_validate_reports_a_batch_larger_than_the_sessions_allowed(files, capsys):
    sched = files('sched.yaml', 'name: s\nenv:\n  openenv: {url: "http://127.0.0.1:9", max_sessions: 2}\n')
    run = _run_config(files, sched, 'batch_size: 5\n')
    assert main(['validate', run]) == 1
    captured = capsys.readouterr()
    assert ('run.yaml:7: batch_size: 5 requests per batch need 5 OpenEnv sessions, but sched.yaml allows 2 '
            '(env.openenv.max_sessions 2 x 1 server(s))') in captured.out + captured.err
    files('ok.yaml', open(run).read().replace('batch_size: 5', 'batch_size: 2'))
    assert main(['validate', 'ok.yaml']) == 0


def test_an_unreachable_url_fails_the_run_before_the_model_loads(files, capsys):
    port = _free_port()  # nothing listens there
    sched = files('sched.yaml', f'name: s\nmax_turns: 3\nenv:\n  openenv: {{url: "http://127.0.0.1:{port}"}}\n')
    files('never_built.jsonl', 'not a script: building the backend fails here\n')  # its preflight passes it
    run = files('run.yaml', f'scheduler: {sched}\nbackend: scripted\nmodel: never_built.jsonl\n'
                            'dataset: data.jsonl\nout: out\n')
    started = time.monotonic()
    assert main(['run', run, '--no-progress']) == 2
    err = capsys.readouterr().err
    assert f'sched.yaml: env.openenv: OpenEnv server http://127.0.0.1:{port} cannot open a session' in err
    assert 'never_built' not in err, 'the backend was never built'
    assert time.monotonic() - started < 15


@contextlib.contextmanager
def _url_server():
    """``tests/envs/openenv_app.py`` served by uvicorn on a free port (started, then stopped): its port."""
    port = _free_port()
    server = subprocess.Popen([sys.executable, '-m', 'uvicorn', APP, '--host', '127.0.0.1', '--port', str(port),
                               '--log-level', 'warning'], cwd=str(ROOT), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, 'the test server did not start'
                time.sleep(0.1)
        yield port
    finally:
        server.terminate()
        server.wait(10)


def test_a_reachable_url_server_passes_the_check_and_the_run_plays(files, capsys, tmp_path):
    with _url_server() as port:
        sched = files('sched.yaml', f'name: s\nmax_turns: 3\nenv:\n  openenv: {{url: "http://127.0.0.1:{port}"}}\n')
        assert main(['validate', sched]) == 0
        assert main(['run', _run_config(files, sched, 'backend_options: {cycle: true}\n'), '--no-progress', '-q']) == 0
        trajs = [json.loads(l) for l in (tmp_path / 'out' / 'trajectories.jsonl').read_text().splitlines()]
        assert len(trajs) == 2 and all(t['finish_reason'] != 'error' for t in trajs)


def test_an_observation_field_typo_is_checked_against_the_servers_schema(files, capsys, tmp_path):
    """``observation_field: promt`` used to pass ``validate`` and fail every request after its
    first generation ('the observation has no field'); now the observation schema says so."""
    sched = files('sched.yaml', f'name: digits\nmax_turns: 3\nenv:\n  openenv:\n    launch: {APP}\n'
                                '    observation_field: promt\n')
    message = ("sched.yaml:6: env.openenv.observation_field: observation_field 'promt' is not a field of the "
               "server's observation schema; it has: prompt; did you mean 'prompt'?")
    assert main(['validate', sched]) == 1
    captured = capsys.readouterr()
    assert message in captured.out + captured.err
    assert main(['run', _run_config(files, sched), '--no-progress']) == 2
    err = capsys.readouterr().err
    assert message in err and 'Traceback' not in err
    files('sched.yaml', open(sched).read().replace('promt', 'prompt'))
    assert main(['validate', sched]) == 0


def test_a_url_servers_observation_schema_is_checked_before_the_model_loads(files, capsys):
    with _url_server() as port:
        sched = files('sched.yaml', f'name: s\nmax_turns: 3\nenv:\n  openenv:\n    url: "http://127.0.0.1:{port}"\n'
                                    '    image_fields: [frame]\n')
        files('never_built.jsonl', 'not a script: building the backend fails here\n')  # its preflight passes it
        run = files('run.yaml', f'scheduler: {sched}\nbackend: scripted\nmodel: never_built.jsonl\n'
                                'dataset: data.jsonl\nout: out\n')
        assert main(['run', run, '--no-progress']) == 2
        err = capsys.readouterr().err
        assert ("sched.yaml:6: env.openenv.image_fields: image_fields 'frame' is not a field of the server's "
                'observation schema; it has: prompt') in err, err
        assert 'never_built' not in err, 'the backend was never built'
