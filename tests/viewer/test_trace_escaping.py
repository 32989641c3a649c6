"""Model output is data: ``mtflow trace show`` neither interprets rich markup from it nor passes
its terminal control or BIDI characters through; the trajectories keep its bytes exactly."""
from __future__ import annotations

import json

import pytest

from mtflow.cli import main as cli
from mtflow.core.trace import Trace
from mtflow.run.trajectories import read_trajectories, write_trajectories
from mtflow.viewer.html import render_html
from mtflow.viewer.terminal import safe_text

#: a window-title set, clear screen and cursor home, an OSC 8 hyperlink, a NUL, a bell, a C1 CSI,
#: a right-to-left override and isolate, and rich markup
EVIL = ('\x1b]0;pwned-title\x07\x1b[2J\x1b[H\x1b]8;;https://evil.example/\x07click\x1b]8;;\x07 nul\x00 '
        '\x9b31m \u202eevil\u2066x\u2069 [link=https://evil.example/]here[/link] [bold red]loud[/bold red]')

_RAW = ('\x1b]', '\x1b[2J', '\x1b[H', '\x00', '\x07', '\x9b', '\u202e', '\u2066', '\u2069')


@pytest.fixture
def evil_files(scenario_files):
    trajs = read_trajectories(scenario_files['trajectories'])
    trajs['r0'].messages[0]['content'] = EVIL
    write_trajectories(scenario_files['trajectories'], trajs.values())
    # the tool error of r1 (what the python tool's output becomes) carries it too
    lines = scenario_files['trace'].read_text().splitlines()
    needle = json.dumps('search: no results')[1:-1]
    assert any(needle in line for line in lines)
    evil = json.dumps('search: ' + EVIL)[1:-1]
    scenario_files['trace'].write_text('\n'.join(line.replace(needle, evil) for line in lines) + '\n')
    return scenario_files


def _check(out: str) -> None:
    for raw in _RAW:
        assert raw not in out, f'{raw!r} reached the terminal'
    assert '[link=https://evil.example/]here[/link]' in out and '[bold red]loud[/bold red]' in out
    assert '\\x1b]0;pwned-title\\x07' in out and '\\u202eevil' in out and 'nul\\x00' in out


@pytest.mark.parametrize('color', ['always', 'never'])
def test_trace_show_prints_model_text_as_data(evil_files, capsys, color):
    f = evil_files
    assert cli(['trace', 'show', str(f['trace']), '--color', color, '--width', '400']) == 0
    _check(capsys.readouterr().out)
    assert cli(['trace', 'show', str(f['trace']), '--trajectories', str(f['trajectories']), '--detail', 'r0',
                '--color', color, '--width', '400']) == 0
    _check(capsys.readouterr().out)


def test_trajectories_and_the_html_page_keep_the_bytes(evil_files):
    trajs = read_trajectories(evil_files['trajectories'])
    assert trajs['r0'].messages[0]['content'] == EVIL  # training data: unchanged
    page = render_html(Trace.read_jsonl(evil_files['trace']), trajectories=trajs)
    # the HTML viewer escapes markup (test_trace_html.py) and shows message text through textContent
    data = json.loads(page.split('id="mtflow-data">', 1)[1].split('</script>', 1)[0])
    assert data['trajectories']['r0']['messages'][0]['content'] == EVIL


def test_safe_text_escapes_only_what_is_unsafe():
    assert safe_text('a\tb\nc é 中 [x]').plain == 'a\tb\nc é 中 [x]'
    assert safe_text('\x1b[31m\x7f\u200f').plain == '\\x1b[31m\\x7f\\u200f'
