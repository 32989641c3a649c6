"""``mtflow run --mode async``: the HF backend behind the dynamic batcher, each request on its own;
greedy trajectories equal lockstep's, the trace has every request, the summary is the same."""
import json

import pytest

from mtflow.cli import main
from mtflow.core.trace import Trace
from mtflow.run.trajectories import read_trajectories
from tests.test_cli_run import model_dir, project  # noqa: F401 - fixtures

pytestmark = pytest.mark.hf


def test_async_mode_writes_the_same_greedy_trajectories(project, capsys):  # noqa: F811
    common = ['run', 'run.yaml', '--no-progress', '--temperature', '0']
    assert main(common + ['--out', 'lock']) == 0
    assert main(common + ['--out', 'async', '--mode', 'async', '--max-concurrency', '2']) == 0
    capsys.readouterr()
    lock = read_trajectories(project / 'lock' / 'trajectories.jsonl')
    asy = read_trajectories(project / 'async' / 'trajectories.jsonl')
    assert list(asy) == list(lock) == ['p0', 'p1', 'p2', 'p3', 'p4']
    for uuid in lock:
        a, b = asy[uuid], lock[uuid]
        assert a.messages == b.messages and a.response_token_ids == b.response_token_ids
        assert a.response_loss_mask == b.response_loss_mask and a.finish_reason == b.finish_reason
        for x, y in zip(a.rollout_logprobs, b.rollout_logprobs):  # batches differ: padding moves the last digits
            assert x == pytest.approx(y, abs=1e-4)
    trace = Trace.read_jsonl(project / 'async' / 'trace.jsonl')
    assert sorted(trace.uuids()) == ['p0', 'p1', 'p2', 'p3', 'p4']
    assert all(trace.path(u).endswith('finished(max_turns)') for u in trace.uuids())
    s_lock = json.loads((project / 'lock' / 'summary.json').read_text())
    s_async = json.loads((project / 'async' / 'summary.json').read_text())
    for key in ('requests', 'finish_reasons', 'turns', 'generated_tokens', 'tool_calls', 'errors'):
        assert s_async[key] == s_lock[key], key
    assert s_async['rollout_fn_calls'] == 5 * 3, 'one call per request-turn'


def test_bad_mode_is_one_line(project, capsys):  # noqa: F811
    with pytest.raises(SystemExit):
        main(['run', 'run.yaml', '--mode', 'fast'])
    assert 'invalid choice' in capsys.readouterr().err
