"""A tool-calling scheduler and a deterministic model for the branching tests: each reply is a
function of the request's uuid and its assistant messages so far, so a fork's children answer
apart (their uuids differ) and any driver gives the same trajectories."""
from __future__ import annotations

import zlib
from typing import Any, Dict, List, Optional

from mtflow import Scheduler
from tests.helpers import out


class ToolLoop(Scheduler):
    """Every step answers with a tool message; on_turn_end stops a request whose uuid is in
    ``stop_at`` at that turn; each request's reward is its uuid's length (so values differ)."""

    def __init__(self, stop_at: Optional[Dict[str, int]] = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.stop_at = stop_at or {}
        self.forks: List[tuple] = []

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        done = self.stop_at.get(infer_request.uuid) == current_turn
        return {'done': done, 'rollout_infos': {'reward': float(len(infer_request.uuid))}}

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'tool', 'content': f'result {current_turn} for {infer_request.uuid}'})
        ids = list(response_choice.token_ids or [])
        return {'infer_request': infer_request, 'trace_info': {'calls': [{'name': 'probe'}]},
                'response_token_ids': ids, 'response_loss_mask': [1] * len(ids)}

    def on_fork(self, infer_request, children, current_turn):
        self.forks.append((infer_request.uuid, [c.uuid for c in children], current_turn))


def reply_ids(uuid: str, turn: int, n: int = 3) -> List[int]:
    seed = zlib.crc32(f'{uuid}/{turn}'.encode())
    return [1 + (seed >> (4 * k)) % 97 for k in range(n)]


def model(requests, request_config=None):
    """A deterministic ``rollout_fn``: ids and logprobs from the uuid and the turn."""
    outputs = []
    for r in requests:
        turn = 1 + sum(1 for m in r.messages if m.get('role') == 'assistant')
        ids = reply_ids(r.uuid, turn)
        outputs.append(out(f'{r.uuid} turn {turn}', ids, [-0.1 * (k + 1) * (1 + len(r.uuid) % 3) for k in range(3)]))
    return outputs
