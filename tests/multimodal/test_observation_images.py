"""Images in observations, end to end through the executor: a YAML `module:attr` tool, a
gymnasium env (a frame, and a dict observation with an image), a Python scheduler's step; a
broken or oversized image fails only its own request."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from mtflow import Executor
from mtflow.core.images import IMAGE_TOKEN, ImageLimits, ImageURL, image_bytes
from mtflow.core.scheduler import Scheduler
from mtflow.declarative import load_scheduler
from tests.helpers import out, req

CALL = '<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


def tool_scheduler(**extra):
    tools = [{'name': n, 'impl': f'tests.multimodal.fixtures:{n}'} for n in ('square', 'bare', 'mixed', 'broken')]
    return load_scheduler({'name': 'draw', 'max_turns': 4, 'tools': tools, **extra})


def scripted(plan):
    """rollout_fn answering request uuid's n-th call with plan[uuid][n-1]; records what each call saw."""
    seen = []

    def rollout(requests, request_config):
        outs = []
        for r in requests:
            n = sum(1 for m in r.messages if m['role'] == 'assistant')
            seen.append((r.uuid, n + 1, list(r.images), [m['content'] for m in r.messages]))
            outs.append(out(plan[r.uuid][n]))
        return outs
    rollout.seen = seen
    return rollout


def test_tool_image_at_turn_2_reaches_the_model_at_turn_3():
    plan = {'a': [CALL.format(name='bare', args='{}'), CALL.format(name='square', args='{"color": "red"}'),
                  'a red square, done'],
            'b': [CALL.format(name='mixed', args='{}'), CALL.format(name='bare', args='{"size": 3}'), 'ok']}
    rollout = scripted(plan)
    reqs = [req('a'), req('b')]
    result = Executor(tool_scheduler(), rollout, max_turns=4).run(reqs)
    assert result.failures == [] and result.finish_reasons == ['stop_rule:no_tool_call'] * 2
    a = reqs[0]
    # turn 1 called bare (an array), turn 2 square (a PIL image with text): both reached turn 3
    turn3 = [s for s in rollout.seen if s[0] == 'a' and s[1] == 3][0]
    assert len(turn3[2]) == 2 and all(isinstance(i, ImageURL) for i in turn3[2])
    assert (turn3[2][0].width, turn3[2][1].width) == (4, 8)
    tool_msgs = [m for m in a.messages if m['role'] == 'tool']
    assert tool_msgs[0]['content'].count(IMAGE_TOKEN) == 1 and 'a red square\n<image>' in tool_msgs[1]['content']
    assert np.asarray(Image.open(__import__('io').BytesIO(image_bytes(a.images[1])))).tolist()[0][0] == [255, 0, 0]
    b = reqs[1]
    assert 'before\n<image>\nafter' in b.messages[2]['content'] and len(b.images) == 2
    # the trace names each image: its index in the request, hash and size
    steps = [e for e in result.trace if e.uuid == 'a' and (e.extra or {}).get('images')]
    assert [im['index'] for e in steps for im in e.extra['images']] == [0, 1]
    assert steps[1].extra['images'][0] == {'index': 1, 'sha256': a.images[1].sha256, 'size': [8, 8]}


def test_broken_and_oversized_images_fail_only_their_request():
    plan = {'ok': [CALL.format(name='square', args='{"size": 4}'), 'fine'],
            'bad': [CALL.format(name='broken', args='{}'), 'never'],
            'big': [CALL.format(name='square', args='{"size": 20}'), 'never']}
    reqs = [req('ok'), req('bad'), req('big')]
    result = Executor(tool_scheduler(images={'max_pixels': 100}), scripted(plan), max_turns=4,
                      on_error='return').run(reqs)
    assert result.finish_reasons == ['stop_rule:no_tool_call', 'error', 'error']
    errors = {f.uuid: str(f.error) for f in result.failures}
    assert errors['bad'].startswith("request bad, turn 1, field 'images': call 1 (broken) image 1: cannot decode")
    assert 'request big, turn 1' in errors['big'] and '20x20 = 400 pixels, over max_pixels 100' in errors['big']
    assert len(reqs[0].images) == 1


