"""The results part of the HTML page in headless Chromium, for a 200-request run with GRPO groups
written by ``mtflow run`` (tests/viewer/results_run.py): the header names the run, the summary
cards and the six plots render (and the screenshots show them: their pixels are read back in
the browser), the request table sorts by reward, filters to ``reward==0``, a group view shows a
group's copies side by side, and the message search finds a word. Screenshots stay in the
test's tmp directory."""
from __future__ import annotations

import base64
import json

import pytest

from mtflow.cli import main
from tests.viewer.results_run import write_results_run
from tests.viewer.test_trace_browser import browser_page  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow

# a screenshot decoded by the browser itself: the share of pixels near a colour (no image library)
_SHARE = '''async ([data, rgb, tol]) => {
  const img = new Image(); img.src = 'data:image/png;base64,' + data; await img.decode();
  const c = document.createElement('canvas'); c.width = img.width; c.height = img.height;
  const g = c.getContext('2d'); g.drawImage(img, 0, 0);
  const px = g.getImageData(0, 0, img.width, img.height).data; let n = 0;
  for (let i = 0; i < px.length; i += 4)
    if (Math.abs(px[i] - rgb[0]) <= tol && Math.abs(px[i+1] - rgb[1]) <= tol && Math.abs(px[i+2] - rgb[2]) <= tol) n++;
  return n / (px.length / 4);
}'''
PURPLE, CYAN, AMBER, BLUE = (0x8b, 0x5c, 0xf6), (0x06, 0xb6, 0xd4), (0xf5, 0x9e, 0x0b), (0x3b, 0x82, 0xf6)


def color_share(page, png: bytes, rgb, tol: int = 12) -> float:
    return page.evaluate(_SHARE, [base64.b64encode(png).decode(), list(rgb), tol])


@pytest.fixture(scope='module')
def run(tmp_path_factory):
    return write_results_run(tmp_path_factory.mktemp('results200'), prompts=50)


def _cells(page, column: int):
    return page.eval_on_selector_all(
        f'#reqtable tbody tr', f'rows => rows.filter(r => r.style.display !== "none")'
        f'.map(r => r.children[{column}].textContent)')


def test_results_page_in_a_browser(run, tmp_path, browser_page):  # noqa: F811
    page, problems = browser_page
    out = tmp_path / 'results.html'
    assert main(['trace', 'html', str(run['trace']), '--trajectories', str(run['trajectories']), '-o', str(out)]) == 0
    truth = {d['uuid']: d for d in map(json.loads, run['trajectories'].read_text().splitlines())}
    page.goto(out.as_uri())
    page.wait_for_selector('#reqtable tbody tr')

    # header: the run's name and its config (collapsed)
    assert page.locator('header h1').inner_text() == 'out'
    assert page.locator('.runname').inner_text() == 'run out'
    assert 'num_generations: 4' in page.locator('.runconfig pre').text_content()
    assert page.locator('.runconfig pre').is_hidden()
    # the summary cards come from summary.json
    card = {page.locator('.rcard span').nth(i).inner_text(): page.locator('.rcard b').nth(i).inner_text()
            for i in range(page.locator('.rcard').count())}
    assert card['requests'] == '200' and card['mean reward'] == '0.25' and card['groups'] == '50'
    assert card['groups with a reward spread'] == '25 of 50'

    # the plots: each a non-empty SVG, and the screenshot of each shows its bars
    for cls, color in (('plot-reward', PURPLE), ('plot-groups', PURPLE), ('plot-turns', BLUE), ('plot-tokens', CYAN),
                       ('plot-latency', AMBER)):
        svg = page.locator(f'svg.{cls}')
        assert svg.count() == 1 and svg.locator('rect.col').count() > 0, cls
        box = svg.bounding_box()
        assert box['width'] > 100 and box['height'] > 100, (cls, box)
        shot = svg.screenshot(path=str(tmp_path / f'{cls}.png'))
        assert color_share(page, shot, color) > 0.03, f'{cls}: its bars are not in the screenshot'
    assert page.locator('svg.plot-reasons rect').count() == 1
    assert page.locator('svg.plot-reward rect.col').count() == 4  # rewards 0, 1/3, 2/3, 1
    page.screenshot(path=str(tmp_path / 'results-page.png'), full_page=True)

    # sort by reward (descending first), then ascending
    page.locator('#reqtable th[data-key="reward"]').click()
    rewards = [float(x) for x in _cells(page, 2)]
    assert len(rewards) == 200 and rewards == sorted(rewards, reverse=True) and rewards[0] == 1
    page.locator('#reqtable th[data-key="reward"]').click()
    assert [float(x) for x in _cells(page, 2)] == sorted(rewards)

    # filter to reward == 0: the table and the swimlanes follow
    page.fill('#where', 'reward==0')
    zero = {u for u, d in truth.items() if d['reward'] == 0}
    assert set(_cells(page, 0)) == zero and len(zero) == 125
    assert page.locator('#table-shown').inner_text() == '125 of 200 requests in the table'
    assert page.locator('.lane:visible').count() == 125
    page.fill('#where', 'reward==0, turns>=4')
    assert set(_cells(page, 0)) == {u for u in zero if truth[u]['num_turns'] >= 4}
    page.fill('#where', 'reward<<0')
    assert 'is a number' in page.locator('#where-error').inner_text()
    page.fill('#where', 'reward>0.5')
    table_shot = page.locator('#tablebox').screenshot(path=str(tmp_path / 'table-filtered.png'))
    assert all(float(x) > 0.5 for x in _cells(page, 2))

    # a group view: the four copies of p4 side by side, with their rewards
    page.fill('#where', '')
    page.locator('#reqtable tbody tr[data-uuid="p4#2"] a.grp').click()
    gv = page.locator('#groupview')
    gv.wait_for(state='visible')
    assert page.locator('#group-title').inner_text() == 'group p4: 4 copies, mean reward 0.5'
    copies = page.locator('#group-copies .copy')
    assert [copies.nth(i).get_attribute('data-uuid') for i in range(4)] == ['p4#0', 'p4#1', 'p4#2', 'p4#3']
    assert copies.nth(3).locator('.copy-meta').inner_text().startswith('reward 1 · check_finished')
    boxes = [copies.nth(i).bounding_box() for i in range(4)]
    assert len({round(b['y']) for b in boxes}) == 1 and boxes[0]['x'] < boxes[1]['x'] < boxes[3]['x'], 'side by side'
    gv.screenshot(path=str(tmp_path / 'group-view.png'))

    # search the messages: only prompt 7 says 'zebra'; the group view marks it
    page.fill('#search', 'zebra')
    assert sorted(_cells(page, 0)) == ['p7#0', 'p7#1', 'p7#2', 'p7#3']
    page.locator('#reqtable tbody tr[data-uuid="p7#1"] a.grp').click()
    assert page.locator('#group-copies mark').first.inner_text() == 'zebra'
    search_shot = gv.screenshot(path=str(tmp_path / 'search.png'))
    assert color_share(page, search_shot, (0xfd, 0xe6, 0x8a), tol=8) > 0.0005, 'the highlight shows'

    # a row opens the request's detail; its token record is collapsed
    page.locator('#reqtable tbody tr[data-uuid="p7#1"] td').first.click()
    page.locator('#detail').wait_for(state='visible')
    assert page.locator('#detail h2').inner_text() == 'p7#1'
    assert table_shot and problems == []
    print(f'screenshots in {tmp_path}')
