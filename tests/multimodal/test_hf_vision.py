"""The HF backend with a vision-language model (a tiny random Qwen2-VL and its processor, built
offline): an image a tool returns at turn 2 reaches the model at turn 3 as the pixel values the
processor makes and exactly as many image pads as the processor expands it to; the token
record holds those pads (the observation's ids, loss mask 0), and the conformance check that
``mtflow check-tokens`` runs passes on the conversation."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')

from PIL import Image  # noqa: E402

from mtflow import Executor, RequestConfig, Scheduler  # noqa: E402
from mtflow.accounting.token_record import RecordAccounting  # noqa: E402
from mtflow.backends import BackendError  # noqa: E402
from mtflow.backends.conformance import check_tokens  # noqa: E402
from mtflow.backends.hf import HFBackend  # noqa: E402
from mtflow.core.images import IMAGE_TOKEN, observation_parts, to_image_url  # noqa: E402
from tests.helpers import req  # noqa: E402
from tests.multimodal import fixtures  # noqa: E402
from tests.tiny_model import make_model, make_tokenizer  # noqa: E402
from tests.tiny_vlm import make_vlm  # noqa: E402

pytestmark = pytest.mark.hf
CONFIG = RequestConfig(temperature=0, max_tokens=4, logprobs=True)


class ToolAtTurn2(Scheduler):
    """Turn 1: a user nudge; turn 2: the `square` tool's result (text and a PIL image) as a tool
    message; turn 3 ends (max_turns; the length limit does not stop it)."""

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        return current_turn >= self.max_turns

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        if current_turn == 1:
            infer_request.messages.append({'role': 'user', 'content': 'Draw it.'})
        else:
            text, images = observation_parts(fixtures.square('red', size=40))
            infer_request.messages.append({'role': 'tool', 'content': text})
            infer_request.images.extend(to_image_url(im) for im in images)
        return {'infer_request': infer_request}


@pytest.fixture(scope='module')
def vlm():
    return make_vlm(seed=1)


class Recorded:
    """Wraps a model's generate to keep the keyword arguments of each call."""

    def __init__(self, model: Any) -> None:
        self.calls: List[Dict[str, Any]] = []
        original = model.generate

        def generate(**kwargs: Any) -> Any:
            self.calls.append(kwargs)
            return original(**kwargs)
        model.generate = generate


def test_tool_image_at_turn_2_reaches_the_vlm_at_turn_3(vlm):
    model, proc = vlm
    rec = Recorded(model)
    backend = HFBackend(model, processor=proc)
    r = req('see')
    result = Executor(ToolAtTurn2(max_turns=3), backend, max_turns=3, request_config=CONFIG,
                      accounting=RecordAccounting()).run([r])
    assert result.failures == [] and len(rec.calls) == 3
    pad = proc.image_token_id
    assert [('pixel_values' in c) for c in rec.calls] == [False, False, True]
    third = rec.calls[2]
    image = Image.new('RGB', (40, 40), 'red')
    want = proc.image_processor(images=[image], return_tensors='pt')
    assert torch.equal(third['pixel_values'], want['pixel_values'])
    assert third['image_grid_thw'].tolist() == want['image_grid_thw'].tolist() == [[1, 2, 2]]
    prompt = third['input_ids'][0].tolist()
    # 40x40 is resized to 28x28 (a multiple of 28 within min/max_pixels): grid 1x2x2, merged 2x2 -> 1 pad
    n_pads = int(want['image_grid_thw'].prod()) // proc.image_processor.merge_size ** 2
    assert prompt.count(pad) == n_pads
    assert third['mm_token_type_ids'][0].tolist() == [int(t == pad) for t in prompt]
    # the processor's own expansion of the same text gives the same ids around the image
    text = proc.tokenizer.decode(prompt[prompt.index(pad) - 12:], skip_special_tokens=False)
    assert '<|vision_start|>' in text and '<|vision_end|>' in text
    # the token record: turn 2's appended ids (the tool message, as the model saw it) hold the pads,
    # and turn 3's prompt is turn 2's prompt + its sampled ids + those appended ids, exactly
    turns = r.token_record.turns
    assert turns[1].appended.count(pad) == n_pads and turns[0].appended.count(pad) == 0
    assert prompt == rec.calls[1]['input_ids'][0].tolist() + turns[1].sampled + turns[1].appended
    assert 'token_record' in result.outputs[0].rollout_infos
    assert r.token_record.last_prompt == prompt


