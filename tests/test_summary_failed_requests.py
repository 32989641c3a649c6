"""``mtflow run``'s summary counts failed requests apart from the rewards: the partial reward a
request carried when it failed is in neither the mean reward nor the rewarded requests (it used
to be: mean -0.425 in a run where one server was killed, "2 of 2 rewarded" with one failed)."""
from __future__ import annotations

import json

from mtflow.cli import main

SCHEDULER = '''
import mtflow

class Scored(mtflow.Scheduler):
    """Each step scores the turn: 'good' requests earn 1.0; 'bad' ones carry -1.0 and then fail."""

    def step(self, infer_request, response_choice, current_turn):
        bad = infer_request.uuid.startswith('bad')
        if bad and current_turn == 2:
            raise RuntimeError('the environment died')
        infer_request.messages.append({'role': 'user', 'content': 'go on'})
        return {'infer_request': infer_request, 'rollout_infos': {'reward': -1.0 if bad else 1.0}}
'''


def test_failed_requests_are_left_out_of_the_mean_reward_and_the_rewarded_count(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'sched.py').write_text(SCHEDULER)
    (tmp_path / 'data.jsonl').write_text(''.join(
        json.dumps({'uuid': u, 'messages': [{'role': 'user', 'content': 'hi'}]}) + '\n' for u in ('good', 'bad')))
    (tmp_path / 'script.jsonl').write_text(json.dumps({'content': 'ok'}) + '\n')
    (tmp_path / 'run.yaml').write_text('scheduler: sched.py:Scored\nscheduler_args: {max_turns: 3}\nbackend: scripted\n'
                                       'model: script.jsonl\nbackend_options: {cycle: true}\ndataset: data.jsonl\n'
                                       'out: out\nnum_generations: 2\n')
    assert main(['run', 'run.yaml', '--no-progress']) == 0
    summary = json.loads((tmp_path / 'out' / 'summary.json').read_text())
    assert summary['errors'] == 2 and summary['finish_reasons']['error'] == 2
    assert summary['reward_mean'] == 1.0, 'the failed requests\' -1.0 is not in the mean'
    assert summary['reward_failed_left_out'] == 2
    groups = summary['reward_groups']
    assert (groups['requests_rewarded'], groups['requests_scored']) == (2, 2)
    table = capsys.readouterr().out
    assert 'mean reward' in table and '│ mean reward          │ 1.0 (2 failed left out)' in table
    assert '2 of 2 (reward > 0)' in table
