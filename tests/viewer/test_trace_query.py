"""``mtflow trace show`` over a run with rewards and groups (written by ``mtflow run``): reward and
group columns, ``--sort``, ``--where`` on reward, finish reason, turns and tool error kind."""
from __future__ import annotations

import json
import re

import pytest

from mtflow.cli import main
from mtflow.viewer.query import QueryError, parse_where
from tests.viewer.results_run import write_results_run


@pytest.fixture(scope='module')
def run(tmp_path_factory):
    return write_results_run(tmp_path_factory.mktemp('results'), prompts=12)


def _rows(capsys, run, *flags):
    assert main(['trace', 'show', str(run['trace']), '--trajectories', str(run['trajectories']), '--no-summary',
                 '--color', 'never', *flags]) == 0
    out = capsys.readouterr().out.splitlines()
    header = out[0].split()
    assert header[-2:] == ['reward', 'group']
    rows = []
    for line in out[1:]:
        m = re.match(r'^(p\d+#\d)\s.*\s(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(p\d+)\s*$', line)
        if m:
            rows.append({'uuid': m.group(1), 'turns': int(m.group(2)), 'reason': m.group(4),
                         'reward': float(m.group(5)), 'group': m.group(6)})
    return rows


def _truth(run):
    return {d['uuid']: d for d in map(json.loads, run['trajectories'].read_text().splitlines())}


def test_reward_and_group_columns_and_sort(run, capsys):
    truth = _truth(run)
    rows = _rows(capsys, run, '--sort', 'reward:desc')
    assert len(rows) == 48
    for r in rows:
        assert r['reward'] == pytest.approx(truth[r['uuid']]['reward'], abs=1e-3)
        assert r['group'] == truth[r['uuid']]['group']
    rewards = [r['reward'] for r in rows]
    assert rewards == sorted(rewards, reverse=True) and rewards[0] == 1.0
    ascending = [r['reward'] for r in _rows(capsys, run, '--sort', 'reward')]
    assert ascending == sorted(ascending)


def test_where_filters_by_reward_reason_turns_and_tool_error(run, capsys):
    truth = _truth(run)
    zero = _rows(capsys, run, '--where', 'reward==0')
    assert {r['uuid'] for r in zero} == {u for u, d in truth.items() if d['reward'] == 0}
    low = _rows(capsys, run, '--where', 'reward<0.5', '--where', 'turns>=3')
    assert {r['uuid'] for r in low} == {u for u, d in truth.items() if d['reward'] < 0.5 and d['num_turns'] >= 3}
    assert low and all(r['turns'] >= 3 for r in low)
    group = _rows(capsys, run, '--where', 'group==p4')
    assert sorted(r['uuid'] for r in group) == ['p4#0', 'p4#1', 'p4#2', 'p4#3']
    timeouts = _rows(capsys, run, '--where', 'tool_error==timeout')
    assert sorted(r['uuid'] for r in timeouts) == ['p0#1', 'p10#1', 'p5#1']
    reason = _rows(capsys, run, '--where', 'reason==check_*', '--where', 'reward>0.9')
    assert len(reason) == 6 and {r['reason'] for r in reason} == {'check_finished'}


@pytest.mark.parametrize('flags, message', [
    (['--where', 'reward~1'], "--where 'reward~1': expected FIELD OP VALUE"),
    (['--where', 'rewrd<1'], "unknown field 'rewrd'"),
    (['--where', 'reward<high'], 'reward is a number'),
    (['--where', 'reason<x'], 'reason is text'),
    (['--sort', 'size'], "--sort 'size': unknown key"),
])
def test_bad_queries_are_one_line_errors(run, capsys, flags, message):
    assert main(['trace', 'show', str(run['trace']), '--trajectories', str(run['trajectories']), *flags]) == 2
    assert message in capsys.readouterr().err


def test_reward_filters_need_the_trajectories(run, capsys):
    assert main(['trace', 'show', str(run['trace']), '--where', 'reward<1']) == 2
    assert 'needs --trajectories' in capsys.readouterr().err
    assert main(['trace', 'show', str(run['trace']), '--where', 'turns==2', '--no-summary', '--color', 'never']) == 0
    assert 'reward' not in capsys.readouterr().out.splitlines()[0], 'no reward column without trajectories'


def test_a_request_without_reward_meets_no_reward_condition():
    row = _row_without_reward()
    assert not parse_where('reward<1')(row) and not parse_where('reward>=0')(row)
    assert parse_where('reward==none')(row) and not parse_where('reward!=none')(row)
    with pytest.raises(QueryError):
        parse_where('turns')


def _row_without_reward():
    from mtflow.viewer.model import RequestView
    from mtflow.viewer.query import Row

    return Row(RequestView('u', 0, 0, [], [], 'max_turns', 0, ''))
