"""``mtflow run`` with an ``agent:`` section: 16 episodes of an agent script at concurrency 4, each
against its own session, scored by a verifier; the one that hangs is killed at its limit with its
whole process tree, and the others finish."""
from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from mtflow.cli import main
from tests.gateway.helpers import assert_tokens_exact, lines
from tests.tiny_model import make_tokenizer

pytest.importorskip('openai')

HANGS = 'p3#1'
AGENT = textwrap.dedent('''
    """An agent script: the task in argv, the model through OPENAI_BASE_URL; one episode hangs."""
    import json, os, subprocess, sys, time
    from openai import OpenAI

    session, logs = os.environ['MTFLOW_SESSION'], os.environ['AGENT_LOGS']
    started = time.time()
    client = OpenAI(timeout=60, max_retries=0)
    tools = [{'type': 'function', 'function': {'name': 'add', 'parameters': {'type': 'object', 'properties': {
        'a': {'type': 'integer'}, 'b': {'type': 'integer'}}}}}]
    messages = [{'role': 'user', 'content': sys.argv[1]}]
    reply = client.chat.completions.create(model='m', messages=messages, tools=tools).choices[0].message
    call = reply.tool_calls[0]
    args = json.loads(call.function.arguments)
    messages += [reply.model_dump(exclude_none=True),
                 {'role': 'tool', 'tool_call_id': call.id, 'content': str(args['a'] + args['b'])}]
    if session == '%s':  # this one hangs with a child and a grandchild that left its process group
        child = subprocess.Popen([sys.executable, '-c', 'import subprocess, sys, time; '
                                  'p = subprocess.Popen(["setsid", "sleep", "600"]); '
                                  'open(sys.argv[1], "w").write(str(p.pid)); time.sleep(600)',
                                  os.path.join(logs, 'grandchild.pid')])
        open(os.path.join(logs, 'child.pid'), 'w').write(str(child.pid))
        open(os.path.join(logs, 'agent.pid'), 'w').write(str(os.getpid()))
        time.sleep(600)
    answer = client.chat.completions.create(model='m', messages=messages, tools=tools).choices[0].message.content
    print(answer)
    with open(os.path.join(logs, session + '.times'), 'w') as f:
        json.dump([started, time.time()], f)
''' % HANGS)
VERIFIER = textwrap.dedent('''
    def score(episode):
        said = [m['content'] for m in episode.messages if m['role'] == 'assistant']
        ok = episode.exit_code == 0 and bool(said) and said[-1].endswith(str(episode.data['a'] + episode.data['b']))
        return {'reward': 1.0 if ok else 0.0, 'info': {'turns_seen': episode.turns}}
''')


def _alive(pid: int) -> bool:
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'  # a zombie is dead, waiting to be reaped
    except OSError:
        return False


def test_sixteen_episodes_at_concurrency_four_and_a_hanging_one_killed(tmp_path, monkeypatch, capsys):
    make_tokenizer().save_pretrained(tmp_path / 'tok')
    logs = tmp_path / 'logs'
    logs.mkdir()
    (tmp_path / 'agent.py').write_text(AGENT)
    (tmp_path / 'verifier.py').write_text(VERIFIER)
    prompts, script = [], []
    for k in range(8):
        a, b = k, k + 1
        prompts.append({'uuid': f'p{k}', 'messages': [{'role': 'user', 'content': f'What is {a} + {b}?'}],
                        'data_dict': {'a': a, 'b': b}})
        call = json.dumps({'name': 'add', 'arguments': {'a': a, 'b': b}})
        script += [{'uuid': f'p{k}', 'turn': 1, 'content': f'<tool_call>\n{call}\n</tool_call>'},
                   {'uuid': f'p{k}', 'turn': 2, 'content': f'The answer is {a + b}'}]
    (tmp_path / 'prompts.jsonl').write_text(''.join(json.dumps(p) + '\n' for p in prompts))
    (tmp_path / 'model.jsonl').write_text(''.join(json.dumps(s) + '\n' for s in script))
    (tmp_path / 'run.yaml').write_text(textwrap.dedent(f'''
        backend: scripted
        backend_options: {{path: model.jsonl, tokenizer: {tmp_path / 'tok'}}}
        dataset: prompts.jsonl
        num_generations: 2
        request_config: {{max_tokens: 64}}
        out: {tmp_path / 'run'}
        agent:
          command: [python, agent.py]
          task: argument
          concurrency: 4
          timeout_s: 10
          env: {{AGENT_LOGS: {logs}}}
          verifier: verifier.py:score
    '''))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv('PATH', f'{Path(os.sys.executable).parent}{os.pathsep}{os.environ["PATH"]}')
    assert main(['run', 'run.yaml', '-q']) == 0, capsys.readouterr().err
    by_uuid = {line['uuid']: line for line in lines(tmp_path / 'run')}
    assert sorted(by_uuid) == sorted(f'p{k}#{g}' for k in range(8) for g in range(2))
    hung = by_uuid.pop(HANGS)
    assert (hung['finish_reason'], hung['num_turns'], hung['reward']) == ('agent_timeout', 1, 0.0)
    assert hung['rollout_infos']['gateway_finish']['timed_out'] is True
    assert all((line['finish_reason'], line['num_turns'], line['reward']) == ('client_finished', 2, 1.0)
               for line in by_uuid.values())
    assert {line['group'] for line in by_uuid.values()} == {f'p{k}' for k in range(8)}
    # the hanging agent, its child and the grandchild that left the group are gone
    pids = [int((logs / name).read_text()) for name in ('agent.pid', 'child.pid', 'grandchild.pid')]
    assert not [pid for pid in pids if _alive(pid)]
    # its output was kept; at most four episodes ever ran at once (and several did)
    assert (tmp_path / 'run' / 'agents' / 'p0#0.out').read_text().strip() == 'The answer is 1'
    spans = [json.loads((logs / f'{u}.times').read_text()) for u in by_uuid]
    overlap = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert 2 <= overlap <= 4
    summary = json.loads((tmp_path / 'run' / 'summary.json').read_text())
    assert summary['agent']['episodes'] == 16 and summary['agent']['killed'] == 1
    assert summary['finish_reasons'] == {'client_finished': 15, 'agent_timeout': 1}
    assert_tokens_exact(tmp_path / 'run', segments=16)
    assert main(['run', 'run.yaml', '--resume', '-q']) == 0  # everything written: nothing runs again
    assert len(lines(tmp_path / 'run')) == 16
