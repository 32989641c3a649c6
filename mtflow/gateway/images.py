"""A call's images, stored in the run directory once each and referenced by path from then on.

A client sends its whole history every call, images included (``data:`` URLs). Each image is
stored by content (``<run>/images/<sha256>.<ext>``, :class:`mtflow.run.images.ImageStore`) the
first time it comes, and the session's request holds its :class:`~mtflow.core.images.ImageRef`
(a path), as ``mtflow run`` holds the images a step added (``docs/multimodal.md``). A data URL
seen before is known by its digest, so a long conversation's images are decoded once.
"""
from __future__ import annotations

import hashlib
from typing import Any, Dict

from mtflow.core.images import IMAGE_TOKEN, ImageError
from mtflow.gateway.wire import Call, WireError
from mtflow.run.files import RunDirError

__all__ = ['CallImages', 'KEEP', 'check_placeholders']

#: stored images remembered by their data URL's digest
KEEP = 4096


class CallImages:
    """Stores calls' images in ``store`` (the run directory's :class:`~mtflow.run.images.ImageStore`)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._known: Dict[str, Any] = {}  # data URL digest -> its reference

    def store_call(self, call: Call) -> None:
        """``call.images`` (data URLs) as stored references; an image that cannot be read is a
        400 naming its place in the call."""
        refs = []
        for k, url in enumerate(call.images):
            digest = hashlib.sha1(url.encode('ascii', 'replace')).hexdigest()
            ref = self._known.get(digest)
            if ref is None:
                try:
                    ref = self.store.put_ref(url)
                except (ImageError, RunDirError, ValueError) as exc:
                    raise WireError(400, f'image {k} of the call: {exc}', param='messages') from None
                if len(self._known) >= KEEP:
                    self._known.pop(next(iter(self._known)))
                self._known[digest] = ref
            refs.append(ref)
        call.images = refs


def check_placeholders(call: Call) -> None:
    """A call with images whose text holds ``<image>`` itself (mtflow's placeholder) is refused:
    the images would not line up with their places."""
    if call.images and sum(str(m.get('content') or '').count(IMAGE_TOKEN) for m in call.messages) != len(call.images):
        raise WireError(400, f'the messages hold the text {IMAGE_TOKEN!r}, which stands for an image here: '
                        f'{len(call.images)} image(s) were sent', param='messages')
