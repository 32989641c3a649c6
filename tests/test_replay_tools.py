"""``mtflow replay`` with the YAML ``python`` tool (the real sandbox) and the gym environment:
a live replay against the unchanged config is identical, and ``--tools recorded`` serves every
tool result and environment step from the record, calling no tool and no environment (asserted
by making them raise), with the same rewards."""
import json
from pathlib import Path

import pytest

from mtflow.cli import main
from mtflow.declarative.gym import GuessNumberEnv
from mtflow.tools.runner import ToolRunner

ROOT = Path(__file__).resolve().parent.parent

SCHEDULER = """name: py_replay
max_turns: 4
parser: hermes
tools:
  - name: python
    builtin: python
    options: {timeout_s: 5, memory_mb: 256, max_output_chars: 2000}
    timeout_s: 10
observation: {mode: message, role: tool, template: "{result}", error_template: "Error: {error}"}
answer: {pattern: 'answer is (\\d+)', field: target}
reward: tests.test_replay_tools:reward
system_prompt: "Use python. {tools}"
"""
CODES = {'p0': 'print(6*7)', 'p1': 'print(sum(range(10)))', 'p2': '1/0', 'p3': 'print("x" * 3)'}
ANSWERS = {'p0': 42, 'p1': 45, 'p2': 0, 'p3': 3}


def reward(request, infos):
    """1 for a correct answer, minus 0.1 per failed tool call (so tool results reach the reward)."""
    return float(bool(infos.get('answer_correct'))) - 0.1 * infos.get('tool_errors', 0)


def _call(code: str) -> str:
    return '<tool_call>' + json.dumps({'name': 'python', 'arguments': {'code': code}}) + '</tool_call>'


@pytest.fixture(scope='module')
def python_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('replay_py')
    (tmp / 'sched.yaml').write_text(SCHEDULER)
    script = []
    for uuid, code in CODES.items():
        script.append({'uuid': uuid, 'turn': 1, 'content': _call(code), 'token_ids': [11, 12, len(code)],
                       'logprobs': [-0.1, -0.2, -0.3]})
        script.append({'uuid': uuid, 'turn': 2, 'content': f'The answer is {ANSWERS[uuid]}.',
                       'token_ids': [13, ANSWERS[uuid]], 'logprobs': [-0.4, -0.5]})
    (tmp / 'script.jsonl').write_text(''.join(json.dumps(s) + '\n' for s in script))
    data = [{'uuid': u, 'messages': [{'role': 'user', 'content': f'compute {c}'}], 'data_dict': {'target': 42}}
            for u, c in CODES.items()]
    (tmp / 'data.jsonl').write_text(''.join(json.dumps(d) + '\n' for d in data))
    cfg = tmp / 'cfg.yaml'
    cfg.write_text(f'scheduler: {tmp / "sched.yaml"}\nbackend: scripted\nmodel: {tmp / "script.jsonl"}\n'
                   f'dataset: {tmp / "data.jsonl"}\nbatch_size: 4\nrequest_config: {{logprobs: true}}\n')
    assert main(['run', str(cfg), '-q', '--out', str(tmp / 'orig')]) == 0
    return tmp, tmp / 'orig'


def _lines(run: Path):
    return {l['uuid']: l for l in map(json.loads, (run / 'trajectories.jsonl').read_text().splitlines())}


def _attempt(run: Path):
    return json.loads((run / 'run.json').read_text())['attempts'][-1]


def test_the_python_tool_run_really_ran_the_sandbox(python_run):
    _, run = python_run
    lines = _lines(run)
    assert lines['p0']['messages'][3] == {'role': 'tool', 'content': '42\n'} or lines['p0']['messages'][3][
        'content'].strip() == '42'
    assert 'ZeroDivisionError' in lines['p2']['messages'][3]['content']
    assert [lines[u]['rollout_infos']['reward'] for u in CODES] == [1.0, 0.0, pytest.approx(-0.1), 0.0]


def test_live_replay_of_the_python_tool_is_identical(python_run, capsys):
    tmp, run = python_run
    assert main(['replay', str(run), '--out', str(tmp / 'live'), '-q']) == 0
    capsys.readouterr()
    assert main(['diff', str(run), str(tmp / 'live')]) == 0
    assert 'identical 4, different 0' in capsys.readouterr().out


