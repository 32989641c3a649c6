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
