"""Images the YAML names: a tool's text result read by ``observation.images_from`` (a pattern
for data URLs and files inside ``dir``, or an ``impl`` function), a tip's ``images`` and
``images_impl``, and an OpenEnv server's ``image_fields`` (a real server, launched). Each
reaches the model at the next turn; a bad one fails only its request."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mtflow import Executor
from mtflow.core.images import IMAGE_TOKEN, Observation, image_bytes
from mtflow.declarative import ConfigError, load_scheduler
from tests.helpers import out, req
from tests.multimodal.test_observation_images import CALL, scripted

ROOT = Path(__file__).resolve().parents[2]
MARKDOWN = r'!\[[^\]]*\]\(([^)\s]+)\)'


def png(color, size=(4, 4)) -> bytes:
    buf = io.BytesIO()
    Image.new('RGB', size, color).save(buf, format='PNG')
    return buf.getvalue()


def data_url(color, size=(4, 4)) -> str:
    return 'data:image/png;base64,' + base64.b64encode(png(color, size)).decode()


def pixel(url) -> list:
    return list(Image.open(io.BytesIO(image_bytes(url))).convert('RGB').getpixel((0, 0)))


def plot(name: str) -> str:
    """A tool that 'saves a plot' and prints where, as markdown (the file is made by the test)."""
    return f'saved the {name} plot: ![{name}]({name}.png) and more text'


def inline_url(color: str) -> str:
    """A tool that prints a data URL."""
    return f'here: {data_url(color)}'


def caption(name, result, index):
    """images_from.impl: a picture for the calculator's answer (its value as the red channel)."""
    if not result.isdigit():
        return None
    return Observation(f'{result} drawn:', [np.full((2, 2, 3), (int(result), 0, 0), dtype=np.uint8)])


def calc(x: int) -> str:
    return str(x)


def tools(*names):
    return [{'name': n, 'impl': f'tests.multimodal.test_yaml_images:{n}'} for n in names]


def test_pattern_reads_files_inside_dir_and_data_urls(tmp_path):
    (tmp_path / 'loss.png').write_bytes(png('blue'))
    sched = load_scheduler({'name': 'plots', 'max_turns': 4, 'tools': tools('plot', 'inline_url'),
                            'observation': {'images_from': {'pattern': f'{MARKDOWN}|data:image/[^\\s]+',
                                                            'dir': str(tmp_path)}}})
    plan = {'a': [CALL.format(name='plot', args='{"name": "loss"}'),
                  CALL.format(name='inline_url', args='{"color": "lime"}'), 'seen'],
            'b': [CALL.format(name='plot', args='{"name": "../outside"}'), 'never'],
            'c': [CALL.format(name='plot', args='{"name": "link"}'), 'never']}
    (tmp_path.parent / 'outside.png').write_bytes(png('red'))
    (tmp_path / 'link.png').symlink_to(tmp_path.parent / 'outside.png')
    rollout = scripted(plan)
    reqs = [req('a'), req('b'), req('c')]
    result = Executor(sched, rollout, max_turns=4, on_error='return').run(reqs)
    assert result.finish_reasons == ['stop_rule:no_tool_call', 'error', 'error']
    assert 'outside images_from.dir' in str(result.failures[1].error)  # a symlink out of dir too
    a = reqs[0]
    tool_msgs = [m['content'] for m in a.messages if m['role'] == 'tool']
    assert tool_msgs == [f'saved the loss plot: {IMAGE_TOKEN} and more text', f'here: {IMAGE_TOKEN}']
    # the turn-2 image reached the model at turn 3, after the turn-1 one
    turn3 = [s for s in rollout.seen if s[0] == 'a' and s[1] == 3][0]
    assert [pixel(u) for u in turn3[2]] == [[0, 0, 255], [0, 255, 0]]
    # a path outside dir fails only its request, naming why
    error = str(result.failures[0].error)
    assert "request b, turn 1, field 'observation.images_from'" in error and 'outside images_from.dir' in error
    # the trace names the images; the recorded tool text holds the placeholder, not base64
    step = [e for e in result.trace if e.uuid == 'a' and (e.extra or {}).get('images')][1]
    assert step.extra['images'][0]['sha256'] == a.images[1].sha256
    assert 'base64' not in step.extra['tool_io'][0]['output']


def test_pattern_without_dir_reads_no_files(tmp_path):
    (tmp_path / 'x.png').write_bytes(png('blue'))
    sched = load_scheduler({'name': 'plots', 'max_turns': 3, 'tools': tools('plot'),
                            'observation': {'images_from': {'pattern': MARKDOWN}}})
    result = Executor(sched, scripted({'a': [CALL.format(name='plot', args='{"name": "x"}'), 'x']}), max_turns=3,
                      on_error='return').run([req('a')])
    assert result.finish_reasons == ['error'] and 'give images_from.dir' in str(result.failures[0].error)


def test_impl_turns_a_result_into_images():
    sched = load_scheduler({'name': 'calc', 'max_turns': 4, 'tools': tools('calc'), 'observation': {
        'images_from': {'impl': 'tests.multimodal.test_yaml_images:caption'}}})
    rollout = scripted({'a': [CALL.format(name='calc', args='{"x": 7}'), CALL.format(name='calc', args='{"x": 9}'),
                              'ok']})
    r = req('a')
    result = Executor(sched, rollout, max_turns=4).run([r])
    assert result.failures == []
    assert [m['content'] for m in r.messages if m['role'] == 'tool'] == [f'7 drawn:\n{IMAGE_TOKEN}',
                                                                          f'9 drawn:\n{IMAGE_TOKEN}']
    assert [s[2] and [pixel(u)[0] for u in s[2]] for s in rollout.seen] == [[], [7], [7, 9]]


