"""``mtflow run`` with a Gymnasium-style environment makes one environment per request and no
throwaway probe: the config is checked before the model loads, again when the scheduler loads,
and the scheduler builds its factory; the one instance the first check made is the first
request's environment (it used to make 3 extra instances and close them unused)."""
from __future__ import annotations

import json

from mtflow.cli import main

ENV = '''
import os

class Counted:
    """Say 'done' to win; every instance made is counted in made.txt."""

    def __init__(self, goal='done'):
        self.goal = goal
        path = os.path.join(os.path.dirname(__file__), 'made.txt')
        with open(path, 'a') as f:
            f.write('1\\n')

    def reset(self, seed=None):
        return 'say done', {}

    def step(self, action):
        won = self.goal in action
        return ('yes' if won else 'no'), float(won), won, False, {}
'''


def test_mtflow_run_makes_one_environment_per_request_and_no_probe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'counted_env_i27.py').write_text(ENV)
    (tmp_path / 'sched.yaml').write_text('name: counted\nmax_turns: 2\nenv:\n  gym: counted_env_i27:Counted\n'
                                         '  kwargs: {goal: done}\n')
    (tmp_path / 'data.jsonl').write_text(''.join(
        json.dumps({'uuid': f'q{i}', 'messages': [{'role': 'user', 'content': 'play'}]}) + '\n' for i in range(3)))
    (tmp_path / 'script.jsonl').write_text(json.dumps({'content': 'done'}) + '\n')
    (tmp_path / 'run.yaml').write_text('scheduler: sched.yaml\nbackend: scripted\nmodel: script.jsonl\n'
                                       'backend_options: {cycle: true}\ndataset: data.jsonl\nout: out\n')
    assert main(['run', 'run.yaml', '--no-progress', '-q']) == 0
    trajs = [json.loads(l) for l in (tmp_path / 'out' / 'trajectories.jsonl').read_text().splitlines()]
    assert [t['rollout_infos']['reward'] for t in trajs] == [1.0, 1.0, 1.0]
    made = (tmp_path / 'made.txt').read_text().count('1')
    assert made == 3, f'{made} environments made for 3 requests'
