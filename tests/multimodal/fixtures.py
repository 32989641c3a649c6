"""Tools and environments that return images, for the multimodal tests (named by `module:attr`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Tuple

import numpy as np
from PIL import Image

from mtflow.core.images import Observation
from mtflow.core.scheduler import Scheduler


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



class Pictures(Scheduler):
    """A Python scheduler (for ``mtflow check-tokens --scheduler``): every step shows the model a
    new 40x40 frame in a user message, its colour set by the turn; only the turn bound stops it."""
    swap = False

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        return False

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        infer_request.messages.append({'role': 'user', 'content': f'Frame {current_turn}: <image>'})
        images = list(infer_request.images) + [Image.new('RGB', (40, 40), (60 * current_turn, 0, 90))]
        if self.swap and current_turn == 2:  # tampered: the turn-1 frame replaced by another, same size
            images[0] = Image.new('RGB', (40, 40), 'white')
        infer_request.images = images
        return {'infer_request': infer_request}


class SwappedPictures(Pictures):
    """:class:`Pictures` that, at turn 2, replaces the turn-1 frame by another picture of the same
    size: the ids stay the same, the model is shown another image."""
    swap = True
