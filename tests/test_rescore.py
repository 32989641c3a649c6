"""``mtflow rescore`` on a scripted guess-the-number run with GRPO groups: the run's own config
(no reward function) changes nothing; a new reward (``--reward``, reading ``data_dict``) changes
only the rewards, and the summary's group spread is the spread of the new lines; a config with a
finish policy changes the rewards and the policy fields only; no backend is ever made."""
import json
import math
from collections import defaultdict
from pathlib import Path

import pytest

from mtflow.cli import main
from mtflow.declarative.gym import GuessNumberEnv

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / 'configs' / 'scripted_guesses.jsonl'


def closeness(request, infos):
    """1 for a found number, else how close the last guess came to the target (0..1)."""
    if infos.get('reward', 0) > 0:
        return 1.0
    last = [m['content'] for m in request.messages if m['role'] == 'assistant'][-1]
    guess = int(last.rstrip('.').split()[-1])
    return round(1 - abs(guess - request.data_dict['target']) / 100, 4)


def _lines(run: Path):
    return [json.loads(l) for l in (run / 'trajectories.jsonl').read_text().splitlines()]


@pytest.fixture(scope='module')
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('rescore')
    guesses = [int(json.loads(l)['content'].rstrip('.').split()[-1]) for l in SCRIPT.read_text().splitlines()]
    data = [json.loads(l) for l in (ROOT / 'mtflow' / 'data' / 'prompts.jsonl').read_text().splitlines()][:8]
    for i, d in enumerate(data):
        d['data_dict']['target'] = guesses[(3 * i) % len(guesses)] if i % 2 else 33 + i
    (tmp / 'data.jsonl').write_text(''.join(json.dumps(d) + '\n' for d in data))
    # the scheduler's own max_turns, so that it decides every finish (and computes the reward)
    sched = (ROOT / 'schedulers' / 'guess_number.yaml').read_text().replace('max_turns: 6', 'max_turns: 4')
    (tmp / 'sched.yaml').write_text(sched)
    (tmp / 'policy.yaml').write_text(sched + '\nfinish_policy:\n  max_turns: {reward: -1.0}\n')
    body = (f'backend: scripted\nmodel: {SCRIPT}\nbackend_options: {{cycle: true}}\nmax_turns: 4\nbatch_size: 6\n'
            f'num_generations: 3\ndataset: {tmp / "data.jsonl"}\n')
    (tmp / 'cfg.yaml').write_text(f'scheduler: {tmp / "sched.yaml"}\n' + body)
    (tmp / 'policy_cfg.yaml').write_text(f'scheduler: {tmp / "policy.yaml"}\n' + body)
    assert main(['run', str(tmp / 'cfg.yaml'), '-q', '--out', str(tmp / 'orig')]) == 0
    return tmp


def _without(line, keys=('reward', 'mtflow_policy')):
    line = json.loads(json.dumps(line))
    for k in keys:
        line['rollout_infos'].pop(k, None)
    line.pop('reward', None)  # the top-level copy of rollout_infos['reward']
    return line


def _spread(lines):
    by = defaultdict(list)
    for l in lines:
        by[l['uuid'].split('#')[0]].append(l['rollout_infos']['reward'])
    return by


def test_rescore_with_the_runs_own_config_changes_nothing(run, capsys):
    assert main(['rescore', str(run / 'orig'), '--out', str(run / 'same'), '-q']) == 0
    assert main(['diff', str(run / 'orig'), str(run / 'same')]) == 0
    assert (run / 'same' / 'trace.jsonl').read_bytes() == (run / 'orig' / 'trace.jsonl').read_bytes()


def test_the_progress_says_rescore(run, capsys):
    """Not a terminal here, so the progress is log lines; they name the rescore, not a rollout."""
    assert main(['rescore', str(run / 'orig'), '--out', str(run / 'shown')]) == 0
    lines = (run / 'orig' / 'trajectories.jsonl').read_text().count('\n')
    out = capsys.readouterr().out
    assert f'mtflow rescore: done: {lines}/{lines} requests' in out
    assert 'rollout' not in out


def test_a_new_reward_changes_only_rewards_and_the_spread_follows(run, monkeypatch, capsys):
    def no_env(self, *args, **kwargs):
        raise AssertionError('rescore called the environment')

    monkeypatch.setattr(GuessNumberEnv, 'reset', no_env)
    monkeypatch.setattr(GuessNumberEnv, 'step', no_env)
    out = run / 'close'
    assert main(['rescore', str(run / 'orig'), '--out', str(out), '--reward', 'tests.test_rescore:closeness']) == 0
    assert 'rescored 24 of 24' in capsys.readouterr().out
    orig, new = _lines(run / 'orig'), _lines(out)
    assert [l['uuid'] for l in orig] == [l['uuid'] for l in new]
    assert [_without(l) for l in orig] == [_without(l) for l in new]  # nothing but the reward changed
    for a, b in zip(orig, new):
        if a['rollout_infos']['reward'] > 0:
            assert b['rollout_infos']['reward'] == 1.0
        else:
            assert 0 <= b['rollout_infos']['reward'] < 1
    assert any(0 < l['rollout_infos']['reward'] < 1 for l in new)
    by = _spread(new)
    summary = json.loads((out / 'summary.json').read_text())
    groups = summary['reward_groups']
    assert groups['groups'] == len(by) == 8 and groups['group_sizes'] == [3]
    assert groups['with_spread'] == sum(1 for r in by.values() if max(r) > min(r))
    for g in groups['per_group']:
        rewards = by[g['group']]
        mean = sum(rewards) / len(rewards)
        assert g['mean'] == pytest.approx(round(mean, 4))
        assert g['std'] == pytest.approx(round(math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)), 4),
                                         abs=1e-4)
    assert summary['reward_mean'] == pytest.approx(sum(l['rollout_infos']['reward'] for l in new) / len(new))
    capsys.readouterr()
    assert main(['diff', str(run / 'orig'), str(out), '--json']) == 1
    diffs = [json.loads(l) for l in capsys.readouterr().out.splitlines()][:-1]
    assert diffs and all(set(d['fields']) <= {'reward', 'final_reward'} for d in diffs)