def test_prompt_matches_the_processor_on_the_first_turn(vlm):
    """Turn 1 is rendered from text: the prompt is exactly what the processor makes of the chat."""
    model, proc = vlm
    rec = Recorded(model)
    big = Image.new('RGB', (120, 90), 'blue')  # over max_pixels: the processor's resize decides the pads
    r = req('first', {'role': 'user', 'content': f'{IMAGE_TOKEN}What is this?'})
    r.images = [big]
    HFBackend(model, processor=proc)([r], CONFIG)
    text = proc.tokenizer.apply_chat_template(
        [{'role': 'user', 'content': '<|vision_start|><|image_pad|><|vision_end|>What is this?'}], tokenize=False,
        add_generation_prompt=True)
    want = proc(text=[text], images=[big.convert('RGB')], return_tensors='pt')
    sent = rec.calls[-1]
    assert sent['input_ids'].tolist() == want['input_ids'].tolist()
    assert torch.equal(sent['pixel_values'], want['pixel_values'])
    assert torch.equal(sent['mm_token_type_ids'], want['mm_token_type_ids'].to(sent['mm_token_type_ids'].dtype))
    assert sent['input_ids'][0].tolist().count(proc.image_token_id) == 2  # resized within max_pixels: 2 merged patches


def test_check_tokens_passes_on_a_multimodal_conversation(vlm):
    model, proc = vlm
    backend = HFBackend(model, processor=proc)
    report = check_tokens(backend, scheduler=ToolAtTurn2(max_turns=3), requests=[req('c1'), req('c2')],
                          max_turns=3, temperature=1.0, seed=0)
    assert report.ok, report.problems
    assert report.transitions == 4


def test_text_only_model_refuses_images():
    tok = make_tokenizer()
    r = req('x', {'role': 'user', 'content': f'{IMAGE_TOKEN}hi'})
    r.images = [Image.new('RGB', (2, 2))]
    [out] = HFBackend(make_model(tok), tok)([r], CONFIG)  # the request fails alone: its output is the error
    assert isinstance(out, BackendError)
    assert "request 'x' has 1 image(s), which the hf backend without a processor" in str(out)


def test_vllm_token_prompts_carry_multi_modal_data_and_expanded_pads(vlm):
    """vLLM's token mode with the processor, through the ``vllm.LLM`` stand-in: the turn-3 prompt
    is the same exact ids the HF backend builds (pads expanded as the processor does), with the
    image as ``multi_modal_data``."""
    from mtflow.backends.vllm_engine import VLLMBackend
    from tests.backends.fake_vllm import FakeLLM, SamplingParams

    model, proc = vlm
    llm = FakeLLM(model, proc.tokenizer)
    backend = VLLMBackend(llm, sampling_params_cls=SamplingParams, processor=proc)
    r = req('v')
    result = Executor(ToolAtTurn2(max_turns=3), backend, max_turns=3, request_config=CONFIG,
                      accounting=RecordAccounting()).run([r])
    assert result.failures == []
    prompts = [c['prompts'][0] for c in llm.calls]
    assert ['multi_modal_data' in p for p in prompts] == [False, False, True]
    [image] = prompts[2]['multi_modal_data']['image']
    assert image.size == (40, 40) and image.getpixel((0, 0)) == (255, 0, 0)
    turns = r.token_record.turns
    assert prompts[2]['prompt_token_ids'] == prompts[1]['prompt_token_ids'] + turns[1].sampled + turns[1].appended
    assert prompts[2]['prompt_token_ids'].count(proc.image_token_id) == 1  # 40x40 -> 28x28: one merged patch