def test_inline_mode_refuses_images_from_when_validated():
    with pytest.raises(ConfigError, match='images_from needs mode message'):
        load_scheduler({'tools': tools('calc'), 'observation': {'mode': 'inline', 'images_from': {
            'pattern': MARKDOWN}}})
    with pytest.raises(ConfigError, match='give either pattern or impl'):
        load_scheduler({'tools': tools('calc'), 'observation': {'images_from': {'dir': '.'}}})


def frame_for(request, choice, turn):
    """tips[].images_impl: a frame whose red channel is the turn."""
    return Image.new('RGB', (3, 3), (turn, 0, 0))


def test_tip_shows_its_images_at_the_next_turn(tmp_path):
    (tmp_path / 'hint.png').write_bytes(png('yellow'))
    yaml_path = tmp_path / 'tips.yaml'
    yaml_path.write_text('name: tips\nmax_turns: 4\ntips:\n'
                         '  - {name: look, when: always, placement: user, text: "Look again.", max_times: 2,\n'
                         '     images: [hint.png], images_impl: "tests.multimodal.test_yaml_images:frame_for"}\n')
    sched = load_scheduler(str(yaml_path))
    rollout = scripted({'a': ['one', 'two', 'three']})
    r = req('a')
    result = Executor(sched, rollout, max_turns=3).run([r])
    assert result.failures == [] and result.finish_reasons == ['stop_rule:tips_exhausted']
    users = [m['content'] for m in r.messages if m['role'] == 'user'][1:]
    assert users == [f'Look again.\n{IMAGE_TOKEN}\n{IMAGE_TOKEN}'] * 2
    turn3 = [s for s in rollout.seen if s[1] == 3][0]
    assert [pixel(u) for u in turn3[2]] == [[255, 255, 0], [1, 0, 0], [255, 255, 0], [2, 0, 0]]
    # the file is one picture: both tips' yellow image has the same hash
    assert r.images[0].sha256 == r.images[2].sha256


def test_tip_images_are_checked_when_the_file_is_validated(tmp_path):
    (tmp_path / 'bad.png').write_bytes(b'\x89PNG\r\n\x1a\n' + b'\0' * 8)
    for images, placement, message in ((['missing.png'], 'user', 'cannot read the image file'),
                                       (['bad.png'], 'user', 'cannot decode the image'),
                                       ([data_url('red')], 'inline', 'images need placement user')):
        path = tmp_path / 'tips.yaml'
        path.write_text(f'tips:\n  - {{when: always, placement: {placement}, text: t, images: {images}}}\n')
        with pytest.raises(ConfigError, match=message) as info:
            load_scheduler(str(path))
        assert info.value.problems[0].line == 2


# ---- OpenEnv ------------------------------------------------------------------------------------

def test_openenv_image_fields_reach_the_model_at_the_next_turn():
    pytest.importorskip('openenv.core', reason="needs the 'openenv' extra (openenv 0.10)")
    cfg = {'name': 'strip', 'max_turns': 5, 'env': {'openenv': {
        'launch': 'tests.envs.openenv_frames_app:app', 'image_fields': ['frame', 'snapshot', 'screen']}}}
    sched = load_scheduler(cfg, base_dir=str(ROOT))
    try:
        rollout = scripted({'a': ['right', 'right', 'right'], 'b': ['draw broken', 'never']})
        reqs = [req('a', {'role': 'system', 'content': 'Play.'}), req('b', {'role': 'system', 'content': 'Play.'})]
        result = Executor(sched, rollout, max_turns=5, on_error='return').run(reqs)
    finally:
        sched.close()
    assert result.finish_reasons == ['stop_rule:env_done', 'error']
    a = reqs[0]
    # the opening observation (3 images) and two steps' (3 each): the text leaves the image fields out
    assert [m['content'] for m in a.messages if m['role'] == 'user'] == [
        f'Move the red pixel to the right end.\n{IMAGE_TOKEN}\n{IMAGE_TOKEN}\n{IMAGE_TOKEN}',
        f'At 1.\n{IMAGE_TOKEN}\n{IMAGE_TOKEN}\n{IMAGE_TOKEN}', f'At 2.\n{IMAGE_TOKEN}\n{IMAGE_TOKEN}\n{IMAGE_TOKEN}']
    seen = {s[1]: s[2] for s in rollout.seen if s[0] == 'a'}
    assert [len(seen[t]) for t in (1, 2, 3)] == [3, 6, 9]
    # the step-2 observation reached the model at turn 3: the three forms are the same picture
    step2 = seen[3][6:]
    assert len({u.sha256 for u in step2}) == 1 and (step2[0].width, step2[0].height) == (4, 1)
    strip = np.asarray(Image.open(io.BytesIO(image_bytes(step2[0]))).convert('RGB'))
    assert strip[0, 2].tolist() == [255, 0, 0] and strip[0, 0].tolist() == [255, 255, 255]
    error = str(result.failures[0].error)
    assert "request b, turn 1, field 'images'" in error and 'cannot decode' in error
