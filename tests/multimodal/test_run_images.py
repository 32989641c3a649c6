"""The run directory with images (configs/grid_game.yaml: the grid game's frames, replayed
moves): each image stored once under its content's hash, named by the trajectory lines and the
trace, never inline; --resume after a crash reuses the stored files; --overwrite --delete-old
removes them."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip('gymnasium')

from mtflow.cli import main  # noqa: E402
from mtflow.core.images import IMAGE_TOKEN  # noqa: E402

CONFIG = str(Path(__file__).resolve().parents[2] / 'configs' / 'grid_game.yaml')


def lines(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(out: Path, *extra: str) -> int:
    return main(['run', CONFIG, '-q', '--out', str(out), *extra])


def check_images(out: Path) -> dict:
    """Every line's images exist, match their placeholders, and each file is its content's hash."""
    trajectories = {t['uuid']: t for t in lines(out / 'trajectories.jsonl')}
    files = sorted((out / 'images').iterdir())
    for f in files:
        assert f.name == hashlib.sha256(f.read_bytes()).hexdigest() + '.png'
    named = set()
    for t in trajectories.values():
        placeholders = sum(m['content'].count(IMAGE_TOKEN) for m in t['messages'])
        assert placeholders == len(t['images']) >= 1, t['uuid']
        for ref in t['images']:
            assert (out / ref).is_file()
            named.add(ref)
    assert named == {f'images/{f.name}' for f in files}  # no stray file, each named
    for name in ('trajectories.jsonl', 'trace.jsonl'):
        assert 'base64' not in (out / name).read_text()
    return trajectories


def test_images_are_stored_once_and_named(tmp_path):
    out = tmp_path / 'run'
    assert run(out) == 0
    trajectories = check_images(out)
    assert len(trajectories) == 4
    refs = [r for t in trajectories.values() for r in t['images']]
    assert len(set(refs)) == len(list((out / 'images').iterdir())) < len(refs)  # repeated frames: one file
    # the trace names each image at the turn it entered, by the same hash
    events = lines(out / 'trace.jsonl')
    by_uuid = {}
    for e in events:
        for im in (e.get('extra') or {}).get('images') or ():
            by_uuid.setdefault(e['uuid'], []).append((e['turn'], im['index'], im['sha256']))
    for uuid, t in trajectories.items():
        stepped = sorted(by_uuid.get(uuid, []))
        assert [i for _, i, _ in stepped] == list(range(1, len(t['images'])))  # image 0: the reset frame
        assert [f'images/{s}.png' for _, _, s in stepped] == t['images'][1:]


def test_resume_after_a_crash_reuses_the_stored_images(tmp_path):
    out = tmp_path / 'run'
    assert run(out) == 0
    first = check_images(out)
    stamps = {f.name: f.stat().st_mtime_ns for f in (out / 'images').iterdir()}
    # a crash after the first request was written: the others' lines are gone, their images stay
    keep = (out / 'trajectories.jsonl').read_text().splitlines(keepends=True)[:1]
    (out / 'trajectories.jsonl').write_text(''.join(keep))
    (out / 'summary.json').unlink()
    assert run(out, '--resume') == 0
    again = check_images(out)
    assert {u: (t['messages'], t['images']) for u, t in again.items()} == \
        {u: (t['messages'], t['images']) for u, t in first.items()}
    assert {f.name: f.stat().st_mtime_ns for f in (out / 'images').iterdir()} == stamps  # none rewritten


def test_overwrite_delete_old_removes_the_images(tmp_path):
    out = tmp_path / 'run'
    assert run(out) == 0
    (out / 'images' / 'stale.png').write_bytes(b'x')
    assert run(out, '--overwrite', '--delete-old') == 0
    assert not (out / 'images' / 'stale.png').exists()
    check_images(out)


def test_replay_keeps_the_images_live_and_recorded(tmp_path):
    """``mtflow replay``: the live environment draws the same frames again; ``--tools recorded``
    serves the stored ones; both give the original lines, images included."""
    out = tmp_path / 'run'
    assert run(out) == 0
    first = check_images(out)
    for tools in ('live', 'recorded'):
        again = tmp_path / tools
        assert main(['replay', str(out), '--out', str(again), '--tools', tools, '-q']) == 0
        replayed = check_images(again)
        assert {u: (t['messages'], t['images']) for u, t in replayed.items()} == \
            {u: (t['messages'], t['images']) for u, t in first.items()}


def test_tool_images_through_mtflow_run_and_recorded_replay(tmp_path):
    """A YAML `module:attr` tool returning an image, in a whole `mtflow run`; replayed with
    `--tools recorded` (the stored image, found by the hash the trace names)."""
    (tmp_path / 'sched.yaml').write_text(
        'name: draw\nmax_turns: 3\nobservation: {role: user}\n'
        'tools:\n  - {name: square, impl: "tests.multimodal.fixtures:square"}\n')
    call = '<tool_call>{"name": "square", "arguments": {"color": "%s", "size": 6}}</tool_call>'
    (tmp_path / 'model.jsonl').write_text(''.join(json.dumps(line) + '\n' for line in [
        {'uuid': 'a', 'turn': 1, 'content': call % 'red'}, {'uuid': 'a', 'turn': 2, 'content': 'red it is'},
        {'uuid': 'b', 'turn': 1, 'content': call % 'red'}, {'uuid': 'b', 'turn': 2, 'content': call % 'blue'},
        {'uuid': 'b', 'turn': 3, 'content': 'two squares'}]))
    (tmp_path / 'data.jsonl').write_text('{"uuid": "a", "prompt": "Draw."}\n{"uuid": "b", "prompt": "Draw two."}\n')
    (tmp_path / 'run.yaml').write_text('scheduler: sched.yaml\nbackend: scripted\nmodel: model.jsonl\n'
                                       'dataset: data.jsonl\nmax_turns: 3\n')
    out = tmp_path / 'out'
    assert main(['run', str(tmp_path / 'run.yaml'), '-q', '--out', str(out)]) == 0
    lines_by = check_images(out)
    assert [len(lines_by[u]['images']) for u in 'ab'] == [1, 2]
    assert lines_by['a']['images'][0] == lines_by['b']['images'][0]  # the same red square: one file
    assert len(list((out / 'images').iterdir())) == 2
    again = tmp_path / 'again'
    assert main(['replay', str(out), '--out', str(again), '--tools', 'recorded', '-q']) == 0
    replayed = check_images(again)
    assert {u: (t['messages'], t['images']) for u, t in replayed.items()} == \
        {u: (t['messages'], t['images']) for u, t in lines_by.items()}
