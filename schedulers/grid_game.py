"""A grid game whose observation is a picture: the example environment of docs/multimodal.md.

The agent (a blue square) must walk to the goal (a green square) on a small grid; each reply
names a move (``up``, ``down``, ``left`` or ``right``; the last one in the reply counts). Every
observation is the board drawn with PIL (one cell = ``cell`` pixels) beside one line of text, as
a Gymnasium env returns it: a ``Dict`` observation with an ``image`` and a ``text``. Reaching
the goal ends the episode (reward 1.0); each other step costs 0.05; after ``max_steps`` replies
the episode is truncated. The layout depends only on the seed, so runs are reproducible."""
from __future__ import annotations

import random
import re
from typing import Any, Dict, Tuple

MOVES = {'up': (0, -1), 'down': (0, 1), 'left': (-1, 0), 'right': (1, 0)}
_MOVE = re.compile(r'\b(up|down|left|right)\b', re.I)


class GridGame:
    """A Gymnasium-style env (``reset(seed=)``, ``step(action)`` with five results)."""

    def __init__(self, size: int = 5, cell: int = 32, max_steps: int = 8) -> None:
        self.size, self.cell, self.max_steps = size, cell, max_steps
        self.agent = self.goal = (0, 0)
        self.steps = 0

    def reset(self, seed: int = 0) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        rng = random.Random(seed)
        cells = [(x, y) for x in range(self.size) for y in range(self.size)]
        self.agent, self.goal = rng.sample(cells, 2)
        self.steps = 0
        return self._obs('You are the blue square; reach the green one. Reply with up, down, left or right.'), {}

    def step(self, action: str) -> Tuple[Dict[str, Any], float, bool, bool, Dict[str, Any]]:
        self.steps += 1
        moves = _MOVE.findall(action or '')
        if not moves:
            text = 'Please reply with one move: up, down, left or right.'
        else:
            dx, dy = MOVES[moves[-1].lower()]
            x, y = self.agent[0] + dx, self.agent[1] + dy
            if 0 <= x < self.size and 0 <= y < self.size:
                self.agent = (x, y)
                text = f'You moved {moves[-1].lower()}.'
            else:
                text = 'A wall: you did not move.'
        done = self.agent == self.goal
        info = {'agent': list(self.agent), 'goal': list(self.goal)}
        reward = 1.0 if done else -0.05
        return self._obs('You reached the goal!' if done else text), reward, done, \
            self.steps >= self.max_steps and not done, info

    def render(self) -> Any:
        """The board as an RGB PIL image: grey grid lines, the goal green, the agent blue."""
        from PIL import Image, ImageDraw

        side = self.size * self.cell
        img = Image.new('RGB', (side, side), 'white')
        draw = ImageDraw.Draw(img)
        for k in range(self.size + 1):
            draw.line([(k * self.cell, 0), (k * self.cell, side)], fill=(180, 180, 180))
            draw.line([(0, k * self.cell), (side, k * self.cell)], fill=(180, 180, 180))
        for (x, y), color in ((self.goal, (40, 170, 60)), (self.agent, (40, 80, 220))):
            pad = self.cell // 6
            draw.rectangle([x * self.cell + pad, y * self.cell + pad, (x + 1) * self.cell - pad,
                            (y + 1) * self.cell - pad], fill=color)
        return img

    def _obs(self, text: str) -> Dict[str, Any]:
        return {'text': text, 'image': self.render()}
