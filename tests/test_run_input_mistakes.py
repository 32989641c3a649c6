"""Mistakes a new user makes with ``mtflow run`` that used to pass in silence or with a misleading
line (issue 47, items 1 and 8), each now one line naming the file, line, field or flag, exit 2,
before a backend is built; and a chat-mode run whose summary said ``generated tokens 0`` beside a
tokens/s figure now counts what the server generated."""
from __future__ import annotations

import http.server
import json

import pytest

from mtflow.cli import main
from tests.helpers import http_server

TOOLS = 'def search(query: str, limit: int = 5) -> str:\n    return query\n'
#: a run config over the scripted backend whose script is there but holds no JSON: the backend's preflight
#: (which finds a missing one) passes it, and building the backend would fail on its first line, so an
#: error about the mistake proves it was found first
BASE = 'backend: scripted\nmodel: never_built.jsonl\ndataset: data.jsonl\nout: out\n'


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv('MTFLOW_DEBUG', raising=False)
    (tmp_path / 'tools.py').write_text(TOOLS)
    (tmp_path / 'never_built.jsonl').write_text('not a script: building the backend fails here\n')
    (tmp_path / 'data.jsonl').write_text(''.join(json.dumps({'uuid': f'q{i}', 'prompt': f'p{i}'}) + '\n'
                                                 for i in range(3)))
    return tmp_path


def _run(capsys, *args):
    code = main(['run', *args, '--no-progress'])
    captured = capsys.readouterr()
    assert 'Traceback' not in captured.err, captured.err
    return code, captured.err.strip().splitlines()


def test_a_tool_whose_parameters_its_function_refuses_stops_the_run_before_the_backend(work, capsys):
    (work / 'sched.yaml').write_text('name: s\ntools:\n  - name: search\n    impl: tools:search\n    parameters:\n'
                                     '      type: object\n      properties: {q: {type: string}}\n')
    (work / 'run.yaml').write_text(BASE + 'scheduler: sched.yaml\n')
    code, err = _run(capsys, 'run.yaml')
    assert code == 2 and len(err) == 2 and not any('never_built' in line for line in err)
    assert f"sched.yaml:7: tools[0].parameters.properties.q: tool 'search': parameter 'q' is declared, but " \
           f"search(query, limit=5) in {work / 'tools.py'}:1 takes no argument 'q'" in err[0]
    assert f"sched.yaml:7: tools[0].parameters.properties: tool 'search': search(query, limit=5) in " \
           f"{work / 'tools.py'}:1 requires 'query', which parameters does not declare: every call fails" in err[1]
    assert not (work / 'out').exists()


def test_an_unknown_backend_option_set_by_set_names_the_flag_not_the_file(work, capsys):
    (work / 'sched.yaml').write_text('name: s\nmax_turns: 1\n')
    (work / 'run.yaml').write_text(BASE + 'scheduler: sched.yaml\n')
    code, err = _run(capsys, 'run.yaml', '--set', 'backend_options.cylce=true')
    assert code == 2
    assert err == ["mtflow: command line: --set backend_options.cylce=true: backend_options.cylce: unknown key 'cylce' "
                   "for backend scripted; did you mean 'cycle'? (known: path, outputs, respond, cycle, "
                   'honor_max_tokens, tokenizer, chat_template, sample, seed, prefix_policy)']


def test_a_scheduler_file_given_as_the_run_config_says_so_and_names_the_config_that_uses_it(work, capsys):
    (work / 'configs').mkdir()
    (work / 'schedulers').mkdir()
    (work / 'schedulers' / 'game.yaml').write_text('name: game\ndescription: a game\nmax_turns: 3\n'
                                                   'system_prompt: Play.\nstop: {on_length: false}\n')
    (work / 'configs' / 'other.yaml').write_text('scheduler: ../schedulers/nope.yaml\n')
    code, err = _run(capsys, 'schedulers/game.yaml')
    assert code == 2
    said = ("mtflow: schedulers/game.yaml is a scheduler file, not a run config (its keys name, description, "
            "system_prompt, stop are a scheduler's): give a run config that names it")
    assert err == [said + ' (scheduler: schedulers/game.yaml, with backend, model and dataset: docs/cli.md; no run '
                   'config in configs/ names it); mtflow validate schedulers/game.yaml checks the scheduler file alone']
    (work / 'configs' / 'game.yaml').write_text(BASE + 'scheduler: ../schedulers/game.yaml\n')
    code, err = _run(capsys, 'schedulers/game.yaml')
    assert code == 2 and err == [said + ', as configs/game.yaml does (mtflow run configs/game.yaml)']


@pytest.mark.parametrize('text, said', [
    ('[{"prompt": "a"}, {"prompt": "b"}]\n', 'the file is a JSON array, not JSON Lines'),
    ('[\n  {"prompt": "a"},\n  {"prompt": "b"}\n]\n', 'the file is a JSON array, not JSON Lines'),
    ('{\n  "prompt": "a"\n}\n', 'a JSON object spread over several lines'),
], ids=['array', 'pretty-array', 'pretty-object'])
def test_a_dataset_that_is_one_json_document_says_it_must_be_json_lines(work, capsys, text, said):
    (work / 'sched.yaml').write_text('name: s\nmax_turns: 1\n')
    (work / 'run.yaml').write_text(BASE + 'scheduler: sched.yaml\n')
    (work / 'prompts.json').write_text(text)
    code, err = _run(capsys, 'run.yaml', '--dataset', 'prompts.json')
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f'mtflow: {work / "prompts.json"}:1: {said}'), err
    assert f'> {work / "prompts.jsonl"})' in err[0]


class _ChatServer(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server as a hosted API answers: text and usage, no token ids."""

    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 - http.server's name
        self._send({'object': 'list', 'data': [{'id': 'served', 'object': 'model'}]})

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers['Content-Length']))
        self._send({'id': 'c1', 'object': 'chat.completion', 'created': 0, 'model': 'served',
                    'choices': [{'index': 0, 'message': {'role': 'assistant', 'content': 'seven tokens of text'},
                                 'finish_reason': 'stop'}],
                    'usage': {'prompt_tokens': 9, 'completion_tokens': 7, 'total_tokens': 16}})

    def log_message(self, *args):
        pass


@pytest.fixture
def chat_server():
    with http_server(_ChatServer) as url:
        yield url


def test_a_chat_mode_run_counts_the_tokens_the_server_generated(work, capsys, chat_server):
    """A server that returns text and ``usage`` but no token ids: the summary said ``generated
    tokens 0`` while tokens/s (from the usage) was not 0; both count the usage now."""
    (work / 'sched.yaml').write_text('name: s\nmax_turns: 2\n')
    (work / 'run.yaml').write_text(f'scheduler: sched.yaml\nbackend: openai\nmodel: served\ndataset: data.jsonl\n'
                                   f'out: out\nbackend_options: {{base_url: "{chat_server}"}}\n')
    assert main(['run', 'run.yaml', '--no-progress']) == 0
    out = capsys.readouterr().out
    summary = json.loads((work / 'out' / 'summary.json').read_text())
    assert summary['generated_tokens'] == 3 * 7 and summary['tokens_per_s'] > 0
    assert 'generated tokens    │ 21 ' in out
    events = [json.loads(l) for l in (work / 'out' / 'trace.jsonl').read_text().splitlines()]
    assert sum(e.get('tokens') or 0 for e in events) == 21
