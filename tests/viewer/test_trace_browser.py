"""The HTML page in a real headless browser (Debian's chromium driven by Playwright): it loads
without console errors, shows every request, and the detail view opens on click. Screenshots are
kept in the test's tmp directory (printed at the end of the test)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mtflow.core.trace import Trace
from mtflow.run.trajectories import read_trajectories
from mtflow.viewer.html import write_html
from mtflow.viewer.tokens import load_tokenizer
from tests.viewer.viewer_scenario import EXPECTED_PATHS

CHROMIUM = shutil.which('chromium') or '/usr/bin/chromium'
ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
        '--disable-sync', '--no-first-run']

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason='chromium is not installed (scripts/test.sh installs it: apt-get install chromium)')
sync_api = pytest.importorskip('playwright.sync_api', reason='playwright is not installed (scripts/test.sh installs it)')


@pytest.fixture
def browser_page():
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={'width': 1400, 'height': 900})
        problems = []
        page.on('console', lambda m: problems.append(f'console.{m.type}: {m.text}') if m.type in ('error', 'warning')
                else None)
        page.on('pageerror', lambda e: problems.append(f'page error: {e}'))
        page.on('request', lambda r: problems.append(f'network: {r.url}') if not r.url.startswith(('file:', 'data:'))
                else None)
        try:
            yield page, problems
        finally:
            browser.close()


def test_page_in_a_browser(scenario_files, tmp_path, browser_page):
    page, problems = browser_page
    trajs = read_trajectories(scenario_files['trajectories'])
    evil = '</script><img src=x onerror="window.pwned=1"> <b>not bold</b>'
    trajs['r0'].messages[0]['content'] = evil  # message text must show as text, never run
    html = write_html(tmp_path / 'trace.html', Trace.read_jsonl(scenario_files['trace']), trajectories=trajs,
                      tokenizer=load_tokenizer(str(scenario_files['tokenizer'])), title='viewer test')
    page.goto(html.as_uri())
    page.wait_for_selector('.lane')

    # every request has a swimlane, with its finish reason
    lanes = page.locator('.lane')
    assert lanes.count() == len(EXPECTED_PATHS)
    assert [lanes.nth(i).get_attribute('data-uuid') for i in range(lanes.count())] == list(EXPECTED_PATHS)
    assert page.locator('.lane[data-uuid="r2"] .badge').inner_text() == 'error'
    assert page.locator('.lane[data-uuid="r1"] .blk.tool_step.bad').count() == 1  # the tool error
    assert page.locator('.lane[data-uuid="r1"] .blk.continuing').count() == 1
    assert page.locator('svg.state-graph g[data-state]').count() == 5
    assert page.locator('svg.chart').count() == 3
    assert page.locator('#detail').is_hidden()
    page.screenshot(path=str(tmp_path / 'trace-page.png'), full_page=True)

    # click a request: its detail opens, with events, messages and the loss mask token by token
    page.locator('.lane[data-uuid="r1"]').click()
    detail = page.locator('#detail')
    detail.wait_for(state='visible')
    assert detail.locator('h2').inner_text() == 'r1'
    assert EXPECTED_PATHS['r1'] in detail.locator('.path').first.inner_text().replace('\n', ' ')
    assert detail.locator('table.events tr').count() == 1 + 6
    assert [t.strip() for t in detail.locator('.msg pre').all_inner_texts()] == [
        'question', 'call bad', 'no results', 'think moreso']
    assert detail.locator('.seg .tok.on').all_inner_texts() == ['call', 'bad', 'think', 'more', 'so']
    assert detail.locator('.seg .tok.off').all_inner_texts() == ['no', 'results']
    assert 'logprob -0.5000' in detail.locator('.seg .tok.on').first.get_attribute('title')
    page.screenshot(path=str(tmp_path / 'trace-detail.png'))

    # another request; the hostile message is plain text; Escape closes the view
    page.locator('.lane[data-uuid="r0"] .who').click()  # the panel covers the lane's middle
    assert detail.locator('.msg pre').first.inner_text() == evil
    assert page.evaluate('window.pwned === undefined')
    page.keyboard.press('Escape')
    detail.wait_for(state='hidden')

    # the uuid filter
    page.fill('#filter', 'r1')
    assert page.locator('.lane:visible').count() == 1
    assert page.locator('#shown').inner_text() == '1 of 4 requests shown'

    # the problem tables: the failed step and the tool error; a row opens its request
    assert page.locator('.card.errors td').all_inner_texts() == ['r2', '1', 'step', 'RuntimeError: the tool exploded']
    assert page.locator('.card.tool-errors td').all_inner_texts() == ['r1', '1', 'search: no results']
    page.locator('.card.errors tr.open').click()
    page.locator('#detail').wait_for(state='visible')
    assert page.locator('#detail h2').inner_text() == 'r2'
    assert 'the tool exploded' in page.locator('#detail td.extra.err').inner_text()
    page.keyboard.press('Escape')

    # a link to one request opens its detail
    page.goto(html.as_uri() + '#r3')
    page.locator('#detail').wait_for(state='visible')
    assert page.locator('#detail h2').inner_text() == 'r3'
    assert page.locator('.lane.selected').get_attribute('data-uuid') == 'r3'

    assert problems == []
    print(f'screenshots: {tmp_path / "trace-page.png"} {tmp_path / "trace-detail.png"}')
