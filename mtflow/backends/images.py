"""How the backends hand a request's images to a model, each in the layout it reads.

mtflow keeps a conversation in ms-swift's layout (``<image>`` in the text, the request's
``images`` in order: :mod:`mtflow.core.images`); this module converts it at each backend's door:
OpenAI content parts for a chat server, normalised data URLs for ms-swift's ``InferRequest``,
and the refusal, naming the request, of a backend that cannot show a model images (a text-only
model, a token prompt without a processor), so an image is never silently dropped.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Dict, List, Optional

from mtflow.backends.base import BackendError
from mtflow.core.images import ImageError, ImageURL, to_content_parts, to_image_url

__all__ = ['has_images', 'openai_messages', 'normalized_images', 'image_refusal', 'refuse_images', 'serving_the_others',
           'aserving_the_others']


def has_images(request: Any) -> bool:
    return bool(getattr(request, 'images', None))


def _where(request: Any) -> str:
    return f'request {getattr(request, "uuid", None)!r}'


def openai_messages(request: Any, messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``messages`` (already prepared for sending) with the request's images as OpenAI
    ``image_url`` content parts at their placeholders; unchanged for a request without images."""
    if not has_images(request):
        return messages
    try:
        return to_content_parts(messages, request.images)
    except ImageError as exc:
        raise BackendError(f'{_where(request)}: {exc}') from None


def normalized_images(request: Any) -> List[ImageURL]:
    """The request's images as :class:`ImageURL` data URLs (what every engine reads)."""
    try:
        return [to_image_url(im) for im in getattr(request, 'images', None) or []]
    except ImageError as exc:
        raise BackendError(f'{_where(request)}: {exc}') from None


def image_refusal(request: Any, backend: str, why: str) -> Optional[BackendError]:
    """The :class:`BackendError` naming ``request`` when it has images that ``backend`` cannot
    show (``why``: what to do instead), else ``None``."""
    if not has_images(request):
        return None
    return BackendError(f'{_where(request)} has {len(request.images)} image(s), which {backend} cannot show the '
                        f'model: {why}')


def refuse_images(request: Any, backend: str, why: str) -> None:
    """Raise :class:`BackendError` when ``request`` has images that ``backend`` cannot show."""
    error = image_refusal(request, backend, why)
    if error is not None:
        raise error


def serving_the_others(requests: List[Any], refusals: List[Optional[BaseException]],
                       serve: Callable[[List[Any]], List[Any]]) -> List[Any]:
    """A call's outputs when some of its requests are refused (``refusals[k]``, an exception, or
    ``None``): each refusal is given in place of its request's output, so that request alone
    fails (phase ``rollout_fn``, the fault table of ``docs/executor.md``), and ``serve`` generates
    the others (one output each, in order); request order is kept."""
    outputs: List[Any] = list(refusals)
    going = [k for k, refusal in enumerate(refusals) if refusal is None]
    if going:
        for k, out in zip(going, serve([requests[k] for k in going])):
            outputs[k] = out
    return outputs


async def aserving_the_others(refusals: List[Optional[BaseException]],
                              serve: Callable[[List[int]], Awaitable[List[Any]]]) -> List[Any]:
    """:func:`serving_the_others` for an async backend: ``await serve(indices)`` generates the
    requests not refused, given by their indices in the call (a caller needs them for each
    request's seed index), one output each, in order."""
    outputs: List[Any] = list(refusals)
    going = [k for k, refusal in enumerate(refusals) if refusal is None]
    if going:
        for k, out in zip(going, await serve(going)):
            outputs[k] = out
    return outputs
