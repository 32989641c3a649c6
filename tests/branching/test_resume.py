"""``--resume`` of a branched run (issue 47, item 11): a tree is on disk whole or not at all; an
interrupt sends a cut tree whole to ``interrupted.jsonl`` and ``--resume`` runs its prompt again,
so every tree ends whole; a tree a crash left short (a leaf or its line missing) is never
silently "complete": ``--resume`` names it, does not run its prompt into it again, and exits 1;
and the counts say prompts of prompts (``4 of 4 prompts already written (14 leaves)``), never
leaves of prompts."""
from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from mtflow.cli import main
from mtflow.run.files import TRAJECTORIES
from mtflow.run.groups import GroupWriter
from tests.helpers import jsonl_lines

ROOT = Path(__file__).resolve().parents[2]

SCHEDULER = '''
import asyncio
import os
import signal
import time
from mtflow import Branching, Scheduler


class CutOnce(Scheduler):
    """p0's tree ends at turn 1 (the prompt and its top-up copy p0~2); p1 forks before turn 2 and runs
    3 turns; while the file ``interrupt-once`` exists, p1~1's step at turn 2 waits until p0's tree has
    finished (under ``--mode async`` p0~2 runs beside it), then is a Ctrl-C."""
    branch = Branching(at={'turn': 2}, copies=2, leaves=2)
    done = set()  # the module is executed afresh for every run
    ends = {}  # the turn a request ends at, where not p0's tree's 1 or p1's tree's 3

    def on_request_finished(self, infer_request, reason, turn):
        self.done.add(infer_request.uuid)

    def check_finished(self, infer_request, response_choice, current_turn):
        uuid = infer_request.uuid
        return current_turn >= self.ends.get(uuid, 1 if uuid.startswith('p0') else 3)

    def cutting(self, infer_request, current_turn):
        """p1~1's step at turn 2, once."""
        if infer_request.uuid == 'p1~1' and current_turn == 2 and os.path.exists('interrupt-once'):
            os.unlink('interrupt-once')
            self.since = time.monotonic()
            return True
        return False

    def waiting_for(self, uuids):
        return not set(uuids) <= self.done and time.monotonic() < self.since + 30  # bounded: a hang fails

    def go_on(self, infer_request, current_turn):
        infer_request.messages.append({'role': 'user', 'content': f'go on {current_turn}'})
        return {'infer_request': infer_request}

    def step(self, infer_request, response_choice, current_turn):
        if self.cutting(infer_request, current_turn):
            while self.waiting_for({'p0', 'p0~2'}):  # a step thread of its own under --mode async
                time.sleep(0.01)
            raise KeyboardInterrupt
        return self.go_on(infer_request, current_turn)


class Signalled(CutOnce):
    """The same trees, stopped by a real SIGTERM (as a cluster's scheduler sends it) once p0's tree
    and p1's first leaf have finished: p1 ends at turn 2, and p1~1's step at turn 2 waits for them,
    then signals (its coroutine is cancelled by the stop)."""
    ends = {'p1': 2}

    async def step(self, infer_request, response_choice, current_turn):
        if self.cutting(infer_request, current_turn):
            while self.waiting_for({'p0', 'p0~2', 'p1'}):  # p1's tree is then cut with one leaf finished
                await asyncio.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(60)
        return self.go_on(infer_request, current_turn)
'''


def _uuids(path: Path) -> list:
    return sorted(t['uuid'] for t in jsonl_lines(path)) if path.is_file() else []


