"""A tiny random Qwen2-VL (one text layer, one vision block, hidden 32) built from a config, and
its processor built locally (the shared BPE tokenizer with Qwen2-VL's vision tokens, and
Qwen2-VL's image processor with small ``min_pixels``/``max_pixels``): offline, seconds on CPU.

transformers 5.19 checks every processor part against its class registry, and the video
processor's needs torchvision, which mtflow does not install; the processor is built without
a video processor, with that one check skipped (images only: the parts used are real)."""
from __future__ import annotations

import copy
import functools
from typing import Any, Tuple

VISION_TOKENS = ['<|vision_start|>', '<|vision_end|>', '<|image_pad|>', '<|video_pad|>']
#: the image processor's resize bounds: 28x28 .. 56x56 pixels after resizing (1 .. 4 image pads)
MIN_PIXELS, MAX_PIXELS = 28 * 28, 56 * 56


@functools.lru_cache(maxsize=None)
def make_vl_processor() -> Any:
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    from tests.tiny_model import make_tokenizer

    tok = copy.deepcopy(make_tokenizer())
    tok.add_tokens(VISION_TOKENS, special_tokens=True)
    images = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    check = ProcessorMixin.check_argument_for_proper_class
    try:
        ProcessorMixin.check_argument_for_proper_class = (  # type: ignore[method-assign]
            lambda self, name, arg: None if arg is None else check(self, name, arg))
        return Qwen2VLProcessor(image_processor=images, tokenizer=tok, video_processor=None,
                                chat_template=tok.chat_template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check  # type: ignore[method-assign]


def make_vlm(seed: int = 0, hidden_size: int = 32, vision_dim: int = 16) -> Tuple[Any, Any]:
    """``(model, processor)``: a random Qwen2-VL sized to the processor's tokenizer, two attention
    heads in each tower (``hidden_size`` 64 gives head size 32, the smallest vLLM's CPU
    attention runs)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    proc = make_vl_processor()
    tok = proc.tokenizer
    start, end, image, video = tok.convert_tokens_to_ids(VISION_TOKENS)
    half = hidden_size // 4  # half the head size: mrope's sections (temporal, height, width) split it
    sections = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    torch.manual_seed(seed)
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         rope_scaling={'type': 'mrope', 'mrope_section': sections}, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=None),
        vision_config=dict(depth=1, embed_dim=vision_dim, hidden_size=hidden_size, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
        tie_word_embeddings=True)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    model.generation_config.bos_token_id = None
    return model, proc


def save_vlm(path: Any, seed: int = 0) -> Tuple[Any, Any]:
    """A tiny Qwen2-VL that vLLM's CPU build can serve, saved to ``path`` with what its
    ``AutoProcessor`` loads (tokenizer, chat template, image processor config): ``(model,
    processor)`` as built here. The processor itself is not saved: without a video processor
    ``save_pretrained`` fails, and the loaded one builds its default (which needs torchvision)."""
    model, proc = make_vlm(seed, hidden_size=64, vision_dim=64)
    model.save_pretrained(path)
    proc.tokenizer.save_pretrained(path)
    proc.image_processor.save_pretrained(path)
    return model, proc
