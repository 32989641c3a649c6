"""``mtflow replay`` of a run played against an OpenEnv server the run launched: a replay (which
launches its own server) against the unchanged config is identical, and ``--tools recorded``
launches no server and opens no session, with the same rewards."""
import json
from pathlib import Path

import pytest

pytest.importorskip('openenv.core', reason="needs the 'openenv' extra (openenv 0.10)")

from mtflow.cli import main  # noqa: E402
from mtflow.declarative.envs.openenv_env import OpenEnvPool  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
APP = 'tests.envs.openenv_app:app'


def _lines(run: Path):
    return {l['uuid']: l for l in map(json.loads, (run / 'trajectories.jsonl').read_text().splitlines())}


def test_replay_against_an_openenv_server_is_identical(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    (tmp_path / 'sched.yaml').write_text(f'name: digits\nmax_turns: 4\nenv:\n  openenv: {{launch: {APP}}}\n')
    lines = [{'uuid': f'p{i}', 'messages': [{'role': 'system', 'content': 'Play.'}], 'seed': 10 + i} for i in range(3)]
    (tmp_path / 'data.jsonl').write_text(''.join(json.dumps(l) + '\n' for l in lines))
    script = ([{'uuid': 'p0', 'content': 'guess 0'}, {'uuid': 'p0', 'content': f'guess {10 % 9 + 1}'}]
              + [{'uuid': 'p1', 'content': 'guess 0'}] * 4 + [{'uuid': 'p2', 'content': f'guess {12 % 9 + 1}'}])
    (tmp_path / 'script.jsonl').write_text(''.join(json.dumps(l) + '\n' for l in script))
    (tmp_path / 'run.yaml').write_text('scheduler: sched.yaml\nbackend: scripted\nmodel: script.jsonl\n'
                                       'dataset: data.jsonl\nmax_turns: 4\n')
    assert main(['run', 'run.yaml', '-q', '--out', 'orig']) == 0
    orig = _lines(tmp_path / 'orig')
    assert [orig[u]['num_turns'] for u in ('p0', 'p1', 'p2')] == [2, 4, 1]
    assert [orig[u]['rollout_infos']['reward'] for u in ('p0', 'p1', 'p2')] == [1.0, 0.0, 1.0]
    assert main(['replay', 'orig', '--out', 'live', '-q']) == 0
    capsys.readouterr()
    assert main(['diff', 'orig', 'live']) == 0, capsys.readouterr().out

    def no_server(self, *args, **kwargs):
        raise AssertionError('--tools recorded opened an OpenEnv session')

    monkeypatch.setattr(OpenEnvPool, '__call__', no_server)
    assert main(['replay', 'orig', '--out', 'rec', '-q', '--tools', 'recorded']) == 0
    capsys.readouterr()
    assert main(['diff', 'orig', 'rec']) == 0, capsys.readouterr().out
    assert {u: l['rollout_infos']['reward'] for u, l in _lines(tmp_path / 'rec').items()} == {
        u: l['rollout_infos']['reward'] for u, l in orig.items()}
