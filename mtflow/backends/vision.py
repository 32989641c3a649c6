"""Exact-id prompts with images, for vision-language models loaded with ``AutoProcessor``
(Qwen2-VL / Qwen2.5-VL class): the HF backend's, and the token prompts vLLM's
``multi_modal_data`` pairs with.

A conversation keeps ms-swift's layout (``<image>`` in the text, the request's ``images``).
:class:`VisionPrompter` is a :class:`~mtflow.backends.tokens.TokenPrompter` that renders each
``<image>`` as the model's own image text (``<|vision_start|><|image_pad|><|vision_end|>``),
builds the turn's prompt from the exact ids of the turns before it as for text, then expands
each new image's single pad token to the number of pads the processor gives that image (the
processor's own rule, read off its output: whatever resize ``min_pixels``/``max_pixels`` make
it do). The token record therefore holds the ids the model saw, pads included: an
observation's image is in its ``appended`` ids (loss mask 0), and ``check-tokens`` compares
them as any other ids. :func:`vision_inputs` gives the model inputs beside the ids
(``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``), for all the request's images.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

from mtflow.accounting.token_record import RECORD_ATTR, record_of
from mtflow.backends.base import BackendError
from mtflow.backends.chat_templates import TemplateSource, resolve_chat_template
from mtflow.backends.images import has_images, image_refusal, normalized_images, refuse_images
from mtflow.backends.tokens import PromptPlan, TokenPrompter
from mtflow.core.images import IMAGE_TOKEN, image_bytes

__all__ = ['VisionPrompter', 'expand_pads', 'collapse_pads', 'check_engine_prompt', 'vision_inputs', 'pil_images',
           'pil_images_of', 'generate_with_images', 'token_prompt', 'image_refusals', 'NO_PROCESSOR_FOR_TOKENS']

#: model inputs the processor returns that belong to the text, rebuilt from the exact ids
_TEXT_KEYS = frozenset(('input_ids', 'attention_mask', 'mm_token_type_ids', 'token_type_ids'))


class _View:
    """The attributes of a request a prompter reads, with the image placeholders rendered."""

    def __init__(self, request: Any, messages: List[Dict[str, Any]]) -> None:
        self.messages = messages
        self.tools = getattr(request, 'tools', None)
        self.chat_template_kwargs = getattr(request, 'chat_template_kwargs', None)
        self.uuid = getattr(request, 'uuid', None)
        setattr(self, RECORD_ATTR, record_of(request))


def pil_images(request: Any) -> List[Any]:
    """The request's images as RGB PIL images (any accepted form; normalised first)."""
    return pil_images_of(normalized_images(request))


def pil_images_of(urls: Sequence[str]) -> List[Any]:
    """Data URLs decoded as RGB PIL images."""
    import io

    from PIL import Image
    return [Image.open(io.BytesIO(image_bytes(u))).convert('RGB') for u in urls]


def expand_pads(ids: List[int], pad_id: int, counts: Sequence[int], where: str) -> List[int]:
    """``ids`` with its ``k``-th run of ``pad_id`` made ``counts[k]`` long: a run of one (a new
    image, as the template renders it) is expanded; a run already that long (an image of an
    earlier turn, from the record) is kept. Raises when the runs and the images disagree."""
    out: List[int] = []
    k = i = 0
    n = len(ids)
    while i < n:
        if ids[i] != pad_id:
            out.append(ids[i])
            i += 1
            continue
        j = i
        while j < n and ids[j] == pad_id:
            j += 1
        if k >= len(counts):
            raise BackendError(f'{where}: the prompt has more image placeholders than the request has images '
                               f'({len(counts)})')
        if j - i not in (1, counts[k]):
            raise BackendError(f'{where}: image {k + 1} has {j - i} pad tokens in the prompt, the processor gives it '
                               f'{counts[k]}')
        out.extend([pad_id] * counts[k])
        k += 1
        i = j
    if k != len(counts):
        raise BackendError(f'{where}: the prompt has {k} image placeholder(s) for {len(counts)} image(s)')
    return out


