"""The terminal views of a known run: the important lines, not a full snapshot."""
from __future__ import annotations

import json
import re

import pytest

from mtflow.cli import main as cli
from mtflow.core.trace import Trace
from mtflow.viewer.model import request_views, select_views, summarize
from mtflow.viewer.terminal import format_trace
from tests.viewer.viewer_scenario import EXPECTED_PATHS, run_scenario


def row(text: str, uuid: str) -> str:
    """The timeline row of request ``uuid`` (exactly one)."""
    timeline = text.split('G generating')[0]  # the rows end at the legend
    rows = [line for line in timeline.splitlines() if line.split()[:1] == [uuid]]
    assert len(rows) == 1, f'expected one row for {uuid} in:\n{text}'
    return rows[0]


def squash(line: str) -> str:
    return re.sub(r'\s+', ' ', line).strip()


def test_the_run_as_the_fixture_sees_it(mtflow_trace):
    result, _, _ = run_scenario()
    assert len(mtflow_trace.runs) == 1 and mtflow_trace.last is result.trace
    for uuid, path in EXPECTED_PATHS.items():
        assert mtflow_trace.path(uuid) == path
    mtflow_trace.assert_path('r1', 'generating -> tool_step -> generating -> tool_step -> continuing -> '
                             'finished(max_turns)')
    with pytest.raises(AssertionError, match='request r3 went'):
        mtflow_trace.assert_path('r3', 'generating -> finished(max_turns)')
    with pytest.raises(KeyError, match="no request 'nope'"):
        mtflow_trace.path('nope')


def test_view_model_turns():
    result, _, _ = run_scenario()
    views = {v.uuid: v for v in request_views(result.trace)}
    r1 = views['r1']
    assert [c.marks() for c in r1.cells] == ['GT!', 'GT', 'C✓']
    assert r1.cells[0].tool_calls == ['search'] and r1.cells[0].tool_errors == ['search: no results']
    assert r1.cells[0].tokens == 2 and r1.tokens == 5 and r1.reason == 'max_turns'
    assert views['r2'].error['type'] == 'RuntimeError' and views['r2'].timeline() == 'GT✗'
    s = summarize(list(views.values()))
    assert s.live_per_turn == {1: 4, 2: 2, 3: 1}
    assert s.turns_per_request == {1: 2, 2: 1, 3: 1}
    assert s.finish_reasons == {'stop_rule:final_answer': 2, 'max_turns': 1, 'error': 1}
    assert s.tool_calls == 2 and len(s.tool_errors) == 1 and s.tokens == 12
    assert [v.uuid for v in select_views(views.values(), reasons=['stop_rule:*'])] == ['r0', 'r3']
    assert [v.uuid for v in select_views(views.values(), states=['continuing'])] == ['r1']
    assert [v.uuid for v in select_views(views.values(), uuids=['r[12]'], reasons=['error'])] == ['r2']


def test_timeline_and_summary_lines():
    result, _, _ = run_scenario()
    text = format_trace(result.trace)
    header = text.splitlines()[0]
    assert squash(header).startswith('request turn 1 2 3 turns tokens finish')
    assert squash(row(text, 'r0')) == 'r0 GT G✓ 2 4 stop_rule:final_answer'
    assert squash(row(text, 'r1')) == 'r1 GT! GT C✓ 3 5 max_turns'
    assert squash(row(text, 'r2')) == 'r2 GT✗ 1 1 error'
    assert squash(row(text, 'r3')) == 'r3 G✓ 1 2 stop_rule:final_answer'
    # the turn columns line up under the ruler: turn 2 of r0 starts where '2' is in the header
    assert row(text, 'r0').index('G✓') == header.index('2')
    assert row(text, 'r1').index('C✓') == header.index('3')
    assert 'summary: 4 requests, 15 events, 3 turns, 12 completion tokens, 2 tool calls, 1 tool errors' in text
    lines = [squash(line) for line in text.splitlines()]
    for expected in ('turn 1 4', 'turn 2 2', 'turn 3 1', '1 turn 2', '3 turns 1', 'max_turns 1', 'error 1',
                     'stop_rule:final_answer 2', 'r2 1 step RuntimeError: the tool exploded',
                     'r1 1 search: no results'):
        assert any(line.startswith(expected) for line in lines), f'{expected!r} not in:\n{text}'
    assert 'slowest steps' in text
    assert '\x1b[' not in text  # plain unless asked
    assert '\x1b[' in format_trace(result.trace, color=True)


