"""A run in which more requests failed than ``max_failed_share`` (default half) exits 1 and says so
on its last line (issue 40: ``answer.field: solution`` failed 5 of 6 requests and exited 0)."""
from __future__ import annotations

import json

import pytest

from mtflow.cli import main

REWARD = '''
def gold_reward(infer_request, rollout_infos):
    return float(infer_request.data_dict['gold'] == 'x')  # a KeyError for a line without gold
'''


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'rewards.py').write_text(REWARD)
    lines = [{'uuid': f'q{i}', 'prompt': 'say x', **({'gold': 'x'} if i == 0 else {})} for i in range(6)]
    (tmp_path / 'data.jsonl').write_text(''.join(json.dumps(l) + '\n' for l in lines))
    (tmp_path / 'script.jsonl').write_text(json.dumps({'content': 'x'}) + '\n')
    (tmp_path / 'sched.yaml').write_text('name: s\nmax_turns: 2\nreward: rewards:gold_reward\n'
                                         'stop: {regex: {said: x}}\n')

    def write(extra=''):
        (tmp_path / 'run.yaml').write_text('scheduler: sched.yaml\nbackend: scripted\nmodel: script.jsonl\n'
                                           'backend_options: {cycle: true}\ndataset: data.jsonl\nout: out\n' + extra)
        return 'run.yaml'

    return write


def _last_line(capsys):
    """The last line the run printed (stderr; the summary table, on stdout, comes before it)."""
    err = capsys.readouterr().err
    assert 'Traceback' not in err
    return err.strip().splitlines()[-1]


def test_more_failed_requests_than_the_share_exit_1_and_say_so_last(run, capsys, tmp_path):
    assert main(['run', run(), '--no-progress']) == 1
    assert _last_line(capsys) == ('mtflow: 5 of 6 requests failed (error 5), more than max_failed_share 0.5: exit '
                                  'status 1 (see out/summary.json; --max-failed-share sets the share)')
    summary = json.loads((tmp_path / 'out' / 'summary.json').read_text())
    assert summary['finish_reasons'] == {'error': 5, 'stop_rule:said': 1}
    assert main(['run', run(), '-q', '--overwrite', '--delete-old']) == 1
    assert _last_line(capsys).startswith('mtflow: 5 of 6 requests failed'), 'said with -q too'


def test_the_share_is_a_config_key_and_a_flag(run, capsys):
    assert main(['run', run('max_failed_share: 0.9\n'), '-q']) == 0
    assert main(['run', run(), '-q', '--overwrite', '--delete-old', '--max-failed-share', '0.9']) == 0
    assert main(['run', run('max_failed_share: 1.0\n'), '-q', '--overwrite', '--delete-old']) == 0
    assert main(['run', run(), '-q', '--overwrite', '--delete-old', '--max-failed-share', '1.5']) == 2
    assert _last_line(capsys) == 'mtflow: --max-failed-share 1.5: max_failed_share: Input should be less than or equal to 1'


def test_a_reward_that_returns_text_fails_its_request_naming_the_hook(run, capsys, tmp_path):
    """Issue 40: a reward returning ``'great'`` failed with ``could not convert string to float``."""
    (tmp_path / 'rewards.py').write_text(REWARD + '\n\ndef words(infer_request, rollout_infos):\n    return "great"\n')
    (tmp_path / 'sched.yaml').write_text((tmp_path / 'sched.yaml').read_text().replace('gold_reward', 'words'))
    assert main(['run', run(), '-q']) == 1
    assert _last_line(capsys).startswith('mtflow: 6 of 6 requests failed (error 6), more than max_failed_share 0.5')
    failures = json.loads((tmp_path / 'out' / 'summary.json').read_text())['failures']
    assert len(failures) == 6
    assert failures[0]['message'] == (f"request {failures[0]['uuid']}, field 'reward (rewards:words)': must be a "
                                      "number, got str 'great'"), failures[0]
