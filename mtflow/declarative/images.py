"""The YAML scheduler's images: what tools and environments return beside their text, made into
``<image>`` placeholders and entries of the request's ``images`` list (ms-swift's layout), within
the config's ``images`` limits.

Beside the images a tool or an environment returns as objects, the YAML can name images in text:
``observation.images_from`` reads those a tool's text result names (a regex ``pattern`` whose
matches are data URLs or paths inside ``dir``, or an ``impl`` function), and a tip can show
``images`` (files or data URLs) and ``images_impl``'s.

A broken or oversized image fails its own request (a
:class:`~mtflow.core.errors.SchedulerResultError` naming the uuid, the turn and which call or
observation it came from); the model never sees half an observation.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mtflow.core.errors import SchedulerResultError
from mtflow.core.images import (IMAGE_TOKEN, ImageError, ImageLimits, ImageURL, Observation, is_image,
                                observation_parts, place_images, to_image_url)
from mtflow.core.registry import resolve_reference
from mtflow.declarative.schema import ImagesConfig, ResultImagesConfig, TipConfig, image_path

__all__ = ['limits_of', 'normalize_all', 'split_observation', 'tool_images', 'add_images', 'ResultImages',
           'tip_images']


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


class ResultImages:
    """``observation.images_from``, compiled once: the images a tool's text result names."""

    def __init__(self, config: ResultImagesConfig, base_dir: Optional[str] = None) -> None:
        self.config = config
        self.regex = re.compile(config.pattern) if config.pattern is not None else None
        self.impl = resolve_reference(config.impl, base_dir) if config.impl is not None else None
        root = config.dir
        self.root = None if root is None else Path(image_path(root, base_dir)).resolve()

    def apply(self, results: Sequence[Any], uuid: Any, turn: int) -> List[Any]:
        """``results`` with the images each successful result's text names moved into its
        ``images`` (placeholders where they were named); the others unchanged."""
        out = []
        for k, r in enumerate(results):
            if not r.ok:
                out.append(r)
                continue
            where = f'call {k + 1} ({r.name}): observation.images_from'
            try:
                text, images = (self._matches(r) if self.regex is not None else self._called(r, k + 1))
            except ImageError as exc:
                raise SchedulerResultError(f'{where}: {exc}', uuid=uuid, turn=turn,
                                           field='observation.images_from') from None
            except Exception as exc:  # the user's function
                raise SchedulerResultError(f'{where}.impl raised {type(exc).__name__}: {exc}', uuid=uuid, turn=turn,
                                           field='observation.images_from.impl') from None
            out.append(r if images is None else dataclasses.replace(r, output=text, images=images))
        return out

    def _matches(self, r: Any) -> Tuple[str, Optional[List[Any]]]:
        images = list(r.images)
        text = place_images(r.output, len(images)) if images else r.output
        pieces: List[str] = []
        pos = added = 0
        for m in self.regex.finditer(text):
            if m.end() == m.start():
                continue
            ref = m.group(1) if self.regex.groups and m.group(1) is not None else m.group(0)
            images.insert(text[:m.start()].count(IMAGE_TOKEN) + added, self._read(ref.strip()))
            pieces += [text[pos:m.start()], IMAGE_TOKEN]
            pos = m.end()
            added += 1
        if not added:
            return r.output, None
        return ''.join(pieces) + text[pos:], images

    def _read(self, ref: str) -> Any:
        if ref.startswith('data:'):
            return ref
        if self.root is None:
            raise ImageError(f'the result names the file {ref[:80]!r}; give images_from.dir (the directory such '
                             'files must lie in) to read files')
        path = (self.root / ref).resolve()
        try:
            path.relative_to(self.root)
        except ValueError:
            raise ImageError(f'{ref[:80]!r} lies outside images_from.dir ({self.root})') from None
        return path

    def _called(self, r: Any, index: int) -> Tuple[str, Optional[List[Any]]]:
        value = self.impl(r.name, r.output, index)
        if value is None:
            return r.output, None
        if isinstance(value, Observation) or isinstance(value, (list, tuple)):
            text, images = observation_parts(value, place=False)
            if not isinstance(value, Observation) and not images:
                raise ImageError(f'returned a {type(value).__name__} without images')
            return str(text), list(r.images) + list(images)
        if is_image(value) or isinstance(value, dict):
            return r.output, list(r.images) + [value]
        raise ImageError(f'impl returned {type(value).__name__}: give None, an image, a list mixing text and images, '
                         'or an Observation')


def tip_images(tip: TipConfig, impl: Any, base_dir: Optional[str], request: Any, choice: Any,
               turn: int) -> List[Any]:
    """The images a tip shows: its ``images`` (files resolved against the YAML's directory, or
    data URLs), then what ``images_impl`` returns for this request and turn."""
    out: List[Any] = [ref if ref.startswith('data:') else Path(image_path(ref, base_dir)) for ref in tip.images]
    if impl is not None:
        try:
            value = impl(request, choice, turn)
        except Exception as exc:
            raise SchedulerResultError(f'tip {tip.name!r}: images_impl raised {type(exc).__name__}: {exc}',
                                       uuid=getattr(request, 'uuid', None), turn=turn,
                                       field='tips.images_impl') from None
        if value is not None:
            out += list(value) if isinstance(value, (list, tuple)) else [value]
    return out
