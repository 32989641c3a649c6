"""The HTML page's plots (issue 40): a group's label whole under its column (a reasoning-gym group
read ``basic_ari…``), every column's value on it, and no tool-latency plot for a run whose steps
call no tool (an environment's moves, drawn as "tool latency" before)."""
from __future__ import annotations

import json
import re
import textwrap
import xml.etree.ElementTree as ET

from mtflow.cli import main

SVG = '{http://www.w3.org/2000/svg}'
SCHEDULER = '''
import mtflow


class Moves(mtflow.Scheduler):
    """An environment's moves (no tool call), a reward per copy."""

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'higher'})
        k = int(infer_request.uuid.rpartition('#')[2])
        return {'infer_request': infer_request, 'rollout_infos': {'reward': k / 2}}
'''


def _page(tmp_path, monkeypatch, groups):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'moves.py').write_text(SCHEDULER)
    (tmp_path / 'script.jsonl').write_text(json.dumps({'content': 'My guess is 50.'}) + '\n')
    (tmp_path / 'data.jsonl').write_text(''.join(json.dumps({'uuid': g, 'prompt': 'go'}) + '\n' for g in groups))
    (tmp_path / 'run.yaml').write_text(textwrap.dedent('''\
        scheduler: moves.py:Moves
        backend: scripted
        model: script.jsonl
        backend_options: {cycle: true}
        dataset: data.jsonl
        num_generations: 3
        max_turns: 2
        out: out
        '''))
    assert main(['run', 'run.yaml', '-q']) == 0
    assert main(['trace', 'html', 'out/trace.jsonl', '--trajectories', 'out/trajectories.jsonl', '-o', 'p.html']) == 0
    return (tmp_path / 'p.html').read_text()


def _svg(page: str, css: str) -> ET.Element:
    m = re.search(rf'<svg [^>]*class="plot {css}".*?</svg>', page, re.S)
    assert m, f'no {css} plot'
    return ET.fromstring(m.group(0))


def test_group_labels_are_whole_and_every_column_shows_its_value(tmp_path, monkeypatch, capsys):
    groups = [f'basic_arithmetic_{i:04d}' for i in range(3)]
    svg = _svg(_page(tmp_path, monkeypatch, groups), 'plot-groups')
    labels = [t.text for t in svg.iter(f'{SVG}text') if t.get('class') == 'label']
    values = [t.text for t in svg.iter(f'{SVG}text') if t.get('class') == 'value']
    assert labels == groups, 'each label whole'
    assert values == ['0.5'] * 3, "each group's mean reward (copies 0, 0.5, 1) on its column"
    height = float(svg.get('height'))
    assert height >= 34 + 120 + len(groups[0]) * 6 * 0.87, 'tall enough for the slanted labels'


def test_many_columns_keep_their_labels_and_values_upright(tmp_path, monkeypatch, capsys):
    groups = [f'task_{i:02d}' for i in range(20)]  # more than 12 columns: narrow, slanted labels
    svg = _svg(_page(tmp_path, monkeypatch, groups), 'plot-groups')
    labels = [t.text for t in svg.iter(f'{SVG}text') if t.get('class') == 'label']
    values = [t for t in svg.iter(f'{SVG}text') if t.get('class') == 'value']
    assert labels == groups and len(values) == 20 and all(v.text == '0.5' for v in values)


def test_a_run_without_tool_calls_has_no_tool_latency_plot(tmp_path, monkeypatch, capsys):
    page = _page(tmp_path, monkeypatch, ['g0', 'g1'])
    assert 'plot-latency' not in page and 'tool latency' not in page
    assert 'plot-turns' in page and 'plot-groups' in page
