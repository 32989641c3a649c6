"""A tool that calls ``sys.exit(3)`` fails that call, like any exception: the model sees the error
and the run goes on to its summary (issue 40: it used to end the whole run with status 3,
``Task was destroyed but it is pending!`` and no ``summary.json``)."""
from __future__ import annotations

import json

import pytest

from mtflow.cli import main

TOOLS = '''
import sys


def quit_sync(code: int) -> str:
    """Exit (a sync tool, run in the thread pool)."""
    sys.exit(code)


async def quit_async(code: int) -> str:
    """Exit (an async tool, run on the event loop)."""
    sys.exit(code)
'''


def _call(name: str, code: int) -> str:
    return '<tool_call>' + json.dumps({'name': name, 'arguments': {'code': code}}) + '</tool_call>'


@pytest.mark.parametrize('tool', ['quit_sync', 'quit_async'])
def test_sys_exit_in_a_tool_is_that_calls_error_and_the_run_completes(tmp_path, monkeypatch, capsys, tool):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'my_tools.py').write_text(TOOLS)
    (tmp_path / 'sched.yaml').write_text(
        f'name: s\nmax_turns: 3\nparser: hermes\ntools:\n  - {{name: {tool}, impl: "my_tools:{tool}"}}\n'
        'observation: {mode: message, role: tool, error_template: "Error: {error}"}\nstop: {regex: {done: DONE}}\n')
    (tmp_path / 'data.jsonl').write_text(''.join(json.dumps({'uuid': u, 'prompt': 'go'}) + '\n' for u in 'ab'))
    script = [{'uuid': u, 'turn': 1, 'content': _call(tool, 3)} for u in 'ab'] + \
        [{'uuid': u, 'turn': 2, 'content': 'DONE'} for u in 'ab']
    (tmp_path / 'script.jsonl').write_text(''.join(json.dumps(s) + '\n' for s in script))
    (tmp_path / 'run.yaml').write_text('scheduler: sched.yaml\nbackend: scripted\nmodel: script.jsonl\n'
                                       'dataset: data.jsonl\nout: out\n')
    assert main(['run', 'run.yaml', '-q']) == 0
    captured = capsys.readouterr()
    assert 'Task was destroyed' not in captured.err and 'Traceback' not in captured.err
    summary = json.loads((tmp_path / 'out' / 'summary.json').read_text())
    assert summary['status'] == 'complete' and summary['finish_reasons'] == {'stop_rule:done': 2}
    assert summary['tool_calls'] == 2 and summary['tool_errors'] == 2
    for line in (tmp_path / 'out' / 'trajectories.jsonl').read_text().splitlines():
        messages = json.loads(line)['messages']
        assert {'role': 'tool', 'content': f'Error: {tool} called sys.exit(3)'} in \
            [{k: m[k] for k in ('role', 'content')} for m in messages]