@pytest.mark.parametrize('mode', ['lockstep', 'async'])
@pytest.mark.parametrize('stop', ['KeyboardInterrupt', 'SIGTERM'])
def test_an_interrupted_tree_is_kept_whole_apart_and_run_again(tmp_path, monkeypatch, capsys, mode, stop):
    """In ``--mode async`` too (issue 47 item 11 had no test there): a ``KeyboardInterrupt`` a step
    raised in the stream's own thread lost the requests in flight (nothing in ``interrupted.jsonl``);
    under SIGTERM a cut tree's finished leaf was written as done, and a signal that came while a
    whole tree was being written (its leaves' fsync) left its leaves on disk without its line in
    ``trees.jsonl``: either way a tree short for good, and ``--resume`` then fails."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'cut_once.py').write_text(SCHEDULER)
    (tmp_path / 'data.jsonl').write_text(''.join(json.dumps({'uuid': u, 'prompt': 'go'}) + '\n' for u in ('p0', 'p1')))
    name = 'CutOnce' if stop == 'KeyboardInterrupt' else 'Signalled'
    (tmp_path / 'run.yaml').write_text(f'scheduler: cut_once.py:{name}\nbackend: scripted\nbackend_options: '
                                       '{outputs: [a guess], cycle: true}\ndataset: data.jsonl\nout: out\nmax_turns: 4\n'
                                       'batch_size: 4\n')
    (tmp_path / 'interrupt-once').touch()
    assert main(['run', 'run.yaml', '-q', '--mode', mode]) == (130 if stop == 'KeyboardInterrupt' else 143)
    out = tmp_path / 'out'
    # p0's tree finished whole before the interrupt: on disk with its line; p1's was cut: all of it
    # (its finished leaves too) in interrupted.jsonl, nothing of it done
    assert _uuids(out / 'trajectories.jsonl') == ['p0', 'p0~2']
    assert [t['root'] for t in jsonl_lines(out / 'trees.jsonl')] == ['p0']
    assert _uuids(out / 'interrupted.jsonl') == ['p1', 'p1~1']
    if stop == 'SIGTERM':  # the leaf that had finished is kept as it finished
        reasons = {t['uuid']: t['finish_reason'] for t in jsonl_lines(out / 'interrupted.jsonl')}
        assert reasons == {'p1': 'check_finished', 'p1~1': 'interrupted'}
    summary = json.loads((out / 'summary.json').read_text())
    assert (summary['status'], summary['written'], summary['interrupted']) == ('interrupted', 2, 2)
    capsys.readouterr()
    assert main(['run', 'run.yaml', '--resume', '--mode', mode]) == 0
    err = capsys.readouterr().err
    assert 'resuming out: 1 of 2 prompts already written (2 leaves)' in err
    assert _uuids(out / 'trajectories.jsonl') == ['p0', 'p0~2', 'p1', 'p1~1']
    trees = {t['root']: t for t in jsonl_lines(out / 'trees.jsonl')}
    assert sorted(trees) == ['p0', 'p1'] and trees['p1']['leaves'] == ['p1', 'p1~1']
    summary = json.loads((out / 'summary.json').read_text())
    assert (summary['requests'], summary['prompts_written'], summary['written'], summary['trees_short']) == \
        (2, 2, 4, [])


@pytest.mark.parametrize('mode', ['lockstep', 'async', pytest.param('ray', marks=pytest.mark.slow)])
def test_a_signal_while_a_tree_is_written_waits_for_its_line(tmp_path, monkeypatch, capsys, mode):
    """A SIGTERM that comes while the first finished tree's leaves are being written (between their
    lines and the tree's line of ``trees.jsonl``) waits until the tree is whole: before, the leaves
    were on disk without the line, and ``--resume`` found that tree short for good (exit 1). The
    resume then writes every other tree once: no leaf lost, none twice. ``ray``: ``--ray 2``, the
    trees delivered by the fan-out (``mtflow/distributed/ray_fanout.py``)."""
    if mode == 'ray':
        pytest.importorskip('ray')
    how = ['--ray', '2'] if mode == 'ray' else ['--mode', mode]
    append = GroupWriter._append
    signalled = []

    def append_then_signal(self, name, data):  # the signal lands in the main thread, mid-write
        append(self, name, data)
        if name == TRAJECTORIES and not signalled:
            signalled.append(name)
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(GroupWriter, '_append', append_then_signal)
    out = tmp_path / 'run'
    config = str(ROOT / 'configs' / 'scripted_branch.yaml')
    assert main(['run', config, '--out', str(out), '-q', *how, '--batch-size', '1']) == 143
    monkeypatch.setattr(GroupWriter, '_append', append)
    trees = list(jsonl_lines(out / 'trees.jsonl')) if (out / 'trees.jsonl').is_file() else []
    leaves = _uuids(out / 'trajectories.jsonl')
    # every leaf on disk is a whole tree's
    assert leaves and sorted(str(u) for t in trees for u in t['leaves']) == leaves
    capsys.readouterr()
    assert main(['run', config, '--out', str(out), '--resume', '--no-progress', *how]) == 0
    assert f'{len(trees)} of 4 prompts already written ({len(leaves)} leaves)' in capsys.readouterr().err
    lines = [t['uuid'] for t in jsonl_lines(out / 'trajectories.jsonl')]
    assert len(lines) == len(set(lines)) == 16
    trees = list(jsonl_lines(out / 'trees.jsonl'))
    assert len(trees) == 4 and sorted(str(u) for t in trees for u in t['leaves']) == sorted(lines)
    assert json.loads((out / 'summary.json').read_text())['trees_short'] == []


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
