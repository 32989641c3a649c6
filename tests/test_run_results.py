"""What people read of a run: the trajectory lines' top-level ``reward``, ``group`` and
``reference``, written by ``mtflow run`` itself (scripted model, guess-the-number scheduler)."""
import json
import textwrap
from pathlib import Path

import pytest

from mtflow.cli import main
from mtflow.run.trajectories import TRAJECTORY_FIELDS, Trajectory, read_trajectories

ROOT = Path(__file__).resolve().parents[1]


def write_config(tmp_path: Path, extra: str = '') -> Path:
    cfg = tmp_path / 'run.yaml'
    cfg.write_text(textwrap.dedent(f'''\
        scheduler: {ROOT / 'schedulers' / 'guess_number.yaml'}
        backend: scripted
        model: {ROOT / 'configs' / 'scripted_guesses.jsonl'}
        backend_options: {{cycle: true}}
        out: out
        max_turns: 6
        ''') + extra)
    return cfg


def test_every_line_of_a_grouped_run_has_reward_group_and_reference(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path, 'num_generations: 4\nlimit: 3\n')
    assert main(['run', str(cfg), '-q']) == 0
    lines = [json.loads(l) for l in (tmp_path / 'out' / 'trajectories.jsonl').read_text().splitlines()]
    assert len(lines) == 12
    prompts = {json.loads(l)['uuid']: json.loads(l) for l in (ROOT / 'mtflow' / 'data' / 'prompts.jsonl').open()}
    for line in lines:
        assert list(line)[:len(TRAJECTORY_FIELDS)] == list(TRAJECTORY_FIELDS)
        assert line['reward'] == line['rollout_infos']['reward'], 'the ms-swift field stays where it was'
        assert isinstance(line['reward'], float)
        assert line['group'] == line['uuid'].split('#')[0]
        assert line['reference'] == prompts[line['group']]['data_dict']['target']
    groups = {}
    for line in lines:
        groups.setdefault(line['group'], []).append(line['uuid'])
    assert sorted(map(len, groups.values())) == [4, 4, 4]
    summary = json.loads((tmp_path / 'out' / 'summary.json').read_text())
    assert summary['reward_groups']['groups'] == 3


def test_lines_written_before_the_fields_read_the_same():
    old = {'uuid': 'p3#1', 'finish_reason': 'max_turns', 'rollout_infos': {'reward': 0.5, 'num_turns': 2}}
    t = Trajectory.from_dict(old)
    assert (t.reward, t.group, t.reference) == (0.5, 'p3', None)
    assert Trajectory.from_dict({'uuid': 'x', 'rollout_infos': {'reward': True}}).reward is None, 'a bool is no reward'
    with pytest.raises(ValueError, match="'reward' must be a number"):
        Trajectory.from_dict({'uuid': 'x', 'reward': 'high'})


def test_a_yaml_answer_field_names_the_reference(tmp_path):
    from mtflow.run.trajectories import reference_of

    class Req:
        data_dict = {'answer': 'a', 'gold': 'g'}

    assert reference_of(Req()) == 'a'
    assert reference_of(Req(), 'gold') == 'g'
    assert reference_of(object()) is None


SLOW_SCHEDULER = '''
import time
from mtflow import Scheduler

class Slow(Scheduler):
    """Plays every request to max_turns, 40 ms per step: a run that lasts a couple of seconds."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return False

    def step(self, infer_request, response_choice, current_turn):
        time.sleep(0.04)
        infer_request.messages.append({'role': 'user', 'content': 'again'})
        return {'infer_request': infer_request}
'''


