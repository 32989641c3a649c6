"""Images in observations: the one place that reads, checks and converts them.

A tool, an environment or a Python scheduler's ``step`` may hand back images in any of the forms
users have at hand (a PIL image, a numpy array, encoded bytes, a :class:`pathlib.Path`, a
``data:image/...;base64,`` URL, or a ``{'bytes': ..., 'path': ...}`` dict as ``datasets``
stores them). mtflow keeps a conversation in ms-swift's layout, whatever the backend: the text
carries one ``<image>`` placeholder per image and the request's ``images`` list holds the images
in placeholder order (ms-swift's engines and templates read exactly that). The backends that
want another layout convert at their door: :func:`to_content_parts` gives OpenAI's content
parts (``{"type": "image_url", ...}``), :func:`from_content_parts` reads them back.

:func:`to_image_url` turns any accepted form into an :class:`ImageURL` (a ``str``: the data URL
every backend and ms-swift's ``load_file`` accept, JSON as it is) that also carries the image's
size and content hash, so checks later cost nothing. A broken image, one over
:class:`ImageLimits`, or a placeholder count that does not match the ``images`` list raises
:class:`ImageError`; :func:`check_request_images` turns that into a
:class:`~mtflow.core.errors.SchedulerResultError` naming the request, the turn and the image,
which fails that request only.

Pillow and numpy are imported lazily: ``import mtflow`` stays light and text-only runs never
load them.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mtflow.core.errors import SchedulerResultError

__all__ = [
    'IMAGE_TOKEN', 'ImageError', 'ImageLimits', 'ImageURL', 'Observation', 'is_image', 'to_image_url',
    'image_bytes', 'image_size', 'count_placeholders', 'check_request_images', 'to_content_parts',
    'from_content_parts', 'observation_parts', 'place_images', 'env_observation', 'ImageRef', 'store_step_images',
    'with_stored_images'
]

#: ms-swift's placeholder for one image in a message's text
IMAGE_TOKEN = '<image>'
_DATA_URL = re.compile(r'data:(image/[\w.+-]+);base64,(.*)', re.S)
#: the leading bytes of the encodings Pillow reads that tools hand back
_MAGIC = (b'\x89PNG\r\n\x1a\n', b'\xff\xd8\xff', b'GIF87a', b'GIF89a', b'BM', b'RIFF')


class ImageError(ValueError):
    """An image that cannot be read, or that breaks a limit; the message says which and why."""


@dataclass(frozen=True)
class ImageLimits:
    """Per-request limits: at most ``max_images`` images in one request, at most ``max_pixels``
    (width x height) in one image. ``None``: no limit."""
    max_images: Optional[int] = None
    max_pixels: Optional[int] = None


class ImageURL(str):
    """A normalised image: the ``data:`` URL itself, with ``width``, ``height``, ``sha256`` (of
    the encoded bytes: the name the run directory stores it under) and ``mime``."""
    width: int
    height: int
    sha256: str
    mime: str

    def __new__(cls, url: str, width: int, height: int, sha256: str, mime: str) -> 'ImageURL':
        self = super().__new__(cls, url)
        self.width, self.height, self.sha256, self.mime = width, height, sha256, mime
        return self

    def __reduce__(self) -> Any:  # pickles (Ray, copies) as itself
        return ImageURL, (str(self), self.width, self.height, self.sha256, self.mime)

    def __deepcopy__(self, memo: Any) -> 'ImageURL':
        return self  # immutable


class ImageRef(str):
    """An image already stored in a file (the run directory's content-addressed store): the str
    is the file's absolute path, which ms-swift's ``load_image`` and every reader of paths take
    as it is; ``width``, ``height``, ``sha256`` and ``mime`` as :class:`ImageURL`'s. A request
    that holds it holds a path, not the pixels: :func:`to_image_url` reads the file when a
    backend needs them, and lets go of them after the call."""
    width: int
    height: int
    sha256: str
    mime: str

    def __new__(cls, path: str, width: int, height: int, sha256: str, mime: str) -> 'ImageRef':
        self = super().__new__(cls, path)
        self.width, self.height, self.sha256, self.mime = width, height, sha256, mime
        return self

    def __reduce__(self) -> Any:  # pickles (Ray, copies) as itself
        return ImageRef, (str(self), self.width, self.height, self.sha256, self.mime)

    def __deepcopy__(self, memo: Any) -> 'ImageRef':
        return self  # immutable


@dataclass
class Observation:
    """What a tool, an environment or a scheduler returns when its observation has images:
    ``text`` (may hold ``<image>`` placeholders; the missing ones are appended) and ``images`` in
    any accepted form."""
    text: str = ''
    images: Sequence[Any] = ()


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow ships with the extras that read images
        raise ImageError("Pillow is not installed: pip install 'mtflow[images]'") from None
    return Image


def is_image(value: Any) -> bool:
    """True for the forms :func:`to_image_url` reads when they come bare (not in an
    :class:`Observation`): a PIL image, a 2-D/3-D numpy array, encoded image bytes, a Path to an
    image file, a ``data:image/`` URL. A plain str is text, not a path."""
    cls = type(value)
    if isinstance(value, (ImageURL, ImageRef)):
        return True
    if isinstance(value, str):
        return value.startswith('data:image/')
    if isinstance(value, (bytes, bytearray)):
        return bytes(value[:8]).startswith(_MAGIC)
    if isinstance(value, Path):
        return value.suffix.lower() in ('.png', '.jpg', '.jpeg', '.gif', '.bmp', '.webp')
    module = cls.__module__ or ''
    if module.startswith('PIL.'):
        return hasattr(value, 'size') and hasattr(value, 'mode')
    if module == 'numpy' and cls.__name__ == 'ndarray':
        return value.ndim in (2, 3)
    return False


def _from_array(arr: Any) -> Any:
    import numpy as np  # lazy: only arrays need numpy
    a = np.asarray(arr)
    if a.ndim == 3 and a.shape[-1] == 1:
        a = a[..., 0]
    if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[-1] not in (3, 4)):
        raise ImageError(f'an image array must be HxW, HxWx3 or HxWx4, got shape {tuple(a.shape)}')
    if a.dtype != np.uint8:
        if a.dtype.kind == 'f':
            if not np.isfinite(a).all():
                raise ImageError('an image array has NaN or infinite values')
            a = a * 255.0 if a.size and float(a.max()) <= 1.0 else a
        a = np.clip(a, 0, 255).astype(np.uint8)
    return _pil().fromarray(np.ascontiguousarray(a))


def _encode_png(img: Any) -> bytes:
    if img.mode not in ('RGB', 'RGBA', 'L', 'LA', 'P', '1', 'I;16'):
        img = img.convert('RGB')
    buf = io.BytesIO()
    img.save(buf, format='PNG')
    return buf.getvalue()


def _decode(data: bytes) -> Tuple[int, int, str]:
    """(width, height, mime) of encoded image bytes, checked by Pillow (header and data)."""
    Image = _pil()
    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = img.format or 'PNG'
            size = img.size
            img.load()  # the whole image, so truncated data fails here, not in the backend
    except Exception as exc:
        raise ImageError(f'cannot decode the image ({len(data)} bytes): {type(exc).__name__}: {exc}') from None
    return size[0], size[1], Image.MIME.get(fmt, f'image/{fmt.lower()}')


def _check_pixels(width: int, height: int, limits: Optional[ImageLimits]) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f'the image is empty ({width}x{height})')
    if limits is not None and limits.max_pixels is not None and width * height > limits.max_pixels:
        raise ImageError(f'the image is {width}x{height} = {width * height} pixels, over max_pixels '
                         f'{limits.max_pixels}')


def to_image_url(value: Any, limits: Optional[ImageLimits] = None) -> ImageURL:
    """``value`` (any accepted form, a str path included) as an :class:`ImageURL`; raises
    :class:`ImageError` for anything unreadable or over ``limits.max_pixels``. Encoded input
    (bytes, files, data URLs) keeps its encoding; pixels (PIL, arrays) are encoded as PNG."""
    if isinstance(value, ImageURL):
        _check_pixels(value.width, value.height, limits)
        return value
    if isinstance(value, ImageRef):
        _check_pixels(value.width, value.height, limits)
        try:
            data = Path(value).read_bytes()
        except OSError as exc:
            raise ImageError(f'cannot read the stored image {str(value)!r}: {exc.strerror or exc}') from None
        return _url(data, value.width, value.height, value.mime)
    if isinstance(value, dict) and ('bytes' in value or 'path' in value):
        value = value.get('bytes') or value.get('path')
    module = type(value).__module__ or ''
    if isinstance(value, (bytes, bytearray)):
        data = bytes(value)
    elif isinstance(value, str) and value.startswith('data:'):
        m = _DATA_URL.fullmatch(value)
        if m is None:
            raise ImageError(f'not a base64 image data URL: {value[:40]!r}')
        try:
            data = base64.b64decode(m.group(2), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageError(f'the data URL is not valid base64: {exc}') from None
    elif isinstance(value, (str, Path)):
        if isinstance(value, str) and re.match(r'[a-z]+://', value):
            raise ImageError(f'remote images are not fetched ({value[:60]!r}): hand over the bytes or a file')
        try:
            data = Path(value).read_bytes()
        except OSError as exc:
            raise ImageError(f'cannot read the image file {str(value)!r}: {exc.strerror or exc}') from None
    elif (module.startswith('PIL.') and hasattr(value, 'size')) or module == 'numpy':
        img = _from_array(value) if module == 'numpy' else value
        width, height = img.size
        _check_pixels(width, height, limits)
        data = _encode_png(img)  # encoded here: nothing to decode again
        return _url(data, width, height, 'image/png')
    else:
        raise ImageError(f'cannot read an image from {type(value).__name__} (expected a PIL image, a numpy array, '
                         'bytes, a path or a data URL)')
    width, height, mime = _decode(data)
    _check_pixels(width, height, limits)
    return _url(data, width, height, mime)


def _url(data: bytes, width: int, height: int, mime: str) -> ImageURL:
    """The :class:`ImageURL` of encoded ``data``: its data URL, size and content hash."""
    url = f'data:{mime};base64,{base64.b64encode(data).decode("ascii")}'
    return ImageURL(url, width, height, hashlib.sha256(data).hexdigest(), mime)


def image_bytes(url: str) -> bytes:
    """The encoded bytes of a data URL."""
    m = _DATA_URL.fullmatch(url)
    if m is None:
        raise ImageError(f'not a base64 image data URL: {url[:40]!r}')
    return base64.b64decode(m.group(2))


def image_size(value: Any) -> Tuple[int, int]:
    """(width, height) of an image in any accepted form, decoding only what has no size at hand."""
    if isinstance(value, (ImageURL, ImageRef)):
        return value.width, value.height
    module = type(value).__module__ or ''
    if module.startswith('PIL.') and hasattr(value, 'size'):
        return tuple(value.size)  # type: ignore[return-value]
    if module == 'numpy' and getattr(value, 'ndim', 0) in (2, 3):
        return int(value.shape[1]), int(value.shape[0])
    if isinstance(value, Path) or (isinstance(value, str) and not value.startswith('data:')):
        try:  # the header only: a file the dataset names is not decoded every turn
            with _pil().open(value) as img:
                return tuple(img.size)  # type: ignore[return-value]
        except Exception as exc:
            raise ImageError(f'cannot read the image file {str(value)!r}: {type(exc).__name__}: {exc}') from None
    url = to_image_url(value)
    return url.width, url.height


def count_placeholders(messages: Sequence[Dict[str, Any]]) -> int:
    """How many ``<image>`` placeholders the text of ``messages`` holds."""
    n = 0
    for m in messages:
        content = m.get('content')
        if isinstance(content, str):
            n += content.count(IMAGE_TOKEN)
    return n


def check_request_images(request: Any, uuid: str, turn: Optional[int], limits: Optional[ImageLimits] = None,
                         start: int = 0) -> None:
    """Check a request's images from index ``start`` on (those already checked are skipped):
    each readable and within ``limits``, no more than ``limits.max_images``, and as many
    ``<image>`` placeholders in the messages as images. Changes nothing (a scheduler's own PIL
    images stay PIL images, as ms-swift leaves them); raises
    :class:`~mtflow.core.errors.SchedulerResultError` with ``field='images[k]'``."""
    images = getattr(request, 'images', None) or []
    if limits is not None and limits.max_images is not None and len(images) > limits.max_images:
        raise SchedulerResultError(f'{len(images)} images, over max_images {limits.max_images}', uuid=uuid,
                                   turn=turn, field='images')
    for k in range(start, len(images)):
        try:
            width, height = image_size(images[k])
            _check_pixels(width, height, limits)
        except ImageError as exc:
            raise SchedulerResultError(str(exc), uuid=uuid, turn=turn, field=f'images[{k}]') from None
    placeholders = count_placeholders(getattr(request, 'messages', None) or [])
    if images and placeholders != len(images):
        raise SchedulerResultError(f'the messages hold {placeholders} {IMAGE_TOKEN} placeholder(s) for {len(images)} '
                                   'image(s): each image needs its placeholder, in order', uuid=uuid, turn=turn,
                                   field='images')


def store_step_images(result: Any, store: Any, limits: Optional[ImageLimits] = None) -> None:
    """Hand the images of a step's next request (``result``: the step's return value) to
    ``store`` (``image -> ImageRef``, the run directory's) as soon as the step returns, so the
    request holds references, not pixels, from then on. A request whose images break a check is
    left as it is: the executor's check fails it, naming the request and the turn."""
    request = result.get('infer_request') if isinstance(result, dict) else result
    images = getattr(request, 'images', None)
    if not images or all(isinstance(im, ImageRef) for im in images):
        return
    try:
        check_request_images(request, None, None, limits)
        refs = [im if isinstance(im, ImageRef) else store(im) for im in images]
    except Exception:  # broken (the executor says which), or the store failed (the line's write says)
        return
    try:
        request.images = refs
    except (AttributeError, TypeError):  # a frozen request keeps its images
        pass


def with_stored_images(step: Any, is_async: bool, store: Any, limits: Optional[ImageLimits]) -> Any:
    """``step`` (a scheduler's) that stores its next request's images (:func:`store_step_images`)
    the moment it returns, sync or async as ``step`` is."""
    if is_async:
        async def stored_async(*args: Any, **kwargs: Any) -> Any:
            result = await step(*args, **kwargs)
            store_step_images(result, store, limits)
            return result
        return stored_async

    def stored(*args: Any, **kwargs: Any) -> Any:
        result = step(*args, **kwargs)
        store_step_images(result, store, limits)
        return result
    return stored


def observation_parts(value: Any, place: bool = True) -> Tuple[Any, List[Any]]:
    """``(text, images)`` of what a tool or an environment returned: an :class:`Observation`, a
    bare image, a list/tuple mixing text and images, or anything else (returned as it is,
    ``images`` empty). With ``place``, the text gets one ``<image>`` placeholder per image it
    lacks (appended, one per line: :func:`place_images`); the images are returned as given
    (normalise them with :func:`to_image_url`)."""
    if isinstance(value, Observation):
        text, images = value.text or '', list(value.images)
    elif is_image(value):
        text, images = '', [value]
    elif isinstance(value, (list, tuple)) and any(is_image(v) for v in value):
        texts, images = [], []
        for v in value:
            if is_image(v):
                images.append(v)
                texts.append(IMAGE_TOKEN)
            else:
                texts.append(str(v))
        text = '\n'.join(texts)
    else:
        return value, []
    if text.count(IMAGE_TOKEN) > len(images):
        raise ImageError(f'the text has {text.count(IMAGE_TOKEN)} {IMAGE_TOKEN} placeholders for {len(images)} '
                         'image(s)')
    return (place_images(text, len(images)) if place else text), images


def place_images(text: str, n: int) -> str:
    """``text`` with the ``<image>`` placeholders it lacks for ``n`` images appended, one per line
    (a tool that returns only images, or whose text was truncated, still shows each one)."""
    missing = n - text.count(IMAGE_TOKEN)
    if missing <= 0:
        return text
    return '\n'.join(([text] if text else []) + [IMAGE_TOKEN] * missing)


def env_observation(obs: Any) -> Any:
    """An environment's observation as text, or as an :class:`Observation` when it holds images:
    an ``rgb_array`` frame (a HxWx3 array) or any other bare image, or a dict (Gymnasium's
    ``Dict`` space) whose image values become the images and whose ``text`` (else the other
    items, as JSON) the text."""
    if obs is None:
        return None
    if isinstance(obs, Observation):
        return obs
    if is_image(obs):
        return Observation('', [obs])
    if isinstance(obs, dict) and any(is_image(v) for v in obs.values()):
        images = [v for v in obs.values() if is_image(v)]
        rest = {k: v for k, v in obs.items() if not is_image(v)}
        text = rest.pop('text', None)
        if text is None and rest:
            text = json.dumps(rest, ensure_ascii=False, default=str)
        return Observation('' if text is None else str(text), images)
    return str(obs)


def to_content_parts(messages: Sequence[Dict[str, Any]], images: Sequence[Any]) -> List[Dict[str, Any]]:
    """``messages`` in OpenAI's layout: every message whose text holds ``<image>`` placeholders
    gets a content list of ``text`` and ``image_url`` parts (the images in order, as data URLs);
    the others are copied as they are. Raises :class:`ImageError` when the counts differ."""
    out: List[Dict[str, Any]] = []
    k = 0
    for m in messages:
        content = m.get('content')
        if not isinstance(content, str) or IMAGE_TOKEN not in content:
            out.append(dict(m))
            continue
        parts: List[Dict[str, Any]] = []
        pieces = content.split(IMAGE_TOKEN)
        for j, piece in enumerate(pieces):
            if piece:
                parts.append({'type': 'text', 'text': piece})
            if j < len(pieces) - 1:
                if k >= len(images):
                    raise ImageError(f'more {IMAGE_TOKEN} placeholders than images ({len(images)})')
                parts.append({'type': 'image_url', 'image_url': {'url': str(to_image_url(images[k]))}})
                k += 1
        out.append({**m, 'content': parts})
    if k != len(images):
        raise ImageError(f'{len(images)} image(s) for {k} {IMAGE_TOKEN} placeholder(s)')
    return out


def from_content_parts(messages: Sequence[Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], List[Any]]:
    """OpenAI-layout ``messages`` (content lists with ``text`` and ``image_url``/``image`` parts)
    in ms-swift's: text with ``<image>`` placeholders, and the images in order."""
    out: List[Dict[str, Any]] = []
    images: List[Any] = []
    for m in messages:
        content = m.get('content')
        if not isinstance(content, list):
            out.append(dict(m))
            continue
        texts = []
        for part in content:
            kind = part.get('type') if isinstance(part, dict) else None
            if kind == 'text':
                texts.append(part.get('text', ''))
            elif kind == 'image_url':
                url = part.get('image_url')
                images.append(url.get('url') if isinstance(url, dict) else url)
                texts.append(IMAGE_TOKEN)
            elif kind == 'image':
                images.append(part.get('image') if 'image' in part else part.get('url'))
                texts.append(IMAGE_TOKEN)
            else:
                raise ImageError(f'unknown content part {kind!r} in a {m.get("role")!r} message')
        out.append({**m, 'content': ''.join(texts)})
    return out, images
