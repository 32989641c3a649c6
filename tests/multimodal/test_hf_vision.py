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
    """Turn 1: a user nudge; turn 2: the `square` tool's result (text and a PIL image of
    ``side`` pixels) as a tool message; turn 3 ends (max_turns; the length limit does not stop it)."""
    side = 40

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        return current_turn >= self.max_turns

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        if current_turn == 1:
            infer_request.messages.append({'role': 'user', 'content': 'Draw it.'})
        else:
            text, images = observation_parts(fixtures.square('red', size=self.side))
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


class Side56(ToolAtTurn2):
    """A 56x56 square: the processor keeps it 56x56, a 4x4 patch grid, 4 merged pads."""
    side = 56


def test_vllm_token_prompts_carry_multi_modal_data_and_one_pad_per_image(vlm):
    """vLLM's token mode with the processor, through the ``vllm.LLM`` stand-in (which expands an
    image's placeholder as vLLM 0.32 does): the turn-3 prompt goes with one pad per image and the
    image as ``multi_modal_data``; the engine runs the ids the HF backend builds (4 pads), and the
    token record holds those."""
    from mtflow.backends.vllm_engine import VLLMBackend
    from tests.backends.fake_vllm import FakeLLM, SamplingParams

    model, proc = vlm
    llm = FakeLLM(model, proc.tokenizer, processor=proc)
    backend = VLLMBackend(llm, sampling_params_cls=SamplingParams, processor=proc)
    r = req('v')
    result = Executor(Side56(max_turns=3), backend, max_turns=3, request_config=CONFIG,
                      accounting=RecordAccounting()).run([r])
    assert result.failures == []
    prompts = [c['prompts'][0] for c in llm.calls]
    assert ['multi_modal_data' in p for p in prompts] == [False, False, True]
    [image] = prompts[2]['multi_modal_data']['image']
    assert image.size == (56, 56) and image.getpixel((0, 0)) == (255, 0, 0)
    pad = proc.image_token_id
    turns = r.token_record.turns
    ran = prompts[1]['prompt_token_ids'] + turns[1].sampled + turns[1].appended
    assert turns[1].appended.count(pad) == 4, 'the record holds the pads the engine ran'
    assert prompts[2]['prompt_token_ids'] == [t for i, t in enumerate(ran) if t != pad or ran[i - 1] != pad]
    assert prompts[2]['prompt_token_ids'].count(pad) == 1
    assert llm._expand(prompts[2]) == ran


def test_an_engine_that_expands_an_image_otherwise_fails_that_request_only(vlm):
    """The engine ran other ids than mtflow built for a request with an image (its processor
    resized the image by other rules): that request fails, naming the counts; the call's other
    request goes on."""
    from mtflow.backends.vllm_engine import VLLMBackend
    from tests.backends.fake_vllm import FakeLLM, SamplingParams

    model, proc = vlm

    class OtherRules(FakeLLM):
        def _expand(self, prompt):
            ids = super()._expand(prompt)
            if prompt.get('multi_modal_data'):
                i = ids.index(proc.image_token_id)
                ids = ids[:i] + [proc.image_token_id] + ids[i:]
            return ids

    backend = VLLMBackend(OtherRules(model, proc.tokenizer, processor=proc), sampling_params_cls=SamplingParams,
                          processor=proc)

    class OnlyV(Side56):
        def step(self, infer_request, response_choice, current_turn):
            if infer_request.uuid == 'v':
                return super().step(infer_request, response_choice, current_turn)
            infer_request.messages.append({'role': 'user', 'content': 'Go on.'})
            return {'infer_request': infer_request}

    result = Executor(OnlyV(max_turns=3), backend, max_turns=3, request_config=CONFIG, on_error='return',
                      accounting=RecordAccounting()).run([req('v'), req('t')])
    [failure] = result.failures
    assert failure.uuid == 'v' and failure.phase == 'rollout_fn'
    assert 'expanded its images to 5 pad tokens, the processor to 4' in str(failure.error)
    assert result.finish_reasons == ['error', 'check_finished']


