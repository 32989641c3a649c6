"""Tools and environments that return images, for the multimodal tests (named by `module:attr`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Tuple

import numpy as np
from PIL import Image

from mtflow.core.images import Observation


def square(color: str = 'red', size: int = 8) -> Any:
    """Draw a square of one colour.

    Args:
        color: a PIL colour name.
        size: the side in pixels.
    """
    return Observation(f'a {color} square', [Image.new('RGB', (size, size), color)])


def bare(size: int = 4) -> Any:
    """An image and nothing else (a numpy array)."""
    return np.full((size, size, 3), 200, dtype=np.uint8)


def mixed() -> Any:
    """Text, a PNG file's bytes, more text."""
    import io
    buf = io.BytesIO()
    Image.new('L', (3, 2), 128).save(buf, format='PNG')
    return ['before', buf.getvalue(), 'after']


def broken() -> Any:
    """Bytes that start like a PNG and are not one."""
    return Observation('broken', [b'\x89PNG\r\n\x1a\n' + b'\0' * 20])


def on_disk(path: str) -> Any:
    """An image from a file."""
    return Observation('from disk', [Path(path)])


class FrameEnv:
    """A gymnasium-style env whose observation is an ``rgb_array`` frame (HxWx3 uint8) that
    brightens every step; ends when the completion says 'done'."""

    def __init__(self, size: int = 6, as_dict: bool = False) -> None:
        self.size, self.as_dict, self.t = size, as_dict, 0

    def _obs(self) -> Any:
        frame = np.full((self.size, self.size, 3), 40 * self.t, dtype=np.uint8)
        return {'text': f'step {self.t}', 'frame': frame} if self.as_dict else frame

    def reset(self, seed: int = 0) -> Tuple[Any, Dict[str, Any]]:
        self.t = 0
        return self._obs(), {}

    def step(self, action: str) -> Tuple[Any, float, bool, bool, Dict[str, Any]]:
        self.t += 1
        return self._obs(), float('done' in action), 'done' in action, False, {}
