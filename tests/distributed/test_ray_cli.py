"""``mtflow run CONFIG --ray 2``: a local Ray cluster started and shut down by the command, two
actors that each build the config's backend and scheduler; the run directory equals a local
run's (every trajectory once, same contents and trace paths), ``--resume`` after a crash writes
only what is missing, and no Ray process outlives the command."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

pytest.importorskip('ray')
psutil = pytest.importorskip('psutil')

from mtflow.cli import main  # noqa: E402
from tests.distributed import ray_helpers as H  # noqa: E402

N = 12


@pytest.fixture(scope='module')
def project(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp('raycli')
    (d / 'data.jsonl').write_text(''.join(
        json.dumps({'uuid': f'q{k}', 'prompt': f'question q{k}', 'data_dict': {'turns': H.turns_of(k)}}) + '\n'
        for k in range(N)))
    (d / 'script.jsonl').write_text(''.join(json.dumps(line) + '\n' for line in H.script(N)))
    (d / 'run.yaml').write_text('scheduler: tests.distributed.ray_helpers:CountTurns\nbackend: scripted\n'
                                'model: script.jsonl\ndataset: data.jsonl\nmax_turns: 10\nbatch_size: 3\n'
                                'request_config: {logprobs: true}\n')
    return d


@pytest.fixture(scope='module')
def local_run(project) -> Path:
    out = project / 'local'
    assert main(['run', str(project / 'run.yaml'), '--out', str(out), '-q']) == 0
    return out


def run_cli(argv: List[str]) -> int:
    """Run the command in this process; check that every process it started is gone."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    code = main(argv)
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(started, timeout=60)
    assert not alive, [(p.pid, p.name()) for p in alive]
    return code


def trajectories(out: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in (out / 'trajectories.jsonl').open()]


def paths(out: Path) -> Dict[str, List[tuple]]:
    by_uuid: Dict[str, List[tuple]] = {}
    for line in (out / 'trace.jsonl').open():
        e = json.loads(line)
        by_uuid.setdefault(e['uuid'], []).append((e['index'], e['turn'], e['from'], e['to'], e['reason']))
    return by_uuid


def same_as_local(out: Path, local: Path) -> None:
    got = trajectories(out)
    uuids = [t['uuid'] for t in got]
    assert len(uuids) == len(set(uuids)) == N  # every request exactly once
    want = {t['uuid']: t for t in trajectories(local)}
    for t in got:
        assert {k: v for k, v in t.items() if k != 'rank'} == {k: v for k, v in want[t['uuid']].items() if k != 'rank'}
    assert paths(out) == paths(local)


@pytest.mark.slow
def test_ray_run_then_resume_after_a_crash(project, local_run):
    out = project / 'ray'
    assert run_cli(['run', str(project / 'run.yaml'), '--out', str(out), '--ray', '2', '-q']) == 0
    same_as_local(out, local_run)
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['written'] == N and summary['backend'] == 'scripted (scripted:script.jsonl) on 2 Ray actor(s)'
    run_info = json.loads((out / 'run.json').read_text())
    ray_figures = run_info['attempts'][-1]['ray']
    assert ray_figures['actors'] == 2 and ray_figures['deaths'] == 0
    assert sum(ray_figures['per_actor'].values()) == N

    # a crash after 5 trajectories reached the disk: no summary, the rest of the lines missing
    lines = (out / 'trajectories.jsonl').read_text().splitlines(keepends=True)
    (out / 'trajectories.jsonl').write_text(''.join(lines[:5]))
    (out / 'summary.json').unlink()
    assert run_cli(['run', str(project / 'run.yaml'), '--out', str(out), '--ray', '2', '--resume', '-q']) == 0
    same_as_local(out, local_run)
    summary = json.loads((out / 'summary.json').read_text())
    assert (summary['written'], summary['resumed_from'], summary['attempts']) == (N, 5, 2)
    assert json.loads((out / 'run.json').read_text())['attempts'][-1]['skipped'] == 5


def test_ray_flag_errors_are_one_line(project, capsys):
    assert main(['run', str(project / 'run.yaml'), '--out', str(project / 'bad'), '--ray', '0', '-q']) == 2
    assert '--ray needs a number of actors >= 1' in capsys.readouterr().err


@pytest.mark.slow
def test_a_branched_config_on_ray_writes_every_leaf_and_every_tree(tmp_path):
    """Issue 47, item 10: ``--ray`` used to write only the roots of a branched run (no
    ``trees.jsonl``, status complete, exit 0); now its directory is a local run's."""
    config = str(Path(__file__).resolve().parents[2] / 'configs' / 'scripted_branch.yaml')
    local, fanned = tmp_path / 'local', tmp_path / 'ray'
    assert main(['run', config, '--out', str(local), '-q']) == 0
    assert run_cli(['run', config, '--out', str(fanned), '--ray', '2', '-q']) == 0
    got, want = trajectories(fanned), trajectories(local)
    assert len(got) == len(want) == 16 and len({t['uuid'] for t in got}) == 16  # 4 games, 4 leaves each
    want_by_uuid = {t['uuid']: t for t in want}
    for t in got:
        assert {k: v for k, v in t.items() if k != 'rank'} == {k: v for k, v in want_by_uuid[t['uuid']].items()
                                                               if k != 'rank'}
    trees = lambda out: sorted((out / 'trees.jsonl').read_text().splitlines())  # noqa: E731
    assert trees(fanned) == trees(local) and len(trees(fanned)) == 4
    assert paths(fanned) == paths(local)
    assert json.loads((fanned / 'summary.json').read_text())['written'] == 16