def test_max_images_per_request():
    plan = {'a': [CALL.format(name='bare', args='{}')] * 3 + ['end']}
    result = Executor(tool_scheduler(images={'max_per_request': 2}), scripted(plan), max_turns=5,
                      on_error='return').run([req('a')])
    assert result.finish_reasons == ['error']
    assert "request a, turn 3, field 'images': 3 images, over max_images 2" in str(result.failures[0].error)


def test_inline_mode_refuses_images():
    plan = {'a': [CALL.format(name='bare', args='{}'), 'x']}
    result = Executor(tool_scheduler(observation={'mode': 'inline'}), scripted(plan), max_turns=3,
                      on_error='return').run([req('a')])
    assert result.finish_reasons == ['error'] and 'observation.mode inline cannot carry' in str(result.failures[0].error)


@pytest.mark.parametrize('as_dict', [False, True])
def test_gymnasium_frame_observations(as_dict):
    pytest.importorskip('gymnasium')
    sched = load_scheduler({'name': 'frames', 'max_turns': 4, 'env': {
        'gym': 'tests.multimodal.fixtures:FrameEnv', 'kwargs': {'as_dict': as_dict}}})
    r = req('g', {'role': 'system', 'content': 'Look.'})
    rollout = scripted({'g': ['left', 'right', 'done']})
    result = Executor(sched, rollout, max_turns=4).run([r])
    assert result.finish_reasons == ['stop_rule:env_done']
    # the reset frame opened the conversation, then one frame per step
    assert len(r.images) == 3 and [im.width for im in r.images] == [6, 6, 6]
    assert len({im.sha256 for im in r.images}) == 3  # each frame is a different picture
    users = [m['content'] for m in r.messages if m['role'] == 'user']
    assert users == (['step 0\n<image>', 'step 1\n<image>', 'step 2\n<image>'] if as_dict else [IMAGE_TOKEN] * 3)
    assert [len(s[2]) for s in rollout.seen] == [1, 2, 3]


class PictureScheduler(Scheduler):
    """A Python scheduler whose step shows the model a picture (a raw PIL image) each turn."""
    image_limits = ImageLimits(max_pixels=64)

    def step(self, infer_request, response_choice, current_turn):
        size = 4 if infer_request.uuid != 'huge' else 9
        infer_request.messages.append({'role': 'user', 'content': f'{IMAGE_TOKEN}Turn {current_turn}: what now?'})
        infer_request.images.append(Image.new('RGB', (size, size)))
        return {'infer_request': infer_request}


def test_python_scheduler_step_images_are_checked_not_changed():
    reqs = [req('p'), req('huge')]
    result = Executor(PictureScheduler(max_turns=3), lambda rs, rc: [out('x') for _ in rs], max_turns=3,
                      on_error='return').run(reqs)
    assert result.finish_reasons == ['max_turns', 'error']
    assert len(reqs[0].images) == 2 and all(isinstance(i, Image.Image) for i in reqs[0].images)
    assert "request huge, turn 1, field 'images[0]': the image is 9x9 = 81 pixels, over max_pixels 64" in str(
        result.failures[0].error)


def test_python_scheduler_placeholder_mismatch_fails_the_request():
    class Forgetful(PictureScheduler):
        def step(self, infer_request, response_choice, current_turn):
            infer_request.images.append(Image.new('RGB', (2, 2)))
            return {'infer_request': infer_request}
    result = Executor(Forgetful(max_turns=2), lambda rs, rc: [out('x') for _ in rs], max_turns=2,
                      on_error='return').run([req('f')])
    assert result.finish_reasons == ['error']
    assert '0 <image> placeholder(s) for 1 image(s)' in str(result.failures[0].error)
