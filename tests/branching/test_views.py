"""A branched ``mtflow run`` (the scripted model): every leaf written with its parent, the trees
beside them, ``mtflow trace show`` with parents and the shared turns, the HTML page's trees, and
``mtflow diff`` and ``mtflow replay`` on it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtflow.cli import main
from mtflow.core.trace import Trace
from mtflow.train import read_samples, read_trees
from mtflow.viewer.model import request_views

ROOT = Path(__file__).resolve().parents[2]
GAME = {'max_turns': 5, 'env': {'impl': 'guess_number', 'kwargs': {'max_guesses': 5}},
        'system_prompt': 'Guess my number.', 'branch': {'at': {'turn': 2}, 'copies': 2, 'leaves': 3}}


@pytest.fixture(scope='module', params=['lockstep', 'async'])
def run_dir(request, tmp_path_factory) -> Path:
    """A branched run, in batches (lockstep) and streamed (``--mode async``: the groups' writer)."""
    tmp = tmp_path_factory.mktemp('branched')
    (tmp / 'game.yaml').write_text(json.dumps(GAME))
    (tmp / 'run.yaml').write_text(
        f'scheduler: game.yaml\nbackend: scripted\nmodel: {ROOT / "configs" / "scripted_guesses.jsonl"}\n'
        'backend_options: {cycle: true}\nlimit: 2\nmax_turns: 5\nrequest_config: {logprobs: true}\n')
    assert main(['run', str(tmp / 'run.yaml'), '-q', '--out', str(tmp / 'out'), '--mode', request.param]) == 0
    return tmp / 'out'


def test_every_leaf_is_written_with_its_parent_and_the_trees_beside_them(run_dir):
    lines = [json.loads(line) for line in (run_dir / 'trajectories.jsonl').read_text().splitlines()]
    trees = list(read_trees(run_dir / 'trees.jsonl'))
    assert [t['root'] for t in trees] == ['guess-00', 'guess-01']
    assert sorted(line['uuid'] for line in lines) == sorted(leaf for t in trees for leaf in t['leaves'])
    parents = {line['uuid']: line.get('parent') for line in lines}
    assert parents['guess-00'] is None and parents['guess-00~1'] == 'guess-00' and parents['guess-00~3'] == 'guess-00'
    assert {line['group'] for line in lines if line['uuid'].startswith('guess-00')} == {'guess-00'}
    assert {line['index'] for line in lines if line['uuid'].startswith('guess-01')} == {1}  # its prompt's position
    # each child's line replays it from turn 1: the parent's turn first
    child = next(line for line in lines if line['uuid'] == 'guess-00~1')
    assert [t['turn'] for t in child['turns']] == list(range(1, child['num_turns'] + 1))


def test_trace_show_names_each_childs_parent(run_dir, capsys):
    assert main(['trace', 'show', str(run_dir / 'trace.jsonl'), '--no-summary', '--color', 'never']) == 0
    out = capsys.readouterr().out
    header, *rows = out.splitlines()
    assert header.split()[:3] == ['request', 'parent', 'turn']
    row = next(r for r in rows if r.startswith('guess-00~1 '))
    assert row.split()[1] == 'guess-00' and row.split()[2] == '='  # its turn 1 is its parent's
    assert main(['trace', 'show', str(run_dir / 'trace.jsonl'), '--detail', 'guess-00~3', '--color', 'never']) == 0
    assert 'parent: guess-00 (a copy of its prompt)' in capsys.readouterr().out


def test_a_top_up_copy_is_one_request_in_the_views(run_dir):
    views = {v.uuid: v for v in request_views(Trace.read_jsonl(run_dir / 'trace.jsonl'))}
    assert len(views) == 6
    copy = views['guess-00~3']
    assert copy.parent == 'guess-00' and copy.cells[0].turn == 1 and copy.reason is not None
    assert views['guess-00'].children == ['guess-00~1']


def test_the_html_page_draws_each_group_as_a_tree(run_dir, tmp_path, capsys):
    page = tmp_path / 'page.html'
    assert main(['trace', 'html', str(run_dir / 'trace.jsonl'), '--trajectories', str(run_dir / 'trajectories.jsonl'),
                 '-o', str(page)]) == 0
    html = page.read_text()
    assert '<h2>Branched groups (2)</h2>' in html
    start = html.index('<h3>guess-00 (3 leaves)</h3>')
    tree = html[start:html.index('</div>', start)]
    assert tree.index('data-uuid="guess-00"') < tree.index('<ul><li><span class="open" data-uuid="guess-00~1"')
    assert 'forked at turn 2 (generating)' in tree and 'a copy of the prompt' in tree


def test_diff_and_replay_of_a_branched_run(run_dir, tmp_path, capsys):
    assert main(['replay', str(run_dir), '--out', str(tmp_path / 'again'), '-q']) == 0
    capsys.readouterr()
    assert main(['diff', str(run_dir), str(tmp_path / 'again')]) == 0, capsys.readouterr().out
    # a leaf that differs is found by its uuid
    lines = (tmp_path / 'again' / 'trajectories.jsonl').read_text().splitlines()
    changed = [json.loads(line) for line in lines]
    for line in changed:
        if line['uuid'] == 'guess-01~1':
            line['messages'][-1]['content'] += ' (edited)'
    (tmp_path / 'again' / 'trajectories.jsonl').write_text(''.join(json.dumps(d) + '\n' for d in changed))
    capsys.readouterr()
    assert main(['diff', str(run_dir), str(tmp_path / 'again')]) == 1
    assert 'guess-01~1' in capsys.readouterr().out


def test_the_leaves_read_back_as_samples_only_with_exact_ids(run_dir):
    """The scripted model keeps no token record: a trainer's exact samples are refused, by name."""
    from mtflow.train import SampleError

    with pytest.raises(SampleError, match='no prompt ids'):
        list(read_samples(run_dir / 'trajectories.jsonl'))
