"""Trace and trajectories files: written by a real executor run, read back losslessly."""
from __future__ import annotations

import io
import json

import pytest

from mtflow.core.trace import EVENT_FIELDS, Trace, TraceEvent
from mtflow.run.trajectories import (Trajectory, iter_trajectories, read_trajectories, trajectories_from_result,
                                 write_trajectories)
from tests.viewer.viewer_scenario import EXPECTED_PATHS, run_scenario


@pytest.fixture(scope='module')
def scenario():
    return run_scenario()


@pytest.mark.parametrize('name', ['trace.jsonl', 'trace.jsonl.gz'])
def test_trace_round_trip_is_lossless(scenario, tmp_path, name):
    result, _, _ = scenario
    path = tmp_path / name
    result.trace.write_jsonl(path)
    back = Trace.read_jsonl(path)
    assert back == result.trace  # every field of every event, floats and extras included
    assert [back.path(u) for u in EXPECTED_PATHS] == list(EXPECTED_PATHS.values())
    # writing what was read gives the same bytes
    again = tmp_path / ('again-' + name)
    back.write_jsonl(again)
    assert Trace.read_jsonl(again) == back


def test_trace_lines_have_the_documented_keys_in_order(scenario):
    result, _, _ = scenario
    buf = io.StringIO()
    result.trace.write_jsonl(buf)
    lines = buf.getvalue().splitlines()
    assert len(lines) == len(result.trace) == 15
    for line in lines:
        assert tuple(json.loads(line)) == EVENT_FIELDS
    step_exit = [json.loads(line) for line in lines if json.loads(line)['from'] == 'tool_step'
                 and json.loads(line)['uuid'] == 'r1']
    assert step_exit[0]['extra'] == {'tool_calls': [{'name': 'search'}], 'tool_errors': ['search: no results']}
    assert step_exit[0]['duration_s'] >= 0
    failed = next(json.loads(line) for line in lines if json.loads(line)['reason'] == 'error')
    assert failed['uuid'] == 'r2' and failed['trigger'] == 'fail'
    assert failed['extra']['error']['type'] == 'RuntimeError'
    assert failed['extra']['error']['phase'] == 'step'


def test_bad_trace_lines_name_file_and_line(tmp_path):
    good = TraceEvent('a', 0, 0, 1, 'pending', 'generating', 'generate').to_dict()
    path = tmp_path / 't.jsonl'
    path.write_text(json.dumps(good) + '\n\n' + json.dumps({'uuid': 'a', 'turn': 1}) + '\n')
    with pytest.raises(ValueError, match=r't\.jsonl:3: not a trace event: .*missing from, to, trigger'):
        Trace.read_jsonl(path)
    path.write_text('{"uuid": "a", "turn": 1, "from": "x", "to": "y", "trigger": "z", "extra": [1]}\n')
    with pytest.raises(ValueError, match=r":1: .*'extra' must be an object"):
        Trace.read_jsonl(path)
    path.write_text('not json\n')
    with pytest.raises(ValueError, match=r't\.jsonl:1'):
        Trace.read_jsonl(path)


def test_trajectories_round_trip(scenario, tmp_path):
    result, requests, _ = scenario
    trajs = trajectories_from_result(result, requests)
    assert [t.uuid for t in trajs] == list(EXPECTED_PATHS)  # the trace's uuids, input order
    path = tmp_path / 'trajectories.jsonl.gz'
    assert write_trajectories(path, trajs) == 4
    back = read_trajectories(path)
    assert list(back) == list(EXPECTED_PATHS)
    assert list(back.values()) == trajs
    r1 = back['r1']
    assert r1.finish_reason == 'max_turns' and r1.num_turns == 3
    assert r1.response_token_ids == [[1, 5, 13, 14], [6, 7, 8]]  # call bad | no results ; think more so
    assert r1.response_loss_mask == [[1, 1, 0, 0], [1, 1, 1]]
    assert r1.rollout_logprobs == [[-0.5, -0.5], [-0.5, -0.5, -0.5]]
    assert [m['role'] for m in r1.messages] == ['user', 'assistant', 'tool', 'assistant']
    assert back['r2'].finish_reason == 'error' and 'mtflow_error' in back['r2'].rollout_infos
    # the outputs themselves carry the same segments
    assert result.outputs[1].response_token_ids == r1.response_token_ids


def test_trajectory_unknown_keys_survive_and_bad_lines_are_named(tmp_path):
    path = tmp_path / 'traj.jsonl'
    # (``reward`` is a known key now, docs/trace-format.md; an unknown one is e.g. a judge's score)
    line = {'uuid': 'x', 'messages': [], 'response_token_ids': [[1, 2]], 'judge_score': 0.5, 'reward': 0.25}
    path.write_text(json.dumps(line) + '\n')
    (t, ) = iter_trajectories(path)
    assert t.extra == {'judge_score': 0.5}
    assert t.masks() == [[1, 1]]  # no mask recorded: every token is trained
    assert t.to_dict()['judge_score'] == 0.5 and t.reward == t.to_dict()['reward'] == 0.25
    path.write_text(json.dumps({'uuid': 'x', 'response_token_ids': [1, 2]}) + '\n')
    with pytest.raises(ValueError, match=r"traj\.jsonl:1: not a trajectory: field 'response_token_ids'"):
        read_trajectories(path)
    with pytest.raises(ValueError, match='missing uuid'):
        Trajectory.from_dict({'messages': []})