def test_a_finish_policy_changes_the_rewards_and_policy_fields_only(run):
    out = run / 'policy'
    assert main(['rescore', str(run / 'orig'), str(run / 'policy_cfg.yaml'), '--out', str(out), '-q']) == 0
    orig, new = _lines(run / 'orig'), _lines(out)
    assert {l['finish_reason'] for l in orig} == {'max_turns', 'stop_rule:env_done'}
    for a, b in zip(orig, new):
        assert _without(a) == _without(b)
        policy = b['rollout_infos']['mtflow_policy']
        if a['finish_reason'] == 'max_turns':
            assert b['rollout_infos']['reward'] == -1.0 and policy['rule'] == 'max_turns'
            assert policy['previous_reward'] == a['rollout_infos']['reward']
        else:
            assert b['rollout_infos']['reward'] == a['rollout_infos']['reward'] and policy['rule'] == 'default'
    # rescoring the rescored run with the plain config undoes the policy's reward
    assert main(['rescore', str(out), str(run / 'cfg.yaml'), '--out', str(run / 'undone'), '-q']) == 0
    assert [_without(l, ()) for l in _lines(run / 'undone')] == [_without(l, ()) for l in orig]
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['finish_policy'] is not None and json.loads((out / 'run.json').read_text())['rescore']['lines'] == 24


def test_rescore_errors_name_what_is_wrong(run, capsys):
    assert main(['rescore', str(run / 'orig'), '--out', str(run / 'bad'), '--reward', 'tests.test_rescore:nope']) == 2
    assert '--reward tests.test_rescore:nope' in capsys.readouterr().err
    assert main(['rescore', str(run / 'orig'), '--out', str(run / 'orig'), '-q']) == 2
    assert 'is the run it reads' in capsys.readouterr().err


REWARDS = '''
def one_arg(infos):
    return 1.0


def words(infer_request, infos):
    return 'great'


def fine(infer_request, infos):
    return 0.5
'''


def _one_error_line(capsys):
    err = capsys.readouterr().err
    assert 'Traceback' not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_a_bad_reward_is_one_line_leaves_nothing_behind_and_the_retry_runs(run, capsys, tmp_path, monkeypatch):
    """Issue 40: a wrong-signature reward or ``--reward ../dir/mod:fn`` printed a traceback, left
    ``trajectories.jsonl.tmp`` behind, and the retry was refused (``is not empty``)."""
    lib = tmp_path / 'lib'
    lib.mkdir()
    (lib / 'rw.py').write_text(REWARDS)
    work = tmp_path / 'work'
    work.mkdir()
    monkeypatch.chdir(work)
    out = tmp_path / 'new'
    args = ['rescore', str(run / 'orig'), '--out', str(out), '-q', '--reward']
    assert main(args + ['../lib/rw:one_arg']) == 2
    assert _one_error_line(capsys) == (f'mtflow: --reward ../lib/rw:one_arg: one_arg() in {lib / "rw.py"}:2 takes '
                                       '(infos); mtflow calls it as reward(infer_request, rollout_infos)')
    assert not out.exists()
    assert main(args + ['../lib/rw:words']) == 2
    assert _one_error_line(capsys).startswith(f'mtflow: {run / "orig" / "trajectories.jsonl"}:1: rescore: request ')
    assert not out.exists(), 'no trajectories.jsonl.tmp, no directory: the retry is not refused'
    out.mkdir()
    assert main(args + ['../lib/rw:words']) == 2
    assert "field 'reward': must be a number, got str 'great'" in _one_error_line(capsys)
    assert out.is_dir() and not any(out.iterdir()), 'the directory the user made is kept, empty'
    assert main(args + ['../lib/nope:fine']) == 2
    assert _one_error_line(capsys) == ("mtflow: --reward ../lib/nope:fine: cannot import module '../lib/nope': no file "
                                       f'../lib/nope.py next to {run} or in the current directory')
    assert main(args + ['../lib/rw.py:fine']) == 0
    assert {l['reward'] for l in _lines(out) if 'stop_rule' in l['rollout_infos']} == {0.5}


def test_a_yaml_schedulers_wrong_signature_reward_is_one_line(run, capsys, tmp_path):
    (tmp_path / 'rw.py').write_text(REWARDS)
    (tmp_path / 'sched.yaml').write_text((run / 'sched.yaml').read_text() + '\nreward: rw:one_arg\n')
    (tmp_path / 'cfg.yaml').write_text((run / 'cfg.yaml').read_text().replace(str(run / 'sched.yaml'),
                                                                               str(tmp_path / 'sched.yaml')))
    assert main(['rescore', str(run / 'orig'), str(tmp_path / 'cfg.yaml'), '--out', str(tmp_path / 'new')]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f'mtflow: {tmp_path / "sched.yaml"}:') and \
        f'reward: one_arg() in {tmp_path / "rw.py"}:2 takes (infos)' in line
    assert not (tmp_path / 'new').exists()