def test_tools_recorded_calls_no_tool_and_gives_the_same_rewards(python_run, monkeypatch, capsys):
    tmp, run = python_run

    async def no_call(self, *args, **kwargs):
        raise AssertionError('--tools recorded called a tool')

    monkeypatch.setattr(ToolRunner, 'call', no_call)
    monkeypatch.setattr(ToolRunner, 'call_all', no_call)
    assert main(['replay', str(run), '--out', str(tmp / 'rec'), '-q', '--tools', 'recorded']) == 0
    capsys.readouterr()
    assert main(['diff', str(run), str(tmp / 'rec')]) == 0
    assert 'identical 4, different 0' in capsys.readouterr().out
    assert {u: l['rollout_infos'] for u, l in _lines(tmp / 'rec').items()} == {
        u: l['rollout_infos'] for u, l in _lines(run).items()}
    assert _attempt(tmp / 'rec')['recorded_tool_calls'] == 4


def test_tools_recorded_refuses_calls_the_record_does_not_hold(python_run, monkeypatch):
    tmp, run = python_run
    # a record whose p0 call has other arguments than the model's text now asks for
    trace = tmp / 'bad' / 'trace.jsonl'
    trace.parent.mkdir()
    for name in ('trajectories.jsonl', 'run.json'):
        (trace.parent / name).write_text((run / name).read_text())
    trace.write_text((run / 'trace.jsonl').read_text().replace('print(6*7)', 'print(6*8)'))
    assert main(['replay', str(trace.parent), '--out', str(tmp / 'bad_out'), '-q', '--tools', 'recorded']) == 0
    lines = _lines(tmp / 'bad_out')
    assert lines['p0']['finish_reason'] == 'error'
    events = [json.loads(e) for e in (tmp / 'bad_out' / 'trace.jsonl').read_text().splitlines()]
    err = next(e for e in events if e['uuid'] == 'p0' and e['reason'] == 'error')['extra']['error']
    assert err['turn'] == 1 and 'recorded' in err['message'] and 'print(6*7)' in err['message']
    assert all(lines[u]['finish_reason'] != 'error' for u in ('p1', 'p2', 'p3'))


def test_tools_recorded_replays_the_gym_env_without_calling_it(tmp_path, monkeypatch, capsys):
    script = ROOT / 'configs' / 'scripted_guesses.jsonl'
    guesses = [int(json.loads(l)['content'].rstrip('.').split()[-1]) for l in script.read_text().splitlines()]
    data = [json.loads(l) for l in (ROOT / 'mtflow' / 'data' / 'prompts.jsonl').read_text().splitlines()]
    for i, d in enumerate(data):  # targets the scripted guesses hit, so some episodes end in the env
        d['data_dict']['target'] = guesses[(3 * i) % len(guesses)]
    (tmp_path / 'data.jsonl').write_text(''.join(json.dumps(d) + '\n' for d in data))
    cfg = tmp_path / 'g.yaml'
    cfg.write_text(f'scheduler: {ROOT / "schedulers" / "guess_number.yaml"}\nbackend: scripted\nmodel: {script}\n'
                   f'backend_options: {{cycle: true}}\nmax_turns: 4\nbatch_size: 5\n'
                   f'dataset: {tmp_path / "data.jsonl"}\n')
    assert main(['run', str(cfg), '-q', '--out', str(tmp_path / 'orig')]) == 0

    def no_env(self, *args, **kwargs):
        raise AssertionError('--tools recorded called the environment')

    monkeypatch.setattr(GuessNumberEnv, 'reset', no_env)
    monkeypatch.setattr(GuessNumberEnv, 'step', no_env)
    assert main(['replay', str(tmp_path / 'orig'), '--out', str(tmp_path / 'rec'), '-q', '--tools', 'recorded']) == 0
    capsys.readouterr()
    assert main(['diff', str(tmp_path / 'orig'), str(tmp_path / 'rec')]) == 0
    orig, rec = _lines(tmp_path / 'orig'), _lines(tmp_path / 'rec')
    assert {u: l['rollout_infos'] for u, l in rec.items()} == {u: l['rollout_infos'] for u, l in orig.items()}
    assert len({l['finish_reason'] for l in orig.values()}) >= 2  # env_done and another end were both replayed
    assert _attempt(tmp_path / 'rec')['recorded_env_steps'] == sum(l['num_turns'] for l in orig.values())
