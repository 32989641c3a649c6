"""An image a tool returns at turn 2 reaches the model at turn 3, through each backend in the
layout it reads: the OpenAI-compatible backend's request body (a real HTTP server on 127.0.0.1),
vLLM's chat (``image_url`` parts, through the ``vllm.LLM`` stand-in), ms-swift's ``InferRequest``
(``images``, decoded by ms-swift's own ``load_image``). Token prompts and the HF backend without
a vision processor fail only the requests with images, naming each."""
from __future__ import annotations

import re
from typing import Any, List

import pytest

pytest.importorskip('torch')
pytest.importorskip('transformers')

from mtflow import Executor, RequestConfig, RolloutInferRequest  # noqa: E402
from mtflow.backends import BackendError  # noqa: E402
from mtflow.backends.hf import HFBackend  # noqa: E402
from mtflow.backends.openai_server import OpenAIBackend  # noqa: E402
from mtflow.backends.vllm_engine import VLLMBackend  # noqa: E402
from mtflow.core.images import IMAGE_TOKEN, image_bytes  # noqa: E402
from mtflow.declarative import load_scheduler  # noqa: E402
from tests.backends.chat_server import ChatServer  # noqa: E402
from tests.backends.fake_vllm import FakeLLM, SamplingParams  # noqa: E402
from tests.helpers import req  # noqa: E402
from tests.tiny_model import make_model, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.hf
CONFIG = RequestConfig(temperature=0, max_tokens=4)


class Scripted:
    """Wraps a backend: turn 2's completion is replaced by a call of the `square` tool (the tiny
    model would never write one), everything else is the backend's own generation."""

    def __init__(self, backend: Any) -> None:
        self.backend, self.turn = backend, 0

    def __call__(self, requests: List[Any], request_config: Any) -> List[Any]:
        self.turn += 1
        outs = self.backend(requests, request_config)
        if self.turn == 2:
            for o in outs:
                o.response.choices[0].message.content = ('<tool_call>{"name": "square", "arguments": '
                                                         '{"color": "lime", "size": 5}}</tool_call>')
                o.response.choices[0].token_ids = None
                o.response.choices[0].finish_reason = 'stop'
        return outs


def scheduler() -> Any:
    return load_scheduler({'name': 'see', 'max_turns': 3, 'observation': {'role': 'user'},
                           'stop': {'on_length': False},
                           'tools': [{'name': 'square', 'impl': 'tests.multimodal.fixtures:square'}],
                           'tips': [{'name': 'go', 'when': 'no_tool_call', 'text': 'Go on.', 'max_times': 1,
                                     'placement': 'user'}]})


@pytest.fixture(scope='module')
def tiny():
    tok = make_tokenizer()
    return make_model(tok, seed=5), tok


def _run(rollout: Any) -> Any:
    r = req('pic')
    result = Executor(scheduler(), Scripted(rollout), max_turns=3, request_config=CONFIG).run([r])
    assert result.failures == [], result.failures
    assert len(r.images) == 1 and r.images[0].width == 5
    return r


def test_openai_body_carries_the_image_at_turn_3(tiny):
    with ChatServer(HFBackend(*tiny)) as server:
        with OpenAIBackend(base_url=server.base_url, backoff=0.01) as client:
            r = _run(client)
        bodies = server.bodies
    assert len(bodies) == 3
    assert not any(isinstance(m['content'], list) for b in bodies[:2] for m in b['messages'])
    last = bodies[2]['messages'][-1]
    assert last['role'] == 'user'
    parts = last['content']
    assert parts[0] == {'type': 'text', 'text': 'a lime square\n'} and parts[1]['type'] == 'image_url'
    assert len(parts) == 2 and parts[1]['image_url']['url'] == str(r.images[0])
    assert image_bytes(parts[1]['image_url']['url'])[:4] == b'\x89PNG'
    assert server.images == [[str(r.images[0])]]


def test_openai_token_mode_fails_only_the_requests_with_images(tiny):
    """Token prompts cannot carry images: a request with one fails alone (naming it), the other
    requests of the same call are sent and go on, through the executor and the local server."""
    with ChatServer(HFBackend(*tiny)) as server:
        with OpenAIBackend(base_url=server.base_url, backoff=0.01, prompt_mode='tokens',
                           tokenizer=tiny[1]) as client:
            pic = req('pic', {'role': 'user', 'content': f'{IMAGE_TOKEN}look'})
            pic.images = [open_png()]
            outs = client([req('t1'), pic, req('t2')], CONFIG)
            assert isinstance(outs[1], BackendError) and "request 'pic' has 1 image(s), which a token prompt" in \
                str(outs[1])
            assert [o.response.choices[0].token_ids is not None for o in (outs[0], outs[2])] == [True, True]
            assert client.stats.requests == 2 and len(server.bodies) == 2  # the image request was never sent
            pic = req('pic', {'role': 'user', 'content': f'{IMAGE_TOKEN}look'})
            pic.images = [open_png()]
            reqs = [req('a'), pic, req('b')]
            result = Executor(load_scheduler({'name': 'text', 'max_turns': 2, 'stop': {'on_length': False}, 'tips': [
                {'when': 'always', 'text': 'Again.', 'placement': 'user'}]}), client, max_turns=2,
                request_config=CONFIG, on_error='return').run(reqs)
    assert result.finish_reasons == ['stop_rule:tips_exhausted', 'error', 'stop_rule:tips_exhausted']
    [failure] = result.failures
    assert failure.uuid == 'pic' and failure.turn == 1 and failure.phase == 'rollout_fn'
    assert "request pic, turn 1, field 'rollout_fn': rollout_fn failed this request: BackendError: request 'pic' " \
        'has 1 image(s)' in str(failure.error)
    assert len(server.bodies) == 2 + 4  # a and b, both turns


