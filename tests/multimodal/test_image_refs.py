"""Images stored as their step adds them (``Executor(image_store=...)``, what ``mtflow run``
gives): from then on the request holds an :class:`ImageRef` (the stored file's path, size and
hash), every backend conversion reads the file, and a broken image is left for the executor's
check, which fails only its request."""
from __future__ import annotations

import copy
import io
import json
import pickle
from pathlib import Path

from PIL import Image

from mtflow import Executor
from mtflow.backends.images import openai_messages
from mtflow.core.images import IMAGE_TOKEN, ImageRef, image_bytes, to_image_url
from mtflow.core.scheduler import Scheduler
from mtflow.run.images import ImageStore
from tests.helpers import out, req


class Painter(Scheduler):
    """Each step shows one PIL image; request 'bad' shows bytes that are no image at turn 2."""

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': f'{IMAGE_TOKEN}turn {current_turn}'})
        image = Image.new('RGB', (5, 5), (current_turn * 50, 0, 0))
        if infer_request.uuid == 'bad' and current_turn == 2:
            image = b'\x89PNG\r\n\x1a\n' + b'\0' * 10
        infer_request.images = list(infer_request.images) + [image]
        return {'infer_request': infer_request}


def test_requests_hold_references_to_stored_files(tmp_path):
    store = ImageStore(tmp_path, fsync=False)
    seen = []

    def rollout(requests, request_config):
        for r in requests:
            seen.append((r.uuid, list(r.images)))
            if r.images:  # what an OpenAI-compatible backend sends: the file's pixels as a data URL
                parts = openai_messages(r, r.messages)[-1]['content']
                assert parts[0]['image_url']['url'] == str(to_image_url(r.images[-1]))
        return [out('x') for _ in requests]

    reqs = [req('a'), req('bad')]
    result = Executor(Painter(max_turns=3), rollout, max_turns=3, on_error='return',
                      image_store=store.put_ref).run(reqs)
    assert result.finish_reasons == ['max_turns', 'error']
    assert "request bad, turn 2, field 'images[1]'" in str(result.failures[0].error)
    a_images = [imgs for uuid, imgs in seen if uuid == 'a']
    assert [len(i) for i in a_images] == [0, 1, 2]
    for ref in a_images[-1]:
        assert isinstance(ref, ImageRef) and Path(ref).parent == (tmp_path / 'images').resolve()
        assert Path(ref).read_bytes() == image_bytes(to_image_url(ref))
    assert [Image.open(io.BytesIO(Path(r).read_bytes())).getpixel((0, 0))[0] for r in a_images[-1]] == [50, 100]
    # the broken image was never written; the good ones once each (a's turn-1 picture is bad's too)
    assert store.written == 2 and len(list((tmp_path / 'images').iterdir())) == 2
    # naming a reference for the trajectory line reads nothing
    assert store.put(a_images[-1][0]) == f'images/{Path(a_images[-1][0]).name}'


def test_a_reference_is_a_path_and_keeps_its_facts(tmp_path):
    store = ImageStore(tmp_path, fsync=False)
    ref = store.put_ref(Image.new('RGB', (7, 3), 'blue'))
    assert (ref.width, ref.height, ref.mime) == (7, 3, 'image/png') and Path(ref).is_file()
    for copied in (pickle.loads(pickle.dumps(ref)), copy.deepcopy(ref)):
        assert isinstance(copied, ImageRef) and copied == ref and copied.sha256 == ref.sha256
    assert json.loads(json.dumps([ref])) == [str(ref)]  # a plain path in JSON
    assert to_image_url(str(ref)).sha256 == ref.sha256  # a reader that got the plain str still reads it


class Noting(Scheduler):
    """Under ``mtflow run``: each step notes what the request holds of the earlier steps' images
    (their type, and whether the file is already there), then adds one more."""

    def step(self, infer_request, response_choice, current_turn):
        held = [[type(im).__name__, Path(im).is_file() if isinstance(im, ImageRef) else None]
                for im in infer_request.images]
        infer_request.messages.append({'role': 'user', 'content': f'{IMAGE_TOKEN}turn {current_turn}'})
        infer_request.images = list(infer_request.images) + [Image.new('RGB', (4, 4), (current_turn, 9, 9))]
        return {'infer_request': infer_request, 'rollout_infos': {f'held_{current_turn}': held}}


def test_mtflow_run_holds_references_from_the_step_on(tmp_path):
    from mtflow.cli import main

    (tmp_path / 'data.jsonl').write_text('{"uuid": "a", "prompt": "Look."}\n{"uuid": "b", "prompt": "Look."}\n')
    (tmp_path / 'model.jsonl').write_text(json.dumps({'content': 'ok'}) + '\n')
    (tmp_path / 'run.yaml').write_text(f'scheduler: {Path(__file__).resolve()}:Noting\nbackend: scripted\n'
                                       'model: model.jsonl\nbackend_options: {cycle: true}\ndataset: data.jsonl\n'
                                       'max_turns: 3\n')
    out_dir = tmp_path / 'out'
    assert main(['run', str(tmp_path / 'run.yaml'), '-q', '--out', str(out_dir)]) == 0
    lines = [json.loads(x) for x in (out_dir / 'trajectories.jsonl').read_text().splitlines()]
    for line in lines:
        infos = line['rollout_infos']
        assert infos['held_2'] == [['ImageRef', True]] and infos['held_1'] == []
        assert len(line['images']) == 2 and all((out_dir / ref).is_file() for ref in line['images'])
    assert len(list((out_dir / 'images').iterdir())) == 2  # the same two pictures for both requests
