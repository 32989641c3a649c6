"""Differential tests with images: a multimodal ms-swift scheduler (its step shows the model a
picture each turn, in ms-swift's layout: ``<image>`` in the text, the image appended to the
request's ``images``) under ms-swift 4.6.0's ``run_multi_turn`` and mtflow's. Outputs, final
requests (their ``images`` included: mtflow checks them and changes nothing), every
``rollout_fn`` call and the images each call saw must be identical."""
from __future__ import annotations

import base64
import copy
import io
from typing import Any, Dict, List

import pytest
from PIL import Image
from swift.rollout.multi_turn import MultiTurnScheduler

from mtflow.core.images import IMAGE_TOKEN
from tests.swift import swift_helpers
from tests.swift.swift_helpers import ScriptedSwift, assert_same, dump, run_both, sreq
from tests.tiny_model import make_tokenizer

TOK = make_tokenizer()


def png_url(color: str) -> str:
    buf = io.BytesIO()
    Image.new('RGB', (3, 3), color).save(buf, format='PNG')
    return 'data:image/png;base64,' + base64.b64encode(buf.getvalue()).decode()


class SeeingScheduler(MultiTurnScheduler):
    """Each turn a user message with one (even turns: two) ``<image>`` and a PIL frame appended to
    ``images``; 'stop' in the completion ends the trajectory."""

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        if 'stop' in response_choice.message.content:
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        n = 2 if current_turn % 2 == 0 else 1
        infer_request.messages.append({'role': 'user', 'content': f'Frame {current_turn}: ' + IMAGE_TOKEN * n})
        for k in range(n):
            infer_request.images.append(Image.new('RGB', (4 + k, 4), (10 * current_turn, 0, 0)))
        return {'infer_request': infer_request, 'rollout_infos': {'frames': len(infer_request.images)}}


def requests() -> List[Any]:
    return [
        sreq('v0', {'role': 'user', 'content': f'{IMAGE_TOKEN}What is this?'}, images=[png_url('red')]),
        sreq('v1', {'role': 'user', 'content': 'No picture yet.'}),
        sreq('v2', {'role': 'user', 'content': f'{IMAGE_TOKEN}{IMAGE_TOKEN}Compare.'},
             images=[png_url('blue'), png_url('green')]),
    ]


SCRIPT = {
    'v0': ['a red square', 'darker', 'stop'],
    'v1': ['waiting', 'stop now'],
    'v2': [('The quick brown fox', 'length')],
}


class SeeingRollout(ScriptedSwift):
    """The scripted rollout_fn, also recording the images each call was sent."""
    images: List[List[Any]] = []

    def __call__(self, requests: List[Any], request_config: Any, record: bool = True) -> List[Any]:
        if record:
            SeeingRollout.images.append([[copy.copy(i) for i in r.images] for r in requests])
        return super().__call__(requests, request_config, record)


@pytest.mark.parametrize('max_turns', [None, 2])
def test_multimodal_scheduler_is_identical(monkeypatch: pytest.MonkeyPatch, max_turns: Any) -> None:
    monkeypatch.setattr(swift_helpers, 'ScriptedSwift', SeeingRollout)
    SeeingRollout.images = []
    res = run_both(lambda: SeeingScheduler(tokenizer=TOK, max_turns=max_turns), requests, SCRIPT, max_turns=max_turns)
    # run_both runs ms-swift's driver, then mtflow's: the first half of the calls is ms-swift's
    calls = SeeingRollout.images
    half = len(calls) // 2
    assert half and calls[:half] == calls[half:]
    assert_same(res)
    final = res['mtflow']['requests']
    assert dump(final) == dump(res['swift']['requests'])
    v0 = final[0]
    expected_images = 1 + (1 + 2 if max_turns is None else 1)
    assert len(v0.images) == expected_images and isinstance(v0.images[0], str)
    assert all(isinstance(i, Image.Image) for i in v0.images[1:])  # ms-swift's PIL images, left as they are
    assert sum(m['content'].count(IMAGE_TOKEN) for m in v0.messages) == len(v0.images)
    assert res['mtflow']['outputs'][0].rollout_infos['frames'] == len(v0.images)