def test_cli_show_filters(scenario_files, capsys):
    trace = str(scenario_files['trace'])
    assert cli(['trace', 'show', trace]) == 0
    out = capsys.readouterr().out
    assert all(row(out, u) for u in EXPECTED_PATHS)
    assert cli(['trace', 'show', trace, '--reason', 'stop_rule:*', '--no-summary']) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()[1:3]] == ['r0', 'r3'] and 'r1' not in out
    assert 'summary:' not in out
    assert cli(['trace', 'show', trace, '--state', 'continuing']) == 0
    out = capsys.readouterr().out
    assert 'r1' in out and 'r0' not in out and 'summary: 1 requests' in out
    assert cli(['trace', 'show', trace, '--uuid', 'r2', '--uuid', 'r3']) == 0
    out = capsys.readouterr().out
    assert squash(row(out, 'r2')) == 'r2 GT✗ 1 1 error' and 'r0' not in out
    assert cli(['trace', 'show', trace, '--rank', '1']) == 2
    assert 'no request matches the filters' in capsys.readouterr().err
    assert cli(['trace', 'show', trace, '--state', 'dancing']) == 2
    assert "unknown state 'dancing'" in capsys.readouterr().err


def test_cli_detail_shows_the_loss_mask(scenario_files, capsys):
    f = scenario_files
    base = ['trace', 'show', str(f['trace']), '--detail', 'r1']
    assert cli(base + ['--trajectories', str(f['trajectories']), '--tokenizer', str(f['tokenizer'])]) == 0
    out = capsys.readouterr().out
    assert 'path: ' + EXPECTED_PATHS['r1'] in squash(out).replace('path: pending', '\npath: pending').split('\n', 1)[1]
    assert 'call|bad«no|results»' in out  # the tool's tokens are masked
    assert 'think|more|so' in out
    assert '2 segment(s), 7 tokens, 5 trained, 2 masked, 5 logprobs' in out
    assert '[2] tool: no results' in out
    assert '"tool_errors": ["search:' in out  # the step's trace_info (may fold at the width)
    # without a tokenizer: ids
    assert cli(base + ['--trajectories', str(f['trajectories'])]) == 0
    out = capsys.readouterr().out
    assert '1 5 «13 14»' in out and '6 7 8' in out
    # without trajectories: the events, and a hint
    assert cli(base) == 0
    assert 'pass --trajectories FILE' in capsys.readouterr().out


def test_cli_errors_are_one_line(scenario_files, tmp_path, capsys):
    trace = str(scenario_files['trace'])
    assert cli(['trace', 'show', trace, '--detail', 'zz']) == 2
    assert "no request 'zz'" in capsys.readouterr().err
    assert cli(['trace', 'show', str(tmp_path / 'missing.jsonl')]) == 2
    assert 'no such trace file' in capsys.readouterr().err
    bad = tmp_path / 'bad.jsonl'
    bad.write_text(scenario_files['trace'].read_text() + '{"uuid": "x"}\n')
    assert cli(['trace', 'show', str(bad)]) == 2
    err = capsys.readouterr().err
    assert f'bad.jsonl:16: not a trace event' in err and 'Traceback' not in err
    assert cli(['trace', 'show', trace, '--trajectories', str(tmp_path / 'nope.jsonl')]) == 2
    assert 'no such trajectories file' in capsys.readouterr().err


def test_two_ranks_merged_show_the_rank_column(tmp_path):
    result, _, _ = run_scenario()
    other = Trace([type(e)(**{**{k: getattr(e, k) for k in e.__dataclass_fields__}, 'uuid': e.uuid + 'b', 'rank': 1})
                   for e in result.trace.events])
    merged = Trace.merge([result.trace, other])
    path = tmp_path / 'merged.jsonl'
    merged.write_jsonl(path)
    text = format_trace(Trace.read_jsonl(path))
    assert squash(row(text, 'r1b')) == 'r1b 1 GT! GT C✓ 3 5 max_turns'
    assert 'ranks 0,1' in text
    assert json.loads(path.read_text().splitlines()[-1])['rank'] == 1


