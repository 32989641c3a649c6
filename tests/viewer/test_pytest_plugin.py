"""The pytest plugin, run on inner test files with ``pytester``: a failing test shows the timeline
of the requests involved, a passing one prints nothing extra, ``--mtflow-trace-dir`` writes pages."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ['pytester']  # here, not in a conftest: pytest rejects that below the rootdir

REPO = Path(__file__).resolve().parents[2]

INNER = '''
import pytest
from mtflow.core.errors import MultiTurnRolloutError
from tests.viewer.viewer_scenario import run_scenario


def test_wrong_reason(mtflow_trace):
    run_scenario()
    assert mtflow_trace.finish_reason('r1') == 'error'


def test_raises():
    run_scenario(on_error='raise')


def test_fine(mtflow_trace):
    run_scenario()
    assert mtflow_trace.finish_reason('r1') == 'max_turns'


def test_fails_without_mtflow():
    assert 1 == 2
'''


@pytest.fixture
def inner(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.syspathinsert(REPO)  # tests.viewer.viewer_scenario
    pytester.makepyfile(test_inner_plugin=INNER)
    return pytester


def section(output: str, test: str) -> str:
    """The failure block of one inner test."""
    blocks = output.split('_ ' + test + ' _')
    assert len(blocks) == 2, output
    return blocks[1].split('\n___')[0].split('short test summary')[0]


def test_failing_test_shows_the_timeline_of_the_requests_involved(inner):
    result = inner.runpytest('-p', 'no:cacheprovider', '-k', 'wrong_reason or raises or without')
    result.assert_outcomes(failed=3)
    out = result.stdout.str()
    wrong = section(out, 'test_wrong_reason')
    assert '- mtflow trace (call) -' in wrong
    assert '1 executor run, 4 requests; showing 1' in wrong
    lines = wrong.split('G generating')[0].splitlines()  # the timeline rows end at the legend
    r1 = [line for line in lines if line.startswith('r1 ')]
    assert len(r1) == 1 and r1[0].split()[1:] == ['GT!', 'GT', 'C✓', '3', '5', 'max_turns']
    assert not any(line.startswith(('r0 ', 'r2 ', 'r3 ')) for line in lines)  # only the request named
    assert 'summary: 1 requests' in wrong
    # a run that raises: the error names request r2, so r2 is shown, with its error
    raised = section(out, 'test_raises')
    assert 'MultiTurnRolloutError' in raised and '- mtflow trace (call) -' in raised
    r2 = [line for line in raised.split('G generating')[0].splitlines() if line.startswith('r2 ')]
    assert r2 and r2[0].split()[1:] == ['GT✗', '1', '1', 'error']
    assert 'RuntimeError: the tool exploded' in raised
    # a failing test that ran no executor gets no trace section
    assert 'mtflow trace' not in section(out, 'test_fails_without_mtflow')


def test_passing_test_prints_nothing_extra(inner):
    with_plugin = inner.runpytest('-p', 'no:cacheprovider', '-k', 'fine', '-rA')
    with_plugin.assert_outcomes(passed=1)
    without = inner.runpytest('-p', 'no:cacheprovider', '-p', 'no:mtflow', '-k', 'fine', '-rA')
    # without the plugin the fixture is missing: the test errors, which proves the plugin was off
    without.assert_outcomes(errors=1)
    out = with_plugin.stdout.str()
    assert 'mtflow' not in out.replace('mtflow-', '')  # only the plugin list line names it
    bare = inner.runpytest('-p', 'no:cacheprovider', '-k', 'without', '-rA')  # a failure without mtflow
    assert 'mtflow trace' not in bare.stdout.str()


def test_trace_dir_gets_a_page_per_failing_test(inner, tmp_path):
    out_dir = tmp_path / 'traces'
    result = inner.runpytest('-p', 'no:cacheprovider', '--mtflow-trace-dir', str(out_dir))
    result.assert_outcomes(passed=1, failed=3)
    pages = sorted(p.name for p in out_dir.glob('*.html'))
    assert pages == ['test_inner_plugin.py_test_raises.html', 'test_inner_plugin.py_test_wrong_reason.html']
    page = (out_dir / pages[1]).read_text()
    assert page.startswith('<!DOCTYPE html>') and '"uuid": "r3"' in page
    assert sorted(p.name for p in out_dir.glob('*.trace.jsonl')) == [
        'test_inner_plugin.py_test_raises.trace.jsonl', 'test_inner_plugin.py_test_wrong_reason.trace.jsonl']
    assert f'HTML: {out_dir / pages[1]}' in result.stdout.str()
