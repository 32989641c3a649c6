"""An ``agent:`` run whose episodes produce nothing is not ``complete`` with exit 0 (issue 47, item
6): a command that is not on PATH is one line before anything starts; an agent that exits before
its first model call fails its episode with the reason on the terminal (its status and its last
line of output), ``summary.json`` counts it (``failed_unwritten``), and the exit-code rule counts
it with the failed requests; ``--resume`` runs it again."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from mtflow.cli import main
from tests.gateway.helpers import lines
from tests.tiny_model import make_tokenizer

pytest.importorskip('openai')

#: answers the task with one model call, except the episodes the file ``fail_for`` names, which exit first
AGENT = textwrap.dedent('''
    import os, sys
    if os.environ['MTFLOW_SESSION'] in open('fail_for').read().split(','):
        print('agent: no API key configured for this provider', file=sys.stderr)
        sys.exit(3)
    from openai import OpenAI
    reply = OpenAI(timeout=60, max_retries=0).chat.completions.create(
        model='m', messages=[{'role': 'user', 'content': sys.argv[1]}])
    print(reply.choices[0].message.content)
''')


def _project(tmp_path: Path, command: str, fail_for: str = '') -> Path:
    make_tokenizer().save_pretrained(tmp_path / 'tok')
    (tmp_path / 'agent.py').write_text(AGENT)
    (tmp_path / 'fail_for').write_text(fail_for)
    (tmp_path / 'verifier.py').write_text('def score(episode):\n    return 1.0\n')
    uuids = ['p0', 'p1', 'p2']
    (tmp_path / 'prompts.jsonl').write_text(''.join(
        json.dumps({'uuid': u, 'messages': [{'role': 'user', 'content': f'task {u}'}]}) + '\n' for u in uuids))
    (tmp_path / 'model.jsonl').write_text(''.join(json.dumps({'uuid': u, 'content': f'done {u}'}) + '\n'
                                                  for u in uuids))
    (tmp_path / 'run.yaml').write_text(textwrap.dedent(f'''
        backend: scripted
        backend_options: {{path: model.jsonl, tokenizer: {tmp_path / 'tok'}}}
        dataset: prompts.jsonl
        request_config: {{max_tokens: 32}}
        out: run
        agent:
          command: {command}
          concurrency: 3
          timeout_s: 60
          verifier: verifier.py:score
    '''))
    return tmp_path


def test_a_command_not_on_path_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(_project(tmp_path, '[no-such-agent-cli, --task]'))
    assert main(['run', 'run.yaml']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mtflow: run.yaml:8: agent.command: 'no-such-agent-cli' is not on PATH; install it, or give "
                   'its full path'], err
    assert not (tmp_path / 'run').exists()  # no run directory, no model loaded


def test_a_relative_command_that_does_not_exist_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(_project(tmp_path, '[./agents/run.sh]'))
    assert main(['run', 'run.yaml']) == 2
    err = capsys.readouterr().err
    assert "agent.command: './agents/run.sh' does not exist" in err and not (tmp_path / 'run').exists()


def test_every_episode_exits_before_its_first_call_the_run_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(_project(tmp_path, '[python, agent.py]', fail_for='p0,p1,p2'))
    assert main(['run', 'run.yaml', '-q']) == 1
    err = capsys.readouterr().err
    for uuid in ('p0', 'p1', 'p2'):
        assert (f'mtflow: episode {uuid} failed: the agent exited with status 3 before its first model call '
                f'(agents/{uuid}.err: agent: no API key configured for this provider)') in err
    assert 'all 3 requests failed (3 produced nothing)' in err or '3 of 3 requests failed (3 produced nothing)' in err
    summary = json.loads((tmp_path / 'run' / 'summary.json').read_text())
    assert summary['written'] == 0 and summary['failed_unwritten']['count'] == 3
    assert sorted(f['uuid'] for f in summary['failed_unwritten']['listed']) == ['p0', 'p1', 'p2']
    # fixed (the provider's key is there now): --resume runs the episodes that produced nothing
    (tmp_path / 'fail_for').write_text('')
    assert main(['run', 'run.yaml', '--resume', '-q']) == 0
    assert sorted(line['uuid'] for line in lines(tmp_path / 'run')) == ['p0', 'p1', 'p2']


def test_one_episode_of_three_fails_its_line_is_said_and_counted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(_project(tmp_path, '[python, agent.py]', fail_for='p1'))
    assert main(['run', 'run.yaml', '-q']) == 0  # 1 of 3 failed: within max_failed_share 0.5
    err = capsys.readouterr().err
    assert 'mtflow: episode p1 failed: the agent exited with status 3 before its first model call' in err
    assert sorted(line['uuid'] for line in lines(tmp_path / 'run')) == ['p0', 'p2']
    summary = json.loads((tmp_path / 'run' / 'summary.json').read_text())
    assert summary['failed_unwritten']['count'] == 1
    assert main(['run', 'run.yaml', '--resume', '-q', '--max-failed-share', '0.2']) == 1  # p1 again: 1 of 3
    assert 'more than max_failed_share 0.2' in capsys.readouterr().err
