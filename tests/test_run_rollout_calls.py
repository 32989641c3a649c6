"""``mtflow run`` makes one ``rollout_fn`` call per turn: the contract's extra empty call after the
last turn (which keeps ranks in step) is skipped in a single-process native run, while the
drop-in ``run_multi_turn`` keeps the contract's calls."""
from __future__ import annotations

import json

import pytest

import mtflow
from mtflow.cli import main
from tests.helpers import out, req

SCHEDULER = '''
import mtflow

class GoOn(mtflow.Scheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'go on'})
        return {'infer_request': infer_request}
'''


class Calls:
    def __init__(self):
        self.calls = []

    def __call__(self, requests, config):
        self.calls.append([r.uuid for r in requests])
        return [out('ok', [1]) for _ in requests]


class GoOn(mtflow.Scheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'go on'})
        return {'infer_request': infer_request}


def test_mtflow_run_makes_one_rollout_fn_call_per_turn(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'sched.py').write_text(SCHEDULER)
    (tmp_path / 'data.jsonl').write_text(''.join(
        json.dumps({'uuid': f'q{i}', 'messages': [{'role': 'user', 'content': 'hi'}]}) + '\n' for i in range(2)))
    (tmp_path / 'script.jsonl').write_text(json.dumps({'content': 'ok'}) + '\n')
    (tmp_path / 'run.yaml').write_text('scheduler: sched.py:GoOn\nbackend: scripted\nmodel: script.jsonl\n'
                                       'backend_options: {cycle: true}\ndataset: data.jsonl\nout: out\nmax_turns: 3\n')
    assert main(['run', 'run.yaml', '--no-progress', '-q']) == 0
    summary = json.loads((tmp_path / 'out' / 'summary.json').read_text())
    assert summary['turns']['max'] == 3 and summary['rollout_fn_calls'] == 3, 'no empty call after the last turn'


def test_the_option_skips_only_on_one_rank_and_run_multi_turn_keeps_the_contract():
    rollout = Calls()
    result = mtflow.Executor(GoOn(max_turns=3), rollout, skip_empty_calls=True).run([req('a'), req('b')])
    assert result.ok and rollout.calls == [['a', 'b']] * 3 and result.rollout_fn_calls == 3
    contract = Calls()
    requests = [req('a')]
    mtflow.run_multi_turn(requests, [out('ok', [1])], GoOn(), contract, None, max_turns=3)
    assert contract.calls == [['a'], ['a'], []], "the contract's last empty call"
    with pytest.raises(ValueError, match='skip_empty_calls needs a single rank'):
        mtflow.Executor(GoOn(), rollout, gather_fn=lambda values: values, skip_empty_calls=True)
