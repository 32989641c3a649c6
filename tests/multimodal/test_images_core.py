"""mtflow.core.images: every accepted form normalised to one data URL, limits, both layouts."""
from __future__ import annotations

import base64
import hashlib
import io

import numpy as np
import pytest
from PIL import Image

from mtflow.core.errors import SchedulerResultError
from mtflow.core.images import (IMAGE_TOKEN, ImageError, ImageLimits, ImageURL, Observation, check_request_images,
                                env_observation, from_content_parts, image_bytes, observation_parts, to_content_parts,
                                to_image_url)
from mtflow.core.protocol import RolloutInferRequest


def png(w: int = 4, h: int = 3, color: str = 'blue') -> bytes:
    buf = io.BytesIO()
    Image.new('RGB', (w, h), color).save(buf, format='PNG')
    return buf.getvalue()


def test_every_form_becomes_the_same_data_url(tmp_path):
    data = png()
    path = tmp_path / 'a.png'
    path.write_bytes(data)
    url = 'data:image/png;base64,' + base64.b64encode(data).decode()
    forms = [data, bytearray(data), path, str(path), url, {'bytes': data, 'path': None}, {'path': str(path)}]
    outs = [to_image_url(f) for f in forms]
    assert all(isinstance(o, ImageURL) for o in outs)
    assert {str(o) for o in outs} == {url}  # encoded input keeps its bytes: the same hash
    assert outs[0].sha256 == hashlib.sha256(data).hexdigest() and (outs[0].width, outs[0].height) == (4, 3)
    # pixels are encoded as PNG, losslessly
    arr = np.arange(4 * 3 * 3, dtype=np.uint8).reshape(3, 4, 3)
    from_arr, from_pil = to_image_url(arr), to_image_url(Image.fromarray(arr))
    assert str(from_arr) == str(from_pil) and from_arr.mime == 'image/png'
    back = np.asarray(Image.open(io.BytesIO(image_bytes(from_arr))))
    assert (back == arr).all()
    # float arrays in [0, 1] and grey frames
    assert to_image_url(np.ones((2, 2), dtype=np.float32)).width == 2
    jpeg = io.BytesIO()
    Image.new('RGB', (5, 5)).save(jpeg, format='JPEG')
    assert to_image_url(jpeg.getvalue()).mime == 'image/jpeg'


@pytest.mark.parametrize('value, message', [
    (b'\x89PNG\r\n\x1a\n' + b'\0' * 10, 'cannot decode'),
    ('data:image/png;base64,@@@', 'not valid base64'),
    ('/no/such/file.png', 'cannot read the image file'),
    ('https://example.com/a.png', 'remote images are not fetched'),
    (np.zeros((2, 2, 5), dtype=np.uint8), 'HxW'),
    (np.full((2, 2), np.nan), 'NaN'),
    (3.5, 'cannot read an image from float'),
])
def test_broken_images_say_why(value, message):
    with pytest.raises(ImageError, match=message):
        to_image_url(value)


def test_max_pixels():
    with pytest.raises(ImageError, match=r'5x4 = 20 pixels, over max_pixels 19'):
        to_image_url(png(5, 4), ImageLimits(max_pixels=19))
    assert to_image_url(png(5, 4), ImageLimits(max_pixels=20)).width == 5
    with pytest.raises(ImageError, match='over max_pixels'):
        to_image_url(Image.new('RGB', (10, 10)), ImageLimits(max_pixels=99))


def test_check_request_images_names_request_turn_and_image():
    good = to_image_url(png())
    r = RolloutInferRequest(messages=[{'role': 'user', 'content': f'{IMAGE_TOKEN} and {IMAGE_TOKEN}'}],
                            images=[good, Image.new('RGB', (2, 2))])
    check_request_images(r, 'u1', 2)
    assert not isinstance(r.images[1], ImageURL)  # checked, not changed (ms-swift's own layout)
    with pytest.raises(SchedulerResultError, match=r"request u1, turn 2, field 'images'.*over max_images 1"):
        check_request_images(r, 'u1', 2, ImageLimits(max_images=1))
    with pytest.raises(SchedulerResultError, match=r"field 'images\[0\]'.*over max_pixels"):
        check_request_images(r, 'u1', 2, ImageLimits(max_pixels=5))
    r.images.append(good)
    with pytest.raises(SchedulerResultError, match=r'2 <image> placeholder\(s\) for 3 image'):
        check_request_images(r, 'u1', 3)
    r.images[2] = '/missing.png'
    r.messages[0]['content'] += IMAGE_TOKEN
    with pytest.raises(SchedulerResultError, match=r"field 'images\[2\]'.*cannot read the image file"):
        check_request_images(r, 'u1', 3)


def test_observation_parts():
    img = Image.new('RGB', (2, 2))
    assert observation_parts('plain') == ('plain', [])
    assert observation_parts({'a': 1}) == ({'a': 1}, [])
    assert observation_parts(img) == (IMAGE_TOKEN, [img])
    assert observation_parts(['x', img, 'y']) == (f'x\n{IMAGE_TOKEN}\ny', [img])
    assert observation_parts(Observation('see', [img, img])) == (f'see\n{IMAGE_TOKEN}\n{IMAGE_TOKEN}', [img, img])
    assert observation_parts(Observation(f'a {IMAGE_TOKEN} b', [img])) == (f'a {IMAGE_TOKEN} b', [img])
    assert observation_parts(Observation('see', [img]), place=False) == ('see', [img])
    with pytest.raises(ImageError, match='2 <image> placeholders for 1'):
        observation_parts(Observation(IMAGE_TOKEN * 2, [img]))


def test_env_observation():
    frame = np.zeros((2, 2, 3), dtype=np.uint8)
    assert env_observation('text') == 'text' and env_observation(7) == '7' and env_observation(None) is None
    assert env_observation(frame).images == [frame]
    obs = env_observation({'frame': frame, 'score': 3})
    assert obs.text == '{"score": 3}' and obs.images == [frame]
    assert env_observation({'frame': frame, 'text': 'look'}).text == 'look'


def test_both_layouts_round_trip():
    a, b = to_image_url(png(color='red')), to_image_url(png(color='green'))
    msgs = [{'role': 'system', 'content': 'hi'}, {'role': 'user', 'content': f'{IMAGE_TOKEN}what?'},
            {'role': 'tool', 'content': f'x{IMAGE_TOKEN}y', 'name': 'draw'}]
    parts = to_content_parts(msgs, [a, b])
    assert parts[0] == msgs[0]
    assert parts[1]['content'] == [{'type': 'image_url', 'image_url': {'url': str(a)}}, {'type': 'text', 'text': 'what?'}]
    assert parts[2]['name'] == 'draw' and [p['type'] for p in parts[2]['content']] == ['text', 'image_url', 'text']
    assert msgs[1]['content'] == f'{IMAGE_TOKEN}what?'  # the input is not changed
    back, images = from_content_parts(parts)
    assert back == msgs and images == [str(a), str(b)]
    with pytest.raises(ImageError, match='more <image> placeholders than images'):
        to_content_parts(msgs, [a])
    with pytest.raises(ImageError, match=r'3 image\(s\) for 2'):
        to_content_parts(msgs, [a, b, a])


def test_image_url_survives_pickle_and_copy():
    import copy
    import pickle
    u = to_image_url(png())
    for v in (pickle.loads(pickle.dumps(u)), copy.deepcopy(u), copy.copy(u)):
        assert isinstance(v, ImageURL) and v == u and v.sha256 == u.sha256
