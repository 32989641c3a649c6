"""A tool's result is bounded (issue 47, item 5): a 5 MB result reaches the next prompt, the
trajectory and the trace cut to the tool's ``max_observation`` (a documented default, or its YAML
value) with a marker the model reads, and the summary counts it; a real tokenizer never sees more
than the window a bound can show; what a tool prints is captured with its call, not written to
mtflow's stdout; and SIGTERM stops a run whose tool hangs, writing what finished."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtflow import Executor
from mtflow.backends.scripted import ScriptedBackend
from mtflow.cli import main
from mtflow.declarative import load_scheduler
from mtflow.tools.bounds import DEFAULT_MAX_OBSERVATION, window_chars
from tests.helpers import jsonl_lines, req, stop_by_sigterm

ROOT = Path(__file__).resolve().parents[2]
BIG = 5_000_000

TOOLS = '''
import os
import threading
import time


def huge(n: int) -> str:
    """Returns n characters (and prints a lot while at it)."""
    print('progress ' * 50_000)
    return 'y' * n


def hang(name: str) -> str:
    """Says it started, then never returns."""
    open(os.path.join(os.environ['MTFLOW_TEST_DIR'], name), 'w').close()
    threading.Event().wait()
    return 'never'


def quick(name: str) -> str:
    """Returns at once."""
    return 'done ' + name
'''


def _call(tool: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": tool, "arguments": arguments}) + "</tool_call>"


def _project(tmp_path: Path, tools: str, script: list, uuids: list) -> Path:
    (tmp_path / 'my_tools.py').write_text(TOOLS)
    (tmp_path / 'sched.yaml').write_text(f'name: s\nmax_turns: 3\nparser: hermes\ntools:\n{tools}'
                                         'observation: {mode: message, role: tool}\n')
    (tmp_path / 'data.jsonl').write_text(''.join(json.dumps({'uuid': u, 'prompt': 'go'}) + '\n' for u in uuids))
    (tmp_path / 'model.jsonl').write_text(''.join(json.dumps(line) + '\n' for line in script))
    (tmp_path / 'run.yaml').write_text('scheduler: sched.yaml\nbackend: scripted\nmodel: model.jsonl\n'
                                       'dataset: data.jsonl\nout: out\nmax_turns: 3\nbatch_size: 4\n')
    return tmp_path


def test_a_huge_result_is_cut_to_the_default_bound_and_counted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    script = [{'uuid': 'a', 'turn': 1, 'content': _call('huge', n=BIG)}, {'uuid': 'a', 'turn': 2, 'content': 'ok'},
              {'uuid': 'b', 'turn': 1, 'content': _call('small', n=BIG)}, {'uuid': 'b', 'turn': 2, 'content': 'ok'}]
    _project(tmp_path, '  - {name: huge, impl: "my_tools:huge"}\n'
             '  - {name: small, impl: "my_tools:huge", max_observation: 100, truncate_side: left}\n',
             script, ['a', 'b'])
    assert main(['run', 'run.yaml', '-q']) == 0
    printed = capsys.readouterr()
    assert 'progress' not in printed.out and 'progress' not in printed.err  # captured with the call
    lines = {t['uuid']: t for t in jsonl_lines(tmp_path / 'out' / 'trajectories.jsonl')}
    seen_a = lines['a']['messages'][-2]['content']
    assert seen_a == 'y' * DEFAULT_MAX_OBSERVATION + f'\n[... {BIG - DEFAULT_MAX_OBSERVATION} characters truncated]'
    seen_b = lines['b']['messages'][-2]['content']  # the tool's own bound, its end kept
    assert seen_b == f'[... {BIG - 100} characters truncated]\n' + 'y' * 100
    steps = [e['extra'] for e in jsonl_lines(tmp_path / 'out' / 'trace.jsonl') if 'calls' in (e.get('extra') or {})]
    by_name = {s['calls'][0]['name']: s for s in steps}
    huge = by_name['huge']
    assert huge['calls'][0]['cut'] == {'kept': DEFAULT_MAX_OBSERVATION, 'dropped': BIG - DEFAULT_MAX_OBSERVATION,
                                       'unit': 'characters'}
    assert huge['calls'][0]['printed'].startswith('progress ') and huge['calls'][0]['printed_chars'] > 400_000
    assert len(huge['calls'][0]['printed']) <= 2000
    # the trace keeps what a replay needs to show the same observation, never the whole result
    assert len(huge['tool_io'][0]['output']) == window_chars(DEFAULT_MAX_OBSERVATION)
    assert huge['tool_io'][0]['output_chars'] == BIG
    assert (tmp_path / 'out' / 'trace.jsonl').stat().st_size < 1_000_000
    summary = json.loads((tmp_path / 'out' / 'summary.json').read_text())
    assert summary['tool_outputs_cut'] == 2 and summary['tool_calls_printed'] == 2


def test_replaying_the_recorded_tools_shows_the_same_cut(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    script = [{'uuid': 'a', 'turn': 1, 'content': _call('huge', n=BIG)}, {'uuid': 'a', 'turn': 2, 'content': 'ok'}]
    _project(tmp_path, '  - {name: huge, impl: "my_tools:huge"}\n', script, ['a'])
    assert main(['run', 'run.yaml', '-q']) == 0
    assert main(['replay', 'out', '--out', 'again', '--tools', 'recorded', '-q']) == 0
    first = jsonl_lines(tmp_path / 'out' / 'trajectories.jsonl')[0]['messages']
    again = jsonl_lines(tmp_path / 'again' / 'trajectories.jsonl')[0]['messages']
    assert again == first and first[-2]['content'].endswith(f'[... {BIG - DEFAULT_MAX_OBSERVATION} characters truncated]')


class CountingTokenizer:
    """The tiny BPE, recording the length of every text it is asked to encode."""

    def __init__(self) -> None:
        from tests.tiny_model import make_tokenizer

        self.inner = make_tokenizer()
        self.encoded = []

    def encode(self, text, **kw):
        self.encoded.append(len(text))
        return self.inner.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_with_a_tokenizer_the_bound_is_in_tokens_and_nothing_larger_is_tokenized(tmp_path):
    (tmp_path / 'my_tools.py').write_text(TOOLS)
    tok = CountingTokenizer()
    scheduler = load_scheduler({'name': 's', 'max_turns': 2, 'parser': 'hermes',
                                'tools': [{'name': 'huge', 'impl': 'my_tools:huge', 'max_observation': 50},
                                          {'name': 'short', 'impl': 'my_tools:huge', 'max_observation': 500}]},
                               tokenizer=tok, base_dir=str(tmp_path))
    model = ScriptedBackend(outputs=[{'uuid': 'a', 'turn': 1, 'content': _call('huge', n=BIG)},
                                     {'uuid': 'b', 'turn': 1, 'content': _call('short', n=120)},
                                     {'uuid': 'a', 'turn': 2, 'content': 'ok'}, {'uuid': 'b', 'turn': 2, 'content': 'ok'}])
    result = Executor(scheduler, model, max_turns=2).run([req('a'), req('b')])
    assert result.ok
    cut = result.outputs[0].messages[-2]['content']
    body, marker = cut.rsplit('\n', 1)
    assert len(tok.inner.encode(body, add_special_tokens=False)) <= 50
    assert marker.startswith('[... ') and marker.endswith(' characters truncated]')
    assert result.outputs[1].messages[-2]['content'] == 'y' * 120  # under its bound: whole, unmarked
    assert max(tok.encoded) <= window_chars(50)  # 5 MB never reached the tokenizer
    [cut_info] = [e.extra['calls'][0]['cut'] for e in result.trace if (e.extra or {}).get('calls')
                  and e.extra['calls'][0]['name'] == 'huge']
    assert cut_info['unit'] == 'characters' and cut_info['dropped'] > BIG - 1000


def test_a_bound_that_is_not_a_positive_integer_is_refused_with_its_line(tmp_path, capsys):
    (tmp_path / 'my_tools.py').write_text(TOOLS)
    (tmp_path / 's.yaml').write_text('name: s\nparser: hermes\ntools:\n  - name: huge\n    impl: "my_tools:huge"\n'
                                     '    max_observation: 0\n')
    assert main(['validate', str(tmp_path / 's.yaml')]) != 0
    err = capsys.readouterr()
    assert 's.yaml:6' in err.out + err.err and 'max_observation' in err.out + err.err


def _start(project: Path, mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''),
               MTFLOW_TEST_DIR=str(project))
    return subprocess.Popen([sys.executable, '-m', 'mtflow', 'run', 'run.yaml', '-q', '--mode', mode,
                             '--flush-every', '1'], cwd=project,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize('mode', ['async', 'lockstep'])
def test_sigterm_stops_a_run_whose_tool_hangs_and_keeps_what_finished(tmp_path, mode):
    script = [{'uuid': 'a', 'turn': 1, 'content': _call('hang', name='a-started')},
              {'uuid': 'b', 'turn': 1, 'content': _call('quick', name='b')}, {'uuid': 'b', 'turn': 2, 'content': 'ok'}]
    project = _project(tmp_path, '  - {name: hang, impl: "my_tools:hang"}\n  - {name: quick, impl: "my_tools:quick"}\n',
                       script, ['a', 'b'])
    proc = _start(project, mode)
    deadline = time.monotonic() + 120
    while not (project / 'a-started').exists():  # the tool is running (and will never return)
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, 'the tool never started'
        time.sleep(0.05)
    if mode == 'async':  # b goes on without a: wait until it is written (--flush-every 1: at once)
        while not jsonl_lines(project / 'out' / 'trajectories.jsonl'):
            assert time.monotonic() < deadline, 'b was never written'
            time.sleep(0.05)
    err = stop_by_sigterm(proc, 'its tool hung')
    assert proc.returncode == 143, err
    written = [t['uuid'] for t in jsonl_lines(project / 'out' / 'trajectories.jsonl')]
    interrupted = [t['uuid'] for t in jsonl_lines(project / 'out' / 'interrupted.jsonl')]
    assert 'a' in interrupted and 'a' not in written
    if mode == 'async':
        assert written == ['b']
    assert json.loads((project / 'out' / 'run.json').read_text())['attempts'][-1]['status'] == 'interrupted'
