"""``--resume`` of a branched run (issue 47, item 11): a tree is on disk whole or not at all; an
interrupt sends a cut tree whole to ``interrupted.jsonl`` and ``--resume`` runs its prompt again,
so every tree ends whole; a tree a crash left short (a leaf or its line missing) is never
silently "complete": ``--resume`` names it, does not run its prompt into it again, and exits 1;
and the counts say prompts of prompts (``4 of 4 prompts already written (14 leaves)``), never
leaves of prompts."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mtflow.cli import main
from tests.helpers import jsonl_lines

ROOT = Path(__file__).resolve().parents[2]

SCHEDULER = '''
import os
from mtflow import Branching, Scheduler


class CutOnce(Scheduler):
    """p0's tree ends at turn 1 (the prompt and its top-up copy p0~2); p1 forks before turn 2 and runs
    3 turns; while the file ``interrupt-once`` exists, p1~1's step at turn 2 is a Ctrl-C."""
    branch = Branching(at={'turn': 2}, copies=2, leaves=2)

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= (1 if infer_request.uuid.startswith('p0') else 3)

    def step(self, infer_request, response_choice, current_turn):
        if infer_request.uuid == 'p1~1' and current_turn == 2 and os.path.exists('interrupt-once'):
            os.unlink('interrupt-once')
            raise KeyboardInterrupt
        infer_request.messages.append({'role': 'user', 'content': f'go on {current_turn}'})
        return {'infer_request': infer_request}
'''


def _uuids(path: Path) -> list:
    return sorted(t['uuid'] for t in jsonl_lines(path)) if path.is_file() else []


def test_an_interrupted_tree_is_kept_whole_apart_and_run_again(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'cut_once.py').write_text(SCHEDULER)
    (tmp_path / 'data.jsonl').write_text(''.join(json.dumps({'uuid': u, 'prompt': 'go'}) + '\n' for u in ('p0', 'p1')))
    (tmp_path / 'run.yaml').write_text('scheduler: cut_once.py:CutOnce\nbackend: scripted\nbackend_options: '
                                       '{outputs: [a guess], cycle: true}\ndataset: data.jsonl\nout: out\nmax_turns: 4\n'
                                       'batch_size: 4\n')
    (tmp_path / 'interrupt-once').touch()
    assert main(['run', 'run.yaml', '-q']) == 130
    out = tmp_path / 'out'
    # p0's tree finished whole before the interrupt: on disk with its line; p1's was cut: all of it
    # (its finished leaves too) in interrupted.jsonl, nothing of it done
    assert _uuids(out / 'trajectories.jsonl') == ['p0', 'p0~2']
    assert [t['root'] for t in jsonl_lines(out / 'trees.jsonl')] == ['p0']
    assert _uuids(out / 'interrupted.jsonl') == ['p1', 'p1~1']
    capsys.readouterr()
    assert main(['run', 'run.yaml', '--resume']) == 0
    err = capsys.readouterr().err
    assert 'resuming out: 1 of 2 prompts already written (2 leaves)' in err
    assert _uuids(out / 'trajectories.jsonl') == ['p0', 'p0~2', 'p1', 'p1~1']
    trees = {t['root']: t for t in jsonl_lines(out / 'trees.jsonl')}
    assert sorted(trees) == ['p0', 'p1'] and trees['p1']['leaves'] == ['p1', 'p1~1']
    summary = json.loads((out / 'summary.json').read_text())
    assert (summary['requests'], summary['prompts_written'], summary['written'], summary['trees_short']) == \
        (2, 2, 4, [])


@pytest.fixture
def branched_run(tmp_path):
    out = tmp_path / 'run'
    assert main(['run', str(ROOT / 'configs' / 'scripted_branch.yaml'), '--out', str(out), '-q']) == 0
    return out


def _resume(out: Path, capsys) -> tuple:
    capsys.readouterr()
    (out / 'summary.json').unlink()  # as after a crash
    code = main(['run', str(ROOT / 'configs' / 'scripted_branch.yaml'), '--out', str(out), '--resume', '--no-progress'])
    return code, capsys.readouterr().err


def test_a_tree_short_of_leaves_is_named_and_fails_the_resume(branched_run, capsys):
    out = branched_run
    lines = (out / 'trajectories.jsonl').read_text().splitlines(keepends=True)
    assert len(lines) == 16
    (out / 'trajectories.jsonl').write_text(''.join(lines[:14]))  # a crash took the last tree's last two leaves
    code, err = _resume(out, capsys)
    assert code == 1
    assert 'resuming' in err and '4 of 4 prompts already written (14 leaves)' in err
    assert 'guess-03 (2 leaves on disk; 2 of its 4 leaves missing: guess-03~2, guess-03~3)' in err
    assert err.strip().splitlines()[-1].startswith('mtflow: 1 tree(s) short of their leaves in ')
    assert len(_uuids(out / 'trajectories.jsonl')) == 14  # the prompt did not run again into its tree
    summary = json.loads((out / 'summary.json').read_text())
    assert [t['root'] for t in summary['trees_short']] == ['guess-03'] and summary['prompts_written'] == 4


def test_a_tree_without_its_line_is_short_too(branched_run, capsys):
    out = branched_run
    trees = (out / 'trees.jsonl').read_text().splitlines(keepends=True)
    (out / 'trees.jsonl').write_text(''.join(trees[:-1]))  # a crash between the leaves' fsync and the tree's line
    code, err = _resume(out, capsys)
    root = json.loads(trees[-1])['root']
    assert code == 1 and f'{root} (4 leaves on disk; no line in trees.jsonl)' in err


def test_a_whole_branched_run_resumes_to_nothing(branched_run, capsys):
    code, err = _resume(branched_run, capsys)
    assert code == 0 and '4 of 4 prompts already written (16 leaves)' in err
    assert json.loads((branched_run / 'summary.json').read_text())['trees_short'] == []
    shutil.rmtree(branched_run)
