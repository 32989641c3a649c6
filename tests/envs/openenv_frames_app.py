"""An OpenEnv environment whose observations carry images, served with openenv's own server
code (``create_app``), for the multimodal tests: walk a marker along a 4-pixel strip; every
observation shows it three ways (``frame``: nested lists of pixels, as a numpy array
serialises; ``snapshot``: base64 of a PNG; ``screen`` + ``screen_shape``: a flat list of
pixels, as OpenEnv's Atari env sends them) beside the ``prompt`` text. ``right`` moves the
marker; the episode ends when it reaches the last pixel. ``draw broken`` sends a snapshot that
is not an image."""
from __future__ import annotations

import base64
import io
from typing import Any, List, Optional

import numpy as np
from openenv.core.env_server import Action, Environment, Observation, State, create_app
from PIL import Image

WIDTH = 4


class MoveAction(Action):
    message: str


class FrameObservation(Observation):
    prompt: str
    frame: List[Any]
    snapshot: Optional[str] = None
    screen: List[int]
    screen_shape: List[int]


def pixels(pos: int) -> np.ndarray:
    """The strip as a 1xWIDTHx3 image: white, the marker red."""
    arr = np.full((1, WIDTH, 3), 255, dtype=np.uint8)
    arr[0, pos] = (255, 0, 0)
    return arr


class StripEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.pos = 0

    def _obs(self, prompt: str, done: bool, reward: Optional[float], broken: bool = False) -> FrameObservation:
        arr = pixels(self.pos)
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format='PNG')
        snapshot = base64.b64encode(b'not a picture' if broken else buf.getvalue()).decode()
        return FrameObservation(prompt=prompt, frame=arr.tolist(), snapshot=snapshot,
                                screen=arr.reshape(-1).tolist(), screen_shape=list(arr.shape), done=done,
                                reward=reward)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> FrameObservation:
        self.pos = 0
        self._state = State(episode_id=episode_id, step_count=0)
        return self._obs('Move the red pixel to the right end.', False, None)

    def step(self, action: MoveAction, timeout_s: Optional[float] = None, **kwargs: Any) -> FrameObservation:
        self._state.step_count += 1
        if 'right' in action.message:
            self.pos = min(self.pos + 1, WIDTH - 1)
        done = self.pos == WIDTH - 1
        return self._obs('Done.' if done else f'At {self.pos}.', done, 1.0 if done else 0.0,
                         broken='broken' in action.message)

    @property
    def state(self) -> State:
        return self._state


app = create_app(StripEnvironment, MoveAction, FrameObservation, max_concurrent_envs=8)