class VisionPrompter(TokenPrompter):
    """A :class:`TokenPrompter` for a processor's model (see the module docstring).

    Args:
        processor: what ``AutoProcessor.from_pretrained`` returns: a ``tokenizer``, an
            ``image_processor``, ``image_token`` (and ``image_token_id``); called as
            ``processor(text=..., images=...)`` it expands each image token.
        image_text: how one image is written in the prompt (default: the tokenizer's
            ``<|vision_start|>``/``<|vision_end|>`` around the image token, when it has them).
    """

    def __init__(self, processor: Any, chat_template: Union[None, str, TemplateSource] = None, *, image_text: Optional[str] = None,
                 **kwargs: Any) -> None:
        tokenizer = processor.tokenizer
        source = resolve_chat_template(chat_template)
        if source.text is None and getattr(tokenizer, 'chat_template', None):
            source = TemplateSource(tokenizer.chat_template, "the processor's template", "the processor's template")
        super().__init__(tokenizer, source, **kwargs)
        self.processor = processor
        self.image_token = getattr(processor, 'image_token', None) or '<|image_pad|>'
        pad = getattr(processor, 'image_token_id', None)
        self.pad_id = int(pad if pad is not None else tokenizer.convert_tokens_to_ids(self.image_token))
        if image_text is None:
            vocab = tokenizer.get_vocab()
            wrap = '<|vision_start|>' in vocab and '<|vision_end|>' in vocab
            image_text = f'<|vision_start|>{self.image_token}<|vision_end|>' if wrap else self.image_token
        self.image_text = image_text
        self._counts: Dict[str, int] = {}  # pads per image, by sha256 (the processor's answer, once)

    def _rendered(self, request: Any) -> List[Dict[str, Any]]:
        out = []
        for m in request.messages:
            content = m.get('content') if isinstance(m, dict) else getattr(m, 'content', None)
            if isinstance(content, str) and IMAGE_TOKEN in content:
                m = dict(m, content=content.replace(IMAGE_TOKEN, self.image_text))
            out.append(m)
        return out

    def counts(self, request: Any) -> List[int]:
        """Pad tokens per image of ``request``, as the processor expands them."""
        urls = normalized_images(request)
        missing = [u for u in urls if u.sha256 not in self._counts]
        if missing:
            inputs = self.processor(text=[self.image_text] * len(missing), images=pil_images_of(missing),
                                    return_tensors='pt')
            for url, row in zip(missing, inputs['input_ids']):
                self._counts[url.sha256] = int((row == self.pad_id).sum())
        return [self._counts[u.sha256] for u in urls]

    def plan(self, request: Any) -> PromptPlan:
        where = f'request {getattr(request, "uuid", None)!r}'
        plan = super().plan(_View(request, self._rendered(request)))
        if not getattr(request, 'images', None):
            if self.pad_id in plan.ids:
                raise BackendError(f'{where}: the prompt has image pad tokens but the request has no images')
            return plan
        counts = self.counts(request)
        keep = len(plan.ids) - len(plan.appended) if plan.appended is not None else None
        plan.ids = expand_pads(plan.ids, self.pad_id, counts, where)
        if keep is not None:
            plan.appended = plan.ids[keep:]
        return plan


def vision_inputs(prompter: VisionPrompter, request: Any, ids: List[int]) -> Dict[str, Any]:
    """The model inputs beside ``ids`` for all of ``request``'s images: what the processor
    returns for them (``pixel_values``, ``image_grid_thw``, ...), and ``mm_token_type_ids``
    (1 at each image pad) for the exact ids."""
    import torch

    images = pil_images(request)
    inputs = prompter.processor(text=[prompter.image_text * len(images)], images=images, return_tensors='pt')
    extra = {k: v for k, v in inputs.items() if k not in _TEXT_KEYS}
    if 'mm_token_type_ids' in inputs:
        extra['mm_token_type_ids'] = (torch.tensor([ids]) == prompter.pad_id).to(inputs['mm_token_type_ids'].dtype)
    return extra


