"""Images through the Ray fan-out: each actor stores the images its steps add in a folder of its
own (its requests hold paths), ships a finished request's images to the driver, which stores
them as a local run does; ``mtflow run configs/grid_game.yaml --ray 2`` gives the local run's
lines, image names and files."""
from __future__ import annotations

import hashlib
import io
import json
import types
from pathlib import Path

import pytest
from PIL import Image

from mtflow.core.images import IMAGE_TOKEN, ImageRef
from mtflow.core.scheduler import Scheduler
from mtflow.distributed import RayRecord, ShardWorker, WorkerSpec
from mtflow.distributed.ray_fanout import _FanOut
from mtflow.run.files import RunDirError
from mtflow.run.images import ImageStore, ShippedName
from tests.helpers import out, req

ROOT = Path(__file__).resolve().parents[2]


class Frames(Scheduler):
    """Each step shows a picture; notes whether the earlier ones are held as stored references."""

    def step(self, infer_request, response_choice, current_turn):
        held = [isinstance(im, ImageRef) for im in infer_request.images]
        infer_request.messages.append({'role': 'user', 'content': f'{IMAGE_TOKEN}frame {current_turn}'})
        infer_request.images = list(infer_request.images) + [Image.new('RGB', (3, 3), (current_turn, 0, 0))]
        return {'infer_request': infer_request, 'rollout_infos': {f'held_{current_turn}': held}}


def backend():
    return lambda requests, config: [out('ok') for _ in requests]


def test_a_shard_ships_each_requests_images_and_cleans_up():
    worker = ShardWorker(WorkerSpec(backend, lambda tok: Frames(max_turns=3), max_turns=3), slot=1)
    items = list(worker.run_shard([(0, req('a')), (1, req('b'))]))
    records = [r for kind, group in items if kind == 'finished' for r in group]
    assert [r['uuid'] for r in records] == ['a', 'b']
    for r in records:
        assert r['trajectory']['rollout_infos']['held_2'] == [True]  # the turn-1 frame: a path, not pixels
    first, second = (r['images'] for r in records)
    assert [Image.open(io.BytesIO(b)).getpixel((0, 0)) for b in first] == [(1, 0, 0), (2, 0, 0)]
    # b shows the same two frames: the actor shipped them with a, so it sends their names
    assert [type(i) for i in second] == [ShippedName, ShippedName]
    assert [f'{hashlib.sha256(b).hexdigest()}.png' for b in first] == list(second)
    folder = worker._images.dir.parent
    assert len(list(worker._images.dir.iterdir())) == 2  # the same two frames for both requests
    worker.close()
    assert not folder.exists()


def test_the_driver_stores_shipped_bytes_and_checks_shipped_names(tmp_path):
    store = ImageStore(tmp_path)
    png = io.BytesIO()
    Image.new('RGB', (2, 2), (9, 9, 9)).save(png, format='PNG')
    name = f'{hashlib.sha256(png.getvalue()).hexdigest()}.png'
    assert store.put_shipped([png.getvalue()], 'ray actor 0') == [f'images/{name}']
    assert store.put_shipped([ShippedName(name)], 'ray actor 0') == [f'images/{name}']
    with pytest.raises(RunDirError, match=r'ray actor 1 named image 0+\.png as shipped before, but .* has no such file'):
        store.put_shipped([ShippedName('0' * 64 + '.png')], 'ray actor 1')


def test_a_dropped_duplicate_still_hands_over_its_images():
    """A duplicate record writes no line, but its actor counts its images shipped from then on."""
    written, kept = [], []
    fan_out = types.SimpleNamespace(done={'a'}, result=types.SimpleNamespace(duplicates_dropped=0),
                                    sink=written.append, on_duplicate=kept.append)
    rec = RayRecord(0, 'a', 'stop', {}, [], 0, 2, None, [b'png'])
    _FanOut.deliver(fan_out, rec)
    assert written == [] and kept == [rec] and fan_out.result.duplicates_dropped == 1


_KILLED_ACTOR = """
import sys
from PIL import Image
from mtflow.distributed import RayRecord, ShardWorker, WorkerSpec
from mtflow.distributed.ray_fanout import _FanOut
from mtflow.run.files import RunDirError
from mtflow.run.images import ImageStore, ShippedName
worker = ShardWorker(WorkerSpec(lambda: None, lambda tok: None), slot=3)
worker.store_image(Image.new('RGB', (2, 2)))
print(worker._images.dir.parent, flush=True)
sys.stdin.read()  # until killed
"""


def test_a_killed_actors_image_folder_is_swept_by_the_next_actor(tmp_path, monkeypatch):
    """A killed actor never reaches close(): its folder stays until an actor of a later run on the
    node sweeps the folders whose actor is gone (and leaves a live actor's alone)."""
    import subprocess
    import sys
    import tempfile

    env = dict(__import__('os').environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, '-c', _KILLED_ACTOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env=env, text=True)
    try:
        orphan = Path(child.stdout.readline().strip())
        assert orphan.parent == tmp_path and orphan.is_dir()
    finally:
        child.kill()
        child.wait()
    unrelated = tmp_path / 'mtflow-ray-images-notours'
    unrelated.mkdir()
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))
    worker = ShardWorker(WorkerSpec(backend, lambda tok: Frames(max_turns=1)), slot=1)
    mine = Path(worker.store_image(Image.new('RGB', (2, 2)))).parent.parent
    assert not orphan.exists(), 'the killed actor\'s folder is removed'
    assert mine.is_dir() and unrelated.is_dir(), 'a live actor\'s folder and a foreign one stay'
    worker.close()
    assert not mine.exists()


@pytest.mark.slow
def test_mtflow_run_ray_stores_the_images_like_a_local_run(tmp_path):
    pytest.importorskip('ray')
    pytest.importorskip('gymnasium')
    from mtflow.cli import main

    config = str(ROOT / 'configs' / 'grid_game.yaml')
    local, fanned = tmp_path / 'local', tmp_path / 'ray'
    assert main(['run', config, '-q', '--out', str(local)]) == 0
    assert main(['run', config, '-q', '--out', str(fanned), '--ray', '2']) == 0

    def lines(d):
        return {t['uuid']: {k: v for k, v in t.items() if k != 'rank'}
                for t in map(json.loads, (d / 'trajectories.jsonl').read_text().splitlines())}

    want, got = lines(local), lines(fanned)
    assert got == want and all(t['images'] for t in got.values())
    files = sorted(f.name for f in (fanned / 'images').iterdir())
    assert files == sorted(f.name for f in (local / 'images').iterdir())
    assert {f'images/{f}' for f in files} == {ref for t in got.values() for ref in t['images']}
    for f in (fanned / 'images').iterdir():
        assert f.name == hashlib.sha256(f.read_bytes()).hexdigest() + '.png'
    for t in got.values():
        assert sum(m['content'].count(IMAGE_TOKEN) for m in t['messages']) == len(t['images'])
    assert 'base64' not in (fanned / 'trajectories.jsonl').read_text() + (fanned / 'trace.jsonl').read_text()
