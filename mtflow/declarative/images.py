"""The YAML scheduler's images: what tools and environments return beside their text, made into
``<image>`` placeholders and entries of the request's ``images`` list (ms-swift's layout), within
the config's ``images`` limits.

A broken or oversized image fails its own request (a
:class:`~mtflow.core.errors.SchedulerResultError` naming the uuid, the turn and which call or
observation it came from); the model never sees half an observation.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from mtflow.core.errors import SchedulerResultError
from mtflow.core.images import ImageError, ImageLimits, ImageURL, observation_parts, to_image_url
from mtflow.declarative.schema import ImagesConfig

__all__ = ['limits_of', 'normalize_all', 'split_observation', 'tool_images', 'add_images']


def limits_of(config: ImagesConfig) -> ImageLimits:
    """The config section as the executor's :class:`ImageLimits`."""
    return ImageLimits(max_images=config.max_per_request, max_pixels=config.max_pixels)


def normalize_all(images: Sequence[Any], limits: Optional[ImageLimits], uuid: Any, turn: int,
                  where: str) -> List[ImageURL]:
    """Each image as an :class:`ImageURL`; the first that fails raises naming ``where`` and its index."""
    out = []
    for k, image in enumerate(images):
        try:
            out.append(to_image_url(image, limits))
        except ImageError as exc:
            raise SchedulerResultError(f'{where} image {k + 1}: {exc}', uuid=uuid, turn=turn, field='images') from None
    return out


def split_observation(obs: Any, limits: Optional[ImageLimits], uuid: Any, turn: int,
                      where: str) -> Tuple[str, List[ImageURL]]:
    """``(text with placeholders, normalised images)`` of an environment observation."""
    try:
        text, images = observation_parts(obs)
    except ImageError as exc:
        raise SchedulerResultError(f'{where}: {exc}', uuid=uuid, turn=turn, field='images') from None
    return str(text), normalize_all(images, limits, uuid, turn, where)


def tool_images(results: Sequence[Any], mode: str, limits: Optional[ImageLimits], uuid: Any,
                turn: int) -> List[ImageURL]:
    """The normalised images of one turn's tool results, in call order. ``observation.mode:
    inline`` cannot carry them (inline text is encoded as plain tokens inside the assistant
    message, where no processor expands an image)."""
    images: List[ImageURL] = []
    for k, r in enumerate(results):
        if r.images:
            if mode == 'inline':
                raise SchedulerResultError(f'tool {r.name!r} returned images, which observation.mode inline cannot '
                                           'carry: use mode message', uuid=uuid, turn=turn, field='observation.mode')
            images.extend(normalize_all(r.images, limits, uuid, turn, f'call {k + 1} ({r.name})'))
    return images


def add_images(request: Any, images: List[ImageURL], trace_info: Optional[Dict[str, Any]]) -> None:
    """Append ``images`` to the request's ``images`` (their placeholders are already in the
    messages) and name them in the turn's trace: index in the request, sha256, size."""
    if not images:
        return
    first = len(request.images or [])
    request.images = list(request.images or []) + images  # a new list: copies never share their images
    if trace_info is not None:
        trace_info['images'] = [{'index': first + k, 'sha256': im.sha256, 'size': [im.width, im.height]}
                                for k, im in enumerate(images)]
