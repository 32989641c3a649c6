"""The time views: state spans from the events' ``t``, time per state (``mtflow trace show``), and
the HTML time axis with the lockstep turn barrier (and, for async runs, spread turns)."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from benchmarks.longtail_sim import LongTailScheduler, SimEngine, Workload
from mtflow import Executor
from mtflow.cli import main as cli
from mtflow.core.trace import Trace, TraceEvent
from mtflow.viewer.html import render_html
from mtflow.viewer.model import request_views, state_spans, summarize, time_per_state, turn_windows
from tests.viewer.test_trace_html import page_data

FAST = Workload(seed=3, min_turns=2, max_turns=4, reply_median=8, tool_median_s=0.002, tail_max=20)


def _ev(uuid, turn, src, dst, trigger, t, reason=None):
    return TraceEvent(uuid, 0, 0, turn, src, dst, trigger, reason, None, None, t, None)


def test_spans_and_time_per_state_from_event_times():
    events = [
        _ev('a', 1, 'pending', 'generating', 'generate', 0.0),
        _ev('b', 1, 'pending', 'generating', 'generate', 0.5),
        _ev('a', 1, 'generating', 'tool_step', 'run_step', 1.0),
        _ev('a', 1, 'tool_step', 'generating', 'generate', 4.0),
        _ev('b', 1, 'generating', 'finished', 'finish', 2.5, 'check_finished'),
        _ev('a', 2, 'generating', 'finished', 'finish', 4.5, 'check_finished'),
    ]
    views = {v.uuid: v for v in request_views(Trace(events))}
    spans = state_spans(views['a'].events, 0.0)
    assert [(s.state, s.start, s.end, s.turn) for s in spans] == [('generating', 0.0, 1.0, 1), ('tool_step', 1.0, 4.0, 1),
                                                                 ('generating', 4.0, 4.5, 2)]
    assert [(s.state, s.seconds) for s in state_spans(views['b'].events, 0.0)] == [('pending', 0.5), ('generating', 2.0)]
    per = time_per_state(list(views.values()), 0.0)
    assert list(per) == ['pending', 'generating', 'tool_step']
    assert per['generating'].total_s == pytest.approx(3.5) and per['generating'].max_uuid == 'b'
    assert per['tool_step'].requests == 1 and per['tool_step'].max_s == pytest.approx(3.0)
    assert turn_windows(list(views.values())) == {1: (1.0, 2.5, 2), 2: (4.5, 4.5, 1)}
    s = summarize(list(views.values()))
    assert s.wall_s == pytest.approx(4.5)
    # events without times: no spans, no table, nothing breaks
    untimed = Trace([TraceEvent(e.uuid, 0, 0, e.turn, e.src, e.dst, e.trigger, e.reason) for e in events])
    assert summarize(request_views(untimed)).time_per_state == {}
    assert page_data(render_html(untimed))['wall'] is None


@pytest.fixture(scope='module')
def lockstep_trace():
    result = Executor(LongTailScheduler(FAST), SimEngine(FAST, decode_s=0.0002)).run(FAST.requests(6))
    assert result.ok
    return result.trace


def test_a_lockstep_run_shows_its_turn_barriers(lockstep_trace):
    data = page_data(render_html(lockstep_trace))
    marks = data['turn_marks']
    assert [m['turn'] for m in marks] == sorted({e.turn for e in lockstep_trace.events if e.src == 'generating'})
    assert all(m['barrier'] for m in marks if m['n'] > 1), 'every lockstep turn is a barrier'
    for r in data['requests']:
        spans = r['spans']
        assert spans and all(a[2] == pytest.approx(b[1]) for a, b in zip(spans, spans[1:])), 'contiguous'
        assert {sp[0] for sp in spans} <= {'pending', 'generating', 'tool_step'}
        assert r['end'] == pytest.approx(spans[-1][2])
        assert 0 <= spans[0][1] and r['end'] <= data['wall'] + 1e-6
    page = render_html(lockstep_trace)
    assert 'id="timeaxis"' in page and 'Time per state' in page


def test_trace_show_prints_time_per_state(lockstep_trace, tmp_path, capsys):
    path = tmp_path / 'trace.jsonl'
    lockstep_trace.write_jsonl(path)
    assert cli(['trace', 'show', str(path), '--color', 'never', '--width', '200']) == 0
    text = capsys.readouterr().out
    assert re.search(r'time per state \(run wall time [\d.]+ (ms|s)\)', text)
    rows = {line.split()[0]: line for line in text.splitlines() if re.match(r'\s*(generating|tool_step)\s+[\d.]', line)}
    assert set(rows) == {'generating', 'tool_step'}
    views = request_views(lockstep_trace)
    per = time_per_state(views, min(e.t for e in lockstep_trace.events))
    assert per['generating'].max_uuid in rows['generating']


CHROMIUM = shutil.which('chromium') or '/usr/bin/chromium'


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason='chromium is not installed (scripts/test.sh installs it)')
def test_the_time_axis_in_a_browser(lockstep_trace, tmp_path):
    sync_api = pytest.importorskip('playwright.sync_api')
    out = tmp_path / 'trace.html'
    out.write_text(render_html(lockstep_trace), encoding='utf-8')
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=['--headless', '--no-sandbox', '--disable-gpu'])
        try:
            page = browser.new_page(viewport={'width': 1400, 'height': 900})
            errors = []
            page.on('pageerror', lambda e: errors.append(str(e)))
            page.goto(out.as_uri())
            page.wait_for_selector('.tlane')
            assert page.locator('.tlane').count() == 6
            assert page.locator('.tlane .tspan.tool_step').count() >= 6
            assert page.locator('.taxis .tturn:not(.spread)').count() >= 2, 'barriers labelled on the axis'
            assert page.locator('.tlane .tbar').count() == 6 * page.locator('.taxis .tturn:not(.spread)').count()
            page.locator('.tlane').nth(2).click()
            assert page.locator('#detail').is_visible()
            page.screenshot(path=str(tmp_path / 'time-axis.png'), full_page=True)
            assert not errors
        finally:
            browser.close()


def test_an_async_run_has_no_turn_barrier():
    result = Executor(LongTailScheduler(FAST), SimEngine(FAST, decode_s=0.002), mode="async").run(FAST.requests(6))
    marks = page_data(render_html(result.trace))['turn_marks']
    assert any(not m['barrier'] for m in marks if m['n'] > 1), 'outputs of a turn arrive spread over the run'
    assert 'time per state' in __import__('mtflow.viewer.terminal', fromlist=['x']).format_trace(result.trace)