def open_png() -> Any:
    from PIL import Image
    return Image.new('RGB', (3, 3), 'red')


def test_vllm_chat_sends_image_parts(tiny):
    llm = FakeLLM(*tiny)
    backend = VLLMBackend(llm, sampling_params_cls=SamplingParams, prompt_mode='chat')
    r = _run(backend)
    conv = llm.calls[-1]['conversations'][0]
    parts = conv[-1]['content']
    assert [p['type'] for p in parts] == ['text', 'image_url'] and parts[1]['image_url']['url'] == str(r.images[0])
    tokens = VLLMBackend(FakeLLM(*tiny), sampling_params_cls=SamplingParams, prompt_mode='tokens')
    [out] = tokens([r], CONFIG)  # without a processor: the request fails alone, its output is the error
    assert isinstance(out, BackendError) and re.search("request 'pic' has 1 image.*vllm token prompts", str(out))


def _hf(tiny: Any) -> Any:
    return HFBackend(*tiny), None


def _vllm_tokens(tiny: Any) -> Any:
    llm = FakeLLM(*tiny)
    return VLLMBackend(llm, sampling_params_cls=SamplingParams, prompt_mode='tokens'), llm


@pytest.mark.parametrize('make, refusal', [(_hf, 'the hf backend without a processor'),
                                           (_vllm_tokens, 'vllm token prompts')], ids=['hf', 'vllm-tokens'])
def test_without_a_processor_only_the_requests_with_images_fail(tiny, make, refusal):
    """An engine without a vision processor: a request with images fails alone, its output the
    error naming its uuid; the call's other requests are generated as they are without it, and
    through the executor they finish while the image request fails in phase rollout_fn."""
    backend, llm = make(tiny)
    alone = backend([req('t1'), req('t2')], CONFIG)  # the same call without the image request
    pic = req('pic', {'role': 'user', 'content': f'{IMAGE_TOKEN}look'})
    pic.images = [open_png()]
    outs = backend([req('t1'), pic, req('t2')], CONFIG)
    assert isinstance(outs[1], BackendError)
    assert f"request 'pic' has 1 image(s), which {refusal} cannot show the model" in str(outs[1])
    assert [o.response.choices[0].token_ids for o in (outs[0], outs[2])] == \
        [o.response.choices[0].token_ids for o in alone]
    assert backend.stats.requests == 4  # two calls of two served requests: the image request never generated
    if llm is not None:
        assert len(llm.calls[-1]['prompts']) == 2
    pic = req('pic', {'role': 'user', 'content': f'{IMAGE_TOKEN}look'})
    pic.images = [open_png()]
    result = Executor(load_scheduler({'name': 'text', 'max_turns': 2, 'stop': {'on_length': False}, 'tips': [
        {'when': 'always', 'text': 'Again.', 'placement': 'user'}]}), backend, max_turns=2, request_config=CONFIG,
        on_error='return').run([req('a'), pic, req('b')])
    assert result.finish_reasons == ['stop_rule:tips_exhausted', 'error', 'stop_rule:tips_exhausted']
    [failure] = result.failures
    assert failure.uuid == 'pic' and failure.turn == 1 and failure.phase == 'rollout_fn'
    assert "rollout_fn failed this request: BackendError: request 'pic' has 1 image(s)" in str(failure.error)


def test_swift_infer_request_gets_the_images(tiny):
    pytest.importorskip('swift')
    import swift.infer_engine.protocol as sp
    from swift.template.vision_utils import load_image

    from mtflow.backends.swift_engine import SwiftBackend

    class Recording:
        """An ms-swift InferEngine's interface: records each InferRequest, answers with the tiny HF model."""
        def __init__(self) -> None:
            self.requests: List[Any] = []
            self.hf = HFBackend(*tiny)

        def infer(self, requests: List[Any], request_config: Any, use_tqdm: bool = False) -> List[Any]:
            self.requests.append(requests)
            # the tiny model reads text: it sees each image's placeholder as text
            outs = self.hf([RolloutInferRequest(messages=r.messages) for r in requests], CONFIG)
            return [sp.ChatCompletionResponse(model='rec', choices=[sp.ChatCompletionResponseChoice(
                index=0, message=sp.ChatMessage(role='assistant', content=o.response.choices[0].message.content),
                finish_reason='stop')], usage=sp.UsageInfo(0, 0, 0)) for o in outs]

    engine = Recording()
    r = _run(SwiftBackend(engine=engine))
    sent = engine.requests[-1][0]
    assert type(sent).__module__.startswith('swift.') and sent.images == [r.images[0]]
    assert sum(m['content'].count(IMAGE_TOKEN) for m in sent.messages) == 1
    img = load_image(sent.images[0])  # ms-swift's own loader reads mtflow's data URL
    assert img.size == (5, 5) and img.convert('RGB').getpixel((0, 0)) == (0, 255, 0)
