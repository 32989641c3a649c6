"""The HTML page: self-contained, every request in it, message text kept as text; and the state
graph as SVG from the declaration."""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

from mtflow.cli import main as cli
from mtflow.commands.graph import graph_for_scheduler
from mtflow.core.machine import STATES, StateGraph
from mtflow.core.trace import Trace
from mtflow.run.trajectories import read_trajectories
from mtflow.viewer.html import render_html
from mtflow.viewer.svg import state_graph_svg
from tests.viewer.viewer_scenario import EXPECTED_PATHS, ToolScheduler, make_tokenizer

SVG = '{http://www.w3.org/2000/svg}'


def page_data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="mtflow-data">(.*?)</script>', page, re.S)
    assert m, 'no data block'
    return json.loads(m.group(1))


def test_page_is_self_contained_and_has_every_request(scenario_files, tmp_path, capsys):
    f = scenario_files
    out = tmp_path / 'page.html'
    assert cli(['trace', 'html', str(f['trace']), '--trajectories', str(f['trajectories']), '--tokenizer',
                str(f['tokenizer']), '-o', str(out)]) == 0
    assert f'wrote {out} (4 requests' in capsys.readouterr().out
    page = out.read_text()
    # no network: no external scripts, styles, images or links; the only URL is the SVG namespace
    assert not re.search(r'<(link|img|iframe)\b', page)
    assert not re.search(r'<script[^>]+src=', page)
    assert set(re.findall(r'https?://[^\s"\'<>)]+', page)) == {'http://www.w3.org/2000/svg'}
    assert '@import' not in page and 'url(' not in page.replace('url(#mtf-arrow)', '')
    data = page_data(page)
    assert [r['uuid'] for r in data['requests']] == list(EXPECTED_PATHS)
    assert {r['uuid']: r['path'] for r in data['requests']} == EXPECTED_PATHS
    seg = data['trajectories']['r1']['segments'][0]
    assert seg['text'] == ['call', 'bad', 'no', 'results'] and seg['mask'] == [1, 1, 0, 0]
    # the state graph drawn in the page counts the trace's moves and lists its finish reasons
    assert 'run_step ×4' in page and 'stop_rule:final_answer ×2' in page


def test_message_text_cannot_break_out_of_the_page(scenario_files):
    trace = Trace.read_jsonl(scenario_files['trace'])
    trajs = read_trajectories(scenario_files['trajectories'])
    evil = '</script><script>window.pwned=1</script><!-- <img src=x onerror=alert(1)>'
    trajs['r0'].messages[0]['content'] = evil
    page = render_html(trace, trajectories=trajs)
    assert page.count('</script>') == 2  # the data block's and the code's, nothing from the message
    assert page_data(page)['trajectories']['r0']['messages'][0]['content'] == evil


def test_graph_svg_from_the_declaration(tmp_path, capsys):
    out = tmp_path / 'graph.svg'
    assert cli(['graph', '--format', 'svg', '-o', str(out)]) == 0
    root = ET.parse(out).getroot()  # well-formed XML
    assert root.tag == SVG + 'svg'
    states = [g.get('data-state') for g in root.iter(SVG + 'g')]
    assert states == list(STATES)
    graph = StateGraph()
    pairs = {(s, d) for s, _, d in graph.edges()}
    drawn = {tuple(p.get('data-edge').split('->')) for p in root.iter(SVG + 'path') if p.get('data-edge')}
    assert drawn == pairs
    labels = ' '.join(t.text or '' for t in root.iter(SVG + 'text'))
    for _, trigger, _ in graph.edges():
        assert trigger in labels
    for reason in graph.finish_reasons:
        assert reason in labels
    # forward moves go left to right: pending first, finished last
    xs = {g.get('data-state'): float(g.find(SVG + 'rect').get('x')) for g in root.iter(SVG + 'g')}
    assert xs['pending'] < xs['generating'] == xs['continuing'] < xs['tool_step'] < xs['finished']
    # mermaid stays the default
    assert cli(['graph']) == 0
    assert 'stateDiagram' in capsys.readouterr().out


def test_graph_svg_of_a_scheduler_has_its_finish_reasons():
    graph = graph_for_scheduler(ToolScheduler(make_tokenizer()))
    svg = state_graph_svg(graph, title=graph.name)
    assert 'stop_rule:final_answer' in svg and 'ToolScheduler' in svg
    assert 'max_turns' in svg
