"""``mtflow gateway CONFIG`` as a process: it prints the URL it serves (``--port 0``), writes a run
directory like ``mtflow run``'s that ``check-tokens``, ``trace`` and ``diff`` read, stops cleanly on
a signal, and ``--resume`` keeps every finished session and names the open ones the restart cut."""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import List, Optional

import httpx
import pytest

from mtflow.cli import main
from tests.gateway.helpers import TIMEOUT_S, assert_tokens_exact, lines
from tests.tiny_model import make_tokenizer

ROOT = Path(__file__).resolve().parents[2]
HELLO = {'model': 'm', 'messages': [{'role': 'user', 'content': 'hello'}]}


class Served:
    """A ``mtflow gateway CONFIG --out OUT`` process (or any ``mtflow`` command line that serves:
    ``argv``); its first stdout line names the URL."""

    def __init__(self, config: Path, out: Path, *extra: str, argv: Optional[List[str]] = None) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''))
        argv = argv or ['gateway', str(config), '--port', '0', '--out', str(out), '-q', *extra]
        self.proc = subprocess.Popen([sys.executable, '-m', 'mtflow', *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=config.parent)
        lines_: 'queue.Queue[str]' = queue.Queue()
        threading.Thread(target=lambda: lines_.put(self.proc.stdout.readline()), daemon=True).start()
        try:
            first = lines_.get(timeout=TIMEOUT_S)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError('mtflow gateway printed no URL') from None
        found = re.search(r'serving (http://\S+)', first)
        if found is None:
            self.proc.kill()
            raise AssertionError(f'no URL in {first!r}: {self.proc.stderr.read()[-2000:]}')
        self.url = found.group(1)
        self.first = first

    def stop(self, sig: int) -> tuple:
        self.proc.send_signal(sig)
        out, err = self.proc.communicate(timeout=TIMEOUT_S)
        return self.proc.returncode, err


@pytest.fixture
def config(tmp_path):
    make_tokenizer().save_pretrained(tmp_path / 'tok')
    (tmp_path / 'script.jsonl').write_text('"hi there"\n"and more"\n')
    path = tmp_path / 'gateway.yaml'
    path.write_text(f'backend: scripted\nbackend_options: {{path: script.jsonl, cycle: true, tokenizer: '
                    f'{tmp_path / "tok"}}}\nrequest_config: {{max_tokens: 32}}\ngateway: {{idle_timeout_s: 60}}\n')
    return path


def test_the_command_serves_stops_and_resumes(tmp_path, config, capsys):
    out = tmp_path / 'run'
    served = Served(config, out)
    chat = f'{served.url}/s/{{}}/v1/chat/completions'
    assert httpx.post(chat.format('a'), json=HELLO, timeout=TIMEOUT_S).json()['choices'][0]['message']['content'] == \
        'hi there'
    assert httpx.post(f'{served.url}/s/a/finish', json={'reward': 1}, timeout=TIMEOUT_S).status_code == 200
    assert httpx.post(chat.format('b'), json=HELLO, timeout=TIMEOUT_S).status_code == 200  # left open
    models = httpx.get(f'{served.url}/s/a/v1/models', timeout=TIMEOUT_S).json()
    assert models['data'][0]['id'].startswith('scripted')
    code, err = served.stop(signal.SIGINT)
    assert code == 0, err
    assert [line['uuid'] for line in lines(out)] == ['a']
    interrupted = [json.loads(x) for x in (out / 'interrupted.jsonl').read_text().splitlines()]
    assert [(x['uuid'], x['finish_reason']) for x in interrupted] == [('b', 'interrupted')]
    assert json.loads((out / 'summary.json').read_text())['status'] == 'interrupted'
    assert [json.loads(x)['session'] for x in (out / 'sessions.jsonl').read_text().splitlines()] == ['a', 'b']
    assert_tokens_exact(out, segments=1)
    assert main(['check-tokens', str(out)]) == 0
    assert main(['trace', 'show', str(out / 'trace.jsonl')]) == 0
    assert main(['trace', 'html', str(out / 'trace.jsonl'), '--trajectories', str(out / 'trajectories.jsonl'),
                 '-o', str(tmp_path / 'view.html')]) == 0
    assert 'client_finished' in (tmp_path / 'view.html').read_text()
    assert main(['diff', str(out), str(out)]) == 0
    capsys.readouterr()

    again = Served(config, out, '--resume')
    cut = httpx.post(again.url + '/s/b/v1/chat/completions', json=HELLO, timeout=TIMEOUT_S)
    assert cut.status_code == 409 and cut.json()['error']['code'] == 'session_cut'
    done = httpx.post(again.url + '/s/a/v1/chat/completions', json=HELLO, timeout=TIMEOUT_S)
    assert done.status_code == 409 and done.json()['error']['code'] == 'session_finished'
    assert httpx.post(again.url + '/s/c/v1/chat/completions', json=HELLO, timeout=TIMEOUT_S).status_code == 200
    assert httpx.post(f'{again.url}/s/c/finish', json={'reward': 0}, timeout=TIMEOUT_S).status_code == 200
    code, err = again.stop(signal.SIGTERM)
    assert code == 0, err
    assert "1 open session(s) were cut by the restart (refused from now on): b" in err
    assert [line['uuid'] for line in lines(out)] == ['a', 'c']
    assert json.loads((out / 'summary.json').read_text())['status'] == 'complete'


def test_a_config_mistake_is_one_line(tmp_path, config, capsys):
    config.write_text(config.read_text() + 'gateway: {idle_timeout_s: -1}\n')
    assert main(['gateway', str(config), '--out', str(tmp_path / 'x')]) == 2
    err = capsys.readouterr().err
    assert 'gateway' in err and err.count('\n') == 1
    bad = tmp_path / 'bad.yaml'
    bad.write_text('backend: scripted\ngateway: {idle_timeout_s: -1}\n')
    assert main(['gateway', str(bad), '--out', str(tmp_path / 'y')]) == 2
    assert 'bad.yaml:2: gateway.idle_timeout_s' in capsys.readouterr().err


@pytest.mark.parametrize('section, message', [
    ('{reasoning: thinkk}', "gateway.reasoning: unknown reasoning parser 'thinkk'"),
    ('{tool_parser: hermez}', "gateway.tool_parser: unknown parser 'hermez'"),
    ('{tool_parser: kimi_k2, reasoning: think}', "gateway.reasoning: 'think' does not split what parser 'kimi_k2' reads"),
])
def test_the_gateway_parsers_are_checked_with_the_config(tmp_path, section, message, capsys):
    """A wrong gateway.reasoning or gateway.tool_parser was a traceback after the model loaded (and
    validate said OK); a reasoning split of another family served calls as thinking. Now one line at
    its line, from validate too."""
    bad = tmp_path / 'bad.yaml'
    bad.write_text(f'backend: scripted\ngateway: {section}\n')
    assert main(['gateway', str(bad), '--out', str(tmp_path / 'y')]) == 2
    err = capsys.readouterr().err
    assert f'bad.yaml:2: {message}' in err and err.count('\n') == 1 and not (tmp_path / 'y').exists()
    assert main(['validate', str(bad)]) == 1
    assert f'bad.yaml:2: {message}' in capsys.readouterr().out


def test_keys_the_gateway_never_reads_are_refused(tmp_path, config):
    """A scheduler (its parser, reasoning, rewards), a dataset, policies were ignored without a word
    and the gateway served (an episode file's scheduler was a KeyError traceback)."""
    base = config.read_text()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''))
    for extra, said in (('scheduler: mine.yaml\n', 'gateway.yaml:5: scheduler: mtflow gateway does not read scheduler ('),
                        ('dataset: tasks.jsonl\npolicies:\n  b: {backend: scripted}\n',
                         'gateway.yaml:5: dataset: mtflow gateway does not read dataset, policies (')):
        config.write_text(base + extra)
        proc = subprocess.run([sys.executable, '-m', 'mtflow', 'gateway', str(config), '--port', '0', '--out',
                               str(tmp_path / 'x'), '-q'], capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
        assert proc.returncode == 2 and said in proc.stderr and proc.stderr.count('\n') == 1, proc.stderr
    assert not (tmp_path / 'x').exists()


def test_a_finish_is_answered_only_once_its_session_is_on_disk(tmp_path, config):
    """Issue 47, item 9: the answer to ``POST /finish`` means the trajectory is durable. Killed
    (SIGKILL, no cleanup) the moment the answers came, the gateway has every session it answered
    on disk, and ``--resume`` calls none of them cut."""
    out = tmp_path / 'run'
    served = Served(config, out)
    chat = f'{served.url}/s/{{}}/v1/chat/completions'
    names = [f'ep{k}' for k in range(8)]
    with httpx.Client(timeout=TIMEOUT_S) as client:
        for name in names:
            assert client.post(chat.format(name), json=HELLO).status_code == 200
    answers: 'queue.Queue[tuple]' = queue.Queue()

    def finish(name: str) -> None:  # the clients finish at once, together
        answers.put((name, httpx.post(f'{served.url}/s/{name}/finish', json={'reward': 1}, timeout=TIMEOUT_S)))

    threads = [threading.Thread(target=finish, args=(name, )) for name in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    served.proc.kill()  # no flush, no close: only what was durable survives
    served.proc.communicate(timeout=TIMEOUT_S)
    answered = sorted(name for name, reply in (answers.get() for _ in names) if reply.status_code == 200)
    assert answered == names
    assert sorted(line['uuid'] for line in lines(out)) == names
    resumed = Served(config, out, '--resume')
    code, err = resumed.stop(signal.SIGINT)
    assert code == 0 and '8 sessions already written' in err and 'were cut' not in err, err
def test_a_config_without_backend_names_the_default_backend_and_its_model(tmp_path):
    """A gateway config without ``backend:`` serves hf's model, and the first line named no model
    (issue 47, item 7): the serving line and ``GET /v1/models`` name the backend and the model,
    and that the backend is the default one."""
    from tests.tiny_model import make_model

    tok = make_tokenizer()
    make_model(tok).save_pretrained(tmp_path / 'tiny')
    tok.save_pretrained(tmp_path / 'tiny')
    config = tmp_path / 'gateway.yaml'
    config.write_text('model: tiny\nrequest_config: {max_tokens: 4}\n')
    served = Served(config, tmp_path / 'run')
    try:
        first = served.first
        assert f'with hf (tiny on cpu), the default backend ({config} names none); writing ' in first, first
        model = httpx.get(f'{served.url}/s/a/v1/models', timeout=TIMEOUT_S).json()['data'][0]
        assert (model['id'], model['backend']) == ('tiny', 'hf (tiny on cpu)')
    finally:
        assert served.stop(signal.SIGINT)[0] == 0
    named = tmp_path / 'named.yaml'
    named.write_text('backend: hf\nmodel: tiny\n')
    served = Served(named, tmp_path / 'run2')
    try:
        assert 'with hf (tiny on cpu); writing ' in served.first, served.first
    finally:
        assert served.stop(signal.SIGINT)[0] == 0