def test_log_lines_at_the_set_interval_when_stdout_is_a_pipe(tmp_path):
    """``mtflow run ... | cat``: no terminal, so one progress line every --progress-every seconds,
    each with requests, turns against the bound, tokens/s and an ETA."""
    import re
    import subprocess
    import sys
    import time

    (tmp_path / 'slow.py').write_text(SLOW_SCHEDULER)
    cfg = write_config(tmp_path, 'batch_size: 4\nlimit: 8\n').read_text()
    cfg = cfg.replace(str(ROOT / 'schedulers' / 'guess_number.yaml'), 'slow.py:Slow').replace('max_turns: 6', 'max_turns: 5')
    (tmp_path / 'run.yaml').write_text(cfg)
    proc = subprocess.Popen([sys.executable, '-m', 'mtflow', 'run', 'run.yaml', '--progress-every', '0.3'],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**__import__('os').environ, 'PYTHONPATH': str(ROOT)})
    stamped = []
    for line in proc.stdout:
        stamped.append((time.perf_counter(), line.rstrip('\n')))
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    pattern = re.compile(r'^mtflow: (done: )?(\d+)/8 requests, turns (\d+)/(\d+), [\d.?]+ tokens/s, '
                         r'elapsed \d+:\d\d, ETA (>?\d+:\d\d|\?)$')
    progress = [(t, pattern.match(text)) for t, text in stamped if text.startswith('mtflow: ')]
    assert all(m for _, m in progress), [text for _, text in stamped]
    ticks = [(t, m) for t, m in progress if not m.group(1)]
    assert len(ticks) >= 3, 'a run of about 2 s logs every 0.3 s'
    gaps = [b[0] - a[0] for a, b in zip(ticks, ticks[1:])]
    assert all(0.2 < g < 1.0 for g in gaps), gaps
    turns = [int(m.group(3)) for _, m in ticks]
    assert turns == sorted(turns) and all(int(m.group(4)) == 40 for _, m in ticks), 'bound: 8 requests x 5 turns'
    assert any(m.group(5) not in ('?', '0:00') for _, m in ticks), 'an ETA from the observed rate'
    done = progress[-1][1]
    assert done.group(1) and done.group(2) == '8' and done.group(3) == '40' and done.group(5) == '0:00'
    assert 'mtflow run' in ''.join(text for _, text in stamped), 'the summary table follows'


def test_progress_counts_turns_against_the_bound_and_never_passes_it():
    """Lockstep: 4 requests, max_turns 6; the executor's empty last call is no turn, and a
    request that stops at turn 2 gives its 4 unplayed turns back."""
    from mtflow.run.progress import RunProgress

    p = RunProgress('off', total=4, max_turns=6)
    p.start()
    for _ in range(2):
        p.on_turn(4)
    p.on_finished(2)
    for _ in range(4):
        p.on_turn(3)
    p.on_turn(0)
    f = p.figures()
    assert (f['turns'], f['turn_bound']) == (20, 20)
    for _ in range(3):
        p.on_finished(6)
    assert p.figures()['eta_s'] == 0.0 and p.figures()['finished'] == 4
    assert p.text().startswith('4/4 requests, turns 20/20, ')


def _run_files(out: Path):
    lines = [json.loads(l) for l in (out / 'trajectories.jsonl').read_text().splitlines()]
    return lines, json.loads((out / 'run.json').read_text())['fingerprint']


def test_set_and_num_generations_change_the_run_as_the_config_edit_would(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    edited = write_config(tmp_path, 'limit: 3\nnum_generations: 2\n').read_text().replace('max_turns: 6', 'max_turns: 3')
    (tmp_path / 'edited.yaml').write_text(edited.replace('out: out', 'out: out_edit'))
    assert main(['run', 'edited.yaml', '-q']) == 0
    write_config(tmp_path, 'limit: 3\n')
    assert main(['run', 'run.yaml', '-q', '--set', 'max_turns=3', '-n', '2']) == 0
    by_edit, by_flags = _run_files(tmp_path / 'out_edit'), _run_files(tmp_path / 'out')
    assert len(by_flags[0]) == 6 and {l['num_turns'] for l in by_flags[0]} == {3}
    assert by_flags[0] == by_edit[0], 'the same trajectories'
    assert {k: v for k, v in by_flags[1].items() if k != 'out'} == {k: v for k, v in by_edit[1].items() if k != 'out'}


@pytest.mark.parametrize('flags, message', [
    (['--set', 'max_turn=3'], "--set max_turn=3: unknown key 'max_turn'; did you mean 'max_turns'? (known: scheduler,"),
    (['--set', 'max_turns=three'], '--set max_turns=three: max_turns: Input should be a valid integer'),
    (['--set', 'request_config.max_tokenz=8'], "--set request_config.max_tokenz=8: request_config: unknown key "
     "'max_tokenz'; did you mean 'max_tokens'?"),
    (['--set', 'max_turns'], '--set max_turns: expected KEY=VALUE'),
    (['-n', '0'], '--num-generations 0: num_generations: Input should be greater than or equal to 1'),
])
def test_a_bad_set_names_the_flag(tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path)
    assert main(['run', 'run.yaml', '-q'] + flags) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / 'out').exists()


