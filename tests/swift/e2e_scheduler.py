"""A plain mtflow scheduler for the end-to-end GRPO test (registered through
``MTFLOW_SWIFT_SCHEDULERS=e2e_three_turns=tests.swift.e2e_scheduler:ThreeTurns``).

The tiny random model never ends a message, so every turn hits ``max_completion_length``; this
scheduler ignores the length limit and runs exactly ``max_turns`` turns: odd turns add a user
message (a new segment), even turns append a masked inline note to the assistant message (the
next turn continues it). Each finished request is appended to ``$MTFLOW_E2E_LOG`` as JSON."""
from __future__ import annotations

import json
import os
from typing import Any, Dict

import mtflow

NOTE = ' Observation: ok.'


class ThreeTurns(mtflow.Scheduler):

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        return bool(self.max_turns and current_turn >= self.max_turns)

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        ids = list(response_choice.token_ids or [])
        if current_turn % 2:
            infer_request.messages.append({'role': 'user', 'content': f'Go on ({current_turn}).'})
            return {'infer_request': infer_request, 'rollout_infos': {'observations': current_turn}}
        note = self.tokenizer.encode(NOTE, add_special_tokens=False)
        infer_request.messages[-1]['content'] += NOTE
        return {'infer_request': infer_request, 'response_token_ids': ids + note,
                'response_loss_mask': [1] * len(ids) + [0] * len(note)}

    def on_request_finished(self, infer_request: Any, reason: str, turn: int) -> None:
        path = os.environ.get('MTFLOW_E2E_LOG')
        if path:
            with open(path, 'a') as f:
                f.write(json.dumps({'uuid': infer_request.uuid, 'reason': reason, 'turn': turn}) + '\n')


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class UnevenTurns(ThreeTurns):
    """Rank r stops after 1 + 2r turns: on two ranks, rank 0 finishes at turn 1 and must keep
    calling the (collective) rollout with nothing while rank 1 runs turns 2 and 3."""

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        return current_turn >= 1 + 2 * _rank()