def generate_with_images(backend: Any, requests: List[Any], plans: List[PromptPlan], options: Any,
                         seeds: List[Optional[int]]) -> List[Any]:
    """The HF backend's outputs for a call in which some requests have images: those are
    generated one by one with their vision inputs, the others batched as text; ``seeds``: each
    request's sampling seed. Only for a backend with a processor: one without refuses each
    request with images first (:func:`image_refusals`)."""
    prompter = backend.prompter
    outputs: List[Any] = [None] * len(requests)
    text = [i for i, r in enumerate(requests) if not has_images(r)]
    if text:
        for i, out in zip(text, backend.generate_ids([plans[i].ids for i in text], options, [seeds[i] for i in text])):
            outputs[i] = out
    for i, r in enumerate(requests):
        if outputs[i] is None:
            outputs[i] = backend._generate_batch([plans[i].ids], options, vision_inputs(prompter, r, plans[i].ids),
                                                 seeds=[seeds[i]])[0]
    return outputs


def collapse_pads(ids: List[int], pad_id: int) -> List[int]:
    """``ids`` with each run of ``pad_id`` made one long: one placeholder per image, the form
    vLLM's multimodal processor takes in a token prompt and expands itself."""
    out: List[int] = []
    for t in ids:
        if t != pad_id or not out or out[-1] != pad_id:
            out.append(t)
    return out


#: what a token prompt without a processor should do instead of carrying images
NO_PROCESSOR_FOR_TOKENS = 'give processor= (AutoProcessor) for token prompts with images, or use prompt_mode chat ' \
    '(image content parts)'


def image_refusals(prompter: Any, requests: List[Any], backend: str, why: str) -> List[Optional[BackendError]]:
    """For each request, the error that refuses it when it has images and ``prompter`` cannot
    show them (it is not a :class:`VisionPrompter`), else ``None``; a backend gives each error in
    place of that request's output (:func:`~mtflow.backends.images.serving_the_others`), so only
    the requests with images fail and the call's others are served."""
    if isinstance(prompter, VisionPrompter):
        return [None] * len(requests)
    return [image_refusal(r, backend, why) for r in requests]


def token_prompt(prompter: Any, request: Any, ids: List[int], backend: str) -> Dict[str, Any]:
    """vLLM's token prompt for ``ids`` (``TokensPrompt``): with the request's images as
    ``multi_modal_data`` when the prompter is a :class:`VisionPrompter`, each image's pads
    collapsed to one, because vLLM's processor replaces every image placeholder of a token prompt
    by the image's pads (vLLM 0.32: a prompt sent with its 4 pads came back with 7); the engine's
    ``prompt_token_ids`` are then checked against ``ids`` (:func:`check_engine_prompt`). A text
    prompter refuses a request with images."""
    if not has_images(request):
        return {'prompt_token_ids': ids}
    if not isinstance(prompter, VisionPrompter):
        refuse_images(request, backend, NO_PROCESSOR_FOR_TOKENS)
    return {'prompt_token_ids': collapse_pads(ids, prompter.pad_id), 'multi_modal_data': {'image': pil_images(request)}}


def check_engine_prompt(request: Any, ids: List[int], engine_ids: Any, pad_id: Optional[int]) -> Optional[BackendError]:
    """``None`` when the engine ran ``ids`` (the pads expanded as the processor expands them),
    else the error that fails ``request`` alone: the engine resized an image by other rules, and
    the token record would not be the ids the model saw."""
    if engine_ids is None or list(engine_ids) == list(ids):
        return None
    where = f'request {getattr(request, "uuid", None)!r}'
    got, want = list(engine_ids), list(ids)
    if pad_id is not None and got.count(pad_id) != want.count(pad_id):
        return BackendError(f'{where}: the engine expanded its images to {got.count(pad_id)} pad tokens, the '
                            f'processor to {want.count(pad_id)}: give the engine the same image processor settings '
                            '(mm_processor_kwargs, min_pixels/max_pixels)')
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return BackendError(f'{where}: the engine ran a prompt of {len(got)} ids that differs from the {len(want)} mtflow '
                        f'built at position {first}')