def test_set_reaches_nested_keys_typed_by_the_schema(tmp_path):
    from mtflow.run.config import load_run_config

    cfg = load_run_config(write_config(tmp_path), sets=['request_config.max_tokens=32', 'backend_options.cycle=false',
                                                         'seed=null', 'request_config.stop=[a, b]'])
    assert cfg.request_config == {'max_tokens': 32, 'stop': ['a', 'b']} and cfg.backend_options == {'cycle': False}
    assert cfg.seed is None


def test_the_scripted_tool_calling_demo(tmp_path, monkeypatch, capsys):
    """configs/scripted_tools.yaml (the README's tool demo): calculator and python calls, a failing
    call answered with its error, the stop rule on <answer>, a reward for the right answer."""
    from tests.declarative.sandbox_util import require

    require('bwrap')  # scripts/setup.sh installs bubblewrap; without a sandbox the python tool refuses
    monkeypatch.chdir(tmp_path)
    assert main(['run', str(ROOT / 'configs' / 'scripted_tools.yaml'), '--no-progress']) == 0
    shown = capsys.readouterr().out
    assert 'stop_rule:answered 4' in shown and 'mean reward         │ 0.75' in shown
    out = tmp_path / 'runs' / 'scripted_tools'
    summary = json.loads((out / 'summary.json').read_text())
    assert (summary['tool_calls'], summary['tool_errors']) == (6, 1)
    trajs = read_trajectories(out / 'trajectories.jsonl')
    assert {u: (t.reward, t.reference) for u, t in trajs.items()} == {
        'mul': (1.0, '400'), 'sum': (1.0, '385'), 'div': (1.0, '143'), 'bad': (0.0, '1024')}
    tools = [m['content'] for m in trajs['mul'].messages if m['role'] == 'tool']
    assert tools == ['391', '400\n'], 'the calculator, then the python sandbox'
    assert trajs['bad'].messages[3]['content'].startswith('Error: calculator raised CalculatorError')
    assert all(t.finish_reason == 'stop_rule:answered' for t in trajs.values())


def read_events(logdir: Path):
    """``{tag: [(step, value)]}`` and ``{tag: text}`` from TensorBoard event files (TFRecord framing:
    u64 length, u32 crc, the Event proto, u32 crc), decoded with tensorboardX's own protos."""
    import struct

    from tensorboardX.proto import event_pb2

    scalars, texts = {}, {}
    for path in sorted(logdir.glob('events.out.tfevents.*')):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length, ) = struct.unpack('<Q', data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                if v.HasField('simple_value'):
                    scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
                elif v.HasField('tensor') and v.tensor.string_val:
                    texts[v.tag] = v.tensor.string_val[0].decode()
    return scalars, texts


def test_log_tensorboard_writes_event_files_a_reader_gets_back(tmp_path, monkeypatch):
    pytest.importorskip('tensorboardX')
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'slow.py').write_text(SLOW_SCHEDULER)
    cfg = write_config(tmp_path, 'batch_size: 4\nlimit: 8\n').read_text()
    (tmp_path / 'run.yaml').write_text(cfg.replace(str(ROOT / 'schedulers' / 'guess_number.yaml'), 'slow.py:Slow')
                                       .replace('max_turns: 6', 'max_turns: 4'))
    assert main(['run', 'run.yaml', '-q', '--log', 'tensorboard']) == 0
    summary = json.loads((tmp_path / 'out' / 'summary.json').read_text())
    scalars, texts = read_events(tmp_path / 'out' / 'tensorboard')
    finished = scalars['progress/finished']
    assert len(finished) >= 2, 'the figures over time, not only at the end'
    assert [v for _, v in finished] == sorted(v for _, v in finished) and finished[-1] == (32, 8.0)
    assert scalars['progress/turn_bound'][-1][1] == 32.0 and scalars['progress/eta_s'][-1][1] == 0.0
    assert scalars['summary/requests'][-1][1] == 8.0
    assert scalars['summary/turns/mean'][-1][1] == summary['turns']['mean'] == 4
    assert scalars['summary/finish_reasons/max_turns'][-1][1] == 8.0
    assert json.loads(texts['summary/text_summary'].strip('`\n'))['written'] == 8
    assert json.loads(texts['config/text_summary'].strip('`\n'))['max_turns'] == 4


def test_log_wandb_without_the_package_is_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
    import importlib.util

    if importlib.util.find_spec('wandb') is not None:
        pytest.skip('wandb is installed here')
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path)
    assert main(['run', 'run.yaml', '-q', '--log', 'wandb']) == 2
    assert "--log wandb needs the 'wandb' package: pip install 'mtflow[wandb]'" in capsys.readouterr().err
    assert not (tmp_path / 'out').exists()