def test_tool_calls_and_errors_of_the_declarative_scheduler(mtflow_trace):
    """The YAML scheduler's trace_info (``calls`` per step plus running totals) is read per step."""
    from mtflow import Executor
    from mtflow.declarative import load_scheduler
    from mtflow.core.protocol import RolloutInferRequest, RolloutOutput, make_choice, make_response
    from tests.viewer.viewer_scenario import REPO

    script = {'a': ['Action: calculator\nAction Input: {"expression": "2+2"}', 'Final Answer: 4'],
              'b': ['Action: calculator\nAction Input: {"expression": "1/0"}', 'Action: nosuch\nAction Input: {}',
                    'Final Answer: ?']}
    served: dict = {}

    def rollout_fn(requests, config):
        outs = []
        for r in requests:
            served[r.uuid] = served.get(r.uuid, 0) + 1
            outs.append(RolloutOutput(response=make_response(make_choice(script[r.uuid][served[r.uuid] - 1]))))
        return outs

    scheduler = load_scheduler(str(REPO / 'schedulers' / 'react_calculator.yaml'))
    requests = [RolloutInferRequest(uuid=u, messages=[{'role': 'user', 'content': 'q'}]) for u in script]
    Executor(scheduler, rollout_fn, on_error='return').run(requests)
    mtflow_trace.assert_path('b', 'generating -> tool_step -> continuing -> tool_step -> continuing -> '
                             'finished(stop_rule:final_answer)')
    views = {v.uuid: v for v in request_views(mtflow_trace.last)}
    assert [c.tool_calls for c in views['b'].cells] == [['calculator'], ['nosuch'], []]
    assert views['b'].cells[0].tool_errors == ['calculator: exception: calculator raised CalculatorError: '
                                              'division by zero']
    assert views['b'].cells[1].tool_errors[0].startswith("nosuch: unknown_tool: unknown tool 'nosuch'")
    assert views['a'].timeline() == 'GT C✓'
    s = summarize(list(views.values()))
    assert s.tool_calls == 3 and len(s.tool_errors) == 2  # not the running totals (1 + 1 + 2)
    text = format_trace(mtflow_trace.last)
    assert squash(row(text, 'b')).startswith('b GT! CT! C✓ 3')


@pytest.mark.hf
def test_detail_decodes_with_a_transformers_tokenizer_directory(tmp_path, capsys):
    """``--tokenizer DIR`` loads a saved ``transformers`` tokenizer offline; byte-level tokens
    decode one by one to their text (``Ġquick`` shows as `` quick``)."""
    pytest.importorskip('transformers')
    from mtflow.run.trajectories import Trajectory, write_trajectories
    from tests.tiny_model import make_tokenizer as make_bpe

    tok = make_bpe()
    tok.save_pretrained(tmp_path / 'tok')
    ids = tok.encode('The quick brown fox')
    pieces = [tok.decode([i]) for i in ids]
    assert ''.join(pieces) == 'The quick brown fox' and len(ids) >= 4
    mask = [1] * 2 + [0] * (len(ids) - 2)
    trace = tmp_path / 'trace.jsonl'
    trace.write_text('{"uuid": "x", "index": 0, "rank": 0, "turn": 1, "from": "pending", "to": "generating", '
                     '"trigger": "generate", "reason": null, "tokens": null, "duration_s": null, "t": 0.0, '
                     '"extra": null}\n')
    trajs = tmp_path / 'traj.jsonl'
    write_trajectories(trajs, [Trajectory('x', messages=[{'role': 'assistant', 'content': 'The quick brown fox'}],
                                          response_token_ids=[ids], response_loss_mask=[mask])])
    assert cli(['trace', 'show', str(trace), '--detail', 'x', '--trajectories', str(trajs), '--tokenizer',
                str(tmp_path / 'tok')]) == 0
    out = capsys.readouterr().out
    expected = '|'.join(pieces[:2]) + '«' + '|'.join(pieces[2:]) + '»'
    assert expected in out
    assert cli(['trace', 'show', str(trace), '--detail', 'x', '--tokenizer', str(tmp_path / 'nothing')]) == 2
    assert 'cannot load tokenizer' in capsys.readouterr().err


def test_cli_unreadable_files_are_one_line(tmp_path, capsys):
    binary = tmp_path / 'binary.jsonl'
    binary.write_bytes(bytes(range(128, 256)))
    fake_gz = tmp_path / 'trace.jsonl.gz'
    fake_gz.write_text('not gzip\n')
    for path, message in ((binary, 'not a UTF-8 text file'), (fake_gz, 'cannot read: Not a gzipped file')):
        assert cli(['trace', 'show', str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f'mtflow: {path}') and message in err, err
    bad_yaml = tmp_path / 'bad.yaml'
    bad_yaml.write_text('x: [\n')
    assert cli(['graph', str(bad_yaml), '--format', 'svg']) == 2
    assert f'{bad_yaml}:2' in capsys.readouterr().err
