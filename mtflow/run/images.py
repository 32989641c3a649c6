"""The run directory's images: each stored once, named by its content, referenced by name.

A trajectory line names its request's images (``"images": ["images/<sha256>.png", ...]``, in
``<image>`` placeholder order) instead of carrying them as base64, and the trace names each one
by its ``sha256`` at the turn it entered; the same picture seen by many requests, or by the
copies of one prompt, is one file. A file is written to a temporary name, fsynced and renamed
before the trajectory line that names it is written, so a done request always has its images,
and a crash leaves at most a stray ``.tmp``. ``--resume`` finds the files already there and
writes none twice.

``mtflow run`` stores each image the moment the step that added it returns
(:meth:`ImageStore.put_ref`, the executor's ``image_store``): the request holds an
:class:`~mtflow.core.images.ImageRef` (the file's path and the image's size and hash) from then
on, and a backend reads the file when it shows the model the image, so the images of the requests
in flight cost a path each, however large and incompressible they are.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set

from mtflow.core.images import ImageError, ImageRef, image_bytes, to_image_url
from mtflow.run.files import IMAGES_DIR, RunDirError

__all__ = ['IMAGES_DIR', 'ImageStore', 'ShippedName', 'store_request_images']

_EXT = {'image/png': 'png', 'image/jpeg': 'jpg', 'image/gif': 'gif', 'image/webp': 'webp', 'image/bmp': 'bmp'}


class ShippedName(str):
    """An image's file name (``<sha256>.<ext>``) sent in place of its bytes by a sender that
    shipped those bytes before (:meth:`ImageStore.put_shipped`)."""

    __slots__ = ()


class ImageStore:
    """Content-addressed image files under ``<run>/images`` (created on the first image)."""

    def __init__(self, out_dir: Path, fsync: bool = True) -> None:
        self.dir = Path(out_dir) / IMAGES_DIR
        self.abs_dir = self.dir.resolve()  # what an ImageRef names
        self.fsync = fsync
        self._known: Optional[Set[str]] = None  # read on the first image (after --overwrite moved the old aside)
        self.written = 0  # files this process wrote

    @property
    def known(self) -> Set[str]:
        if self._known is None:
            self._known = set(os.listdir(self.dir)) if self.dir.is_dir() else set()
        return self._known

    def put(self, image: Any) -> str:
        """The run-relative name of ``image`` (any form :func:`mtflow.core.images.to_image_url`
        reads), writing its file if the run does not have it yet."""
        if isinstance(image, ImageRef) and Path(image).parent == self.abs_dir and \
                os.path.basename(image) in self.known:
            return f'{IMAGES_DIR}/{os.path.basename(image)}'  # stored by put_ref: nothing to read
        return f'{IMAGES_DIR}/{self._store(image)[0]}'

    def name_of(self, ref: ImageRef) -> str:
        """The file name of an image this store holds (what :meth:`put_ref` returned)."""
        return os.path.basename(ref)

    def put_ref(self, image: Any) -> ImageRef:
        """Store ``image`` now and return its :class:`~mtflow.core.images.ImageRef` (the
        absolute path of its file), to hold instead of the pixels."""
        if isinstance(image, ImageRef):
            return image
        name, url = self._store(image)
        return ImageRef(str(self.abs_dir / name), url.width, url.height, url.sha256, url.mime)

    def _store(self, image: Any) -> Any:
        try:
            url = to_image_url(image)
        except ImageError as exc:
            raise RunDirError(f'cannot store an image in {self.dir}: {exc}') from None
        name = f'{url.sha256}.{_EXT.get(url.mime, "img")}'
        if name not in self.known:
            self._write(name, image_bytes(url))
            self.known.add(name)
        return name, url

    def put_all(self, images: Sequence[Any]) -> List[str]:
        return [self.put(im) for im in images]

    def put_shipped(self, items: Sequence[Any], sender: str) -> List[str]:
        """The run-relative names of images shipped by ``sender`` (a Ray actor): each item is the
        encoded bytes, stored as :meth:`put` does, or a :class:`ShippedName`, an image the sender
        shipped in an earlier record (stored then, before that record's line)."""
        names = []
        for item in items:
            if isinstance(item, ShippedName):
                if str(item) not in self.known:
                    raise RunDirError(f'{sender} named image {item} as shipped before, but {self.dir} has no such '
                                      'file')
                names.append(f'{IMAGES_DIR}/{item}')
            else:
                names.append(self.put(item))
        return names

    def _write(self, name: str, data: bytes) -> None:
        try:
            self.dir.mkdir(exist_ok=True)
            tmp = self.dir / f'{name}.{os.getpid()}.{threading.get_ident()}.tmp'
            with open(tmp, 'wb') as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, self.dir / name)
        except OSError as exc:
            raise RunDirError(f'cannot write {self.dir / name}: {exc.strerror or exc}') from None
        self.written += 1


def store_request_images(store: Any, request: Any, record: Dict[str, Any]) -> None:
    """Store a finished request's images in the run directory and name them in its trajectory
    ``record`` (``images``); then let go of them (the request is done: nothing reads its images
    again), so a long run holds only the images of the requests still going."""
    images = getattr(request, 'images', None)
    if not images:
        return
    record['images'] = store.images.put_all(images)
    try:
        request.images = []
    except (AttributeError, TypeError):  # a frozen request keeps them
        pass
