"""The viewers show a run's images at the message they entered with: the HTML page as inline
thumbnails linked to the full-size files (relative to the page), ``trace show --detail`` by name."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest

pytest.importorskip('gymnasium')

from PIL import Image  # noqa: E402

from mtflow.cli import main  # noqa: E402
from mtflow.core.images import IMAGE_TOKEN  # noqa: E402
from mtflow.run.trajectories import read_trajectories  # noqa: E402
from mtflow.viewer.images import THUMB  # noqa: E402
from tests.multimodal.test_run_images import run  # noqa: E402
from tests.viewer.test_trace_html import page_data  # noqa: E402


@pytest.fixture(scope='module')
def grid_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('grid') / 'run'
    assert run(out) == 0
    return out


def test_html_thumbnails_at_their_messages(grid_run, tmp_path):
    page = tmp_path / 'pages' / 'trace.html'
    page.parent.mkdir()
    assert main(['trace', 'html', str(grid_run / 'trace.jsonl'), '--trajectories', str(grid_run / 'trajectories.jsonl'),
                 '-o', str(page)]) == 0
    data = page_data(page.read_text())
    trajectories = read_trajectories(grid_run / 'trajectories.jsonl')
    for uuid, t in trajectories.items():
        tr = data['trajectories'][uuid]
        assert [im['name'] for im in tr['images']] == t.extra['images']
        for k, m in enumerate(t.messages):  # each message lists the images its placeholders show
            assert len(tr['message_images'][k]) == m['content'].count(IMAGE_TOKEN)
        for im in tr['images']:
            assert (page.parent / im['href']).resolve() == (grid_run / im['name']).resolve()
            thumb = Image.open(io.BytesIO(base64.b64decode(im['thumb'].split(',', 1)[1])))
            full = Image.open(grid_run / im['name'])
            assert max(thumb.size) == min(THUMB, max(full.size)) and thumb.size[0] <= full.size[0]
    assert ".msg a.thumb img{" in page.read_text()  # the page's own CSS and script draw them


def test_missing_image_file_is_named_not_fatal(grid_run, tmp_path):
    import shutil
    copy = tmp_path / 'copy'
    shutil.copytree(grid_run, copy)
    victim = sorted((copy / 'images').iterdir())[0]
    victim.unlink()
    page = tmp_path / 'p.html'
    assert main(['trace', 'html', str(copy / 'trace.jsonl'), '--trajectories', str(copy / 'trajectories.jsonl'),
                 '-o', str(page)]) == 0
    images = [im for tr in page_data(page.read_text())['trajectories'].values() for im in tr['images']]
    gone = [im for im in images if im['name'] == f'images/{victim.name}']
    assert gone and all(im['thumb'] is None for im in gone)
    assert all(im['thumb'] for im in images if im not in gone)


def test_trace_show_names_the_images(grid_run, capsys):
    t = read_trajectories(grid_run / 'trajectories.jsonl')['grid-0']
    assert main(['trace', 'show', str(grid_run / 'trace.jsonl'), '--trajectories',
                 str(grid_run / 'trajectories.jsonl'), '--detail', 'grid-0']) == 0
    shown = capsys.readouterr().out
    for k, ref in enumerate(t.extra['images']):
        assert f'image {k}: {ref}' in shown
