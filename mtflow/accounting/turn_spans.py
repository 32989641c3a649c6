"""Per-turn rewards and the tokens they belong to.

Environments reward each step, tools can reward each call, and a ``turn_reward`` hook can score
each reply; a trainer that credits turns (turn-level advantages, GiGPO, a turn discount) needs each
such reward next to the token span of the turn it rewards. Schedulers record
``rollout_infos['turn_rewards']`` as ``[{'turn': t, 'reward': r, 'source': s}, ...]`` (the
YAML scheduler does it for ``env``, ``tools`` and ``turn_reward``); when the output is built this
module adds where turn ``t``'s tokens are in ``response_token_ids``:

* ``segment``: the index of the turn's segment (``response_token_ids[segment]``);
* ``span``: ``[start, end)`` of that segment in the flattened ids (``sum(response_token_ids, [])``).

Both are set only when the trajectory has one segment per turn (a turn that continued the
previous assistant message shares its segment: then they are ``None`` and ``turn`` is what
locates it). The trajectory reward (``rollout_infos['reward']``) is unchanged.
"""
from __future__ import annotations

from typing import Any, Dict, List

__all__ = ['TURN_REWARDS_KEY', 'turn_reward_entry', 'with_spans']

#: the ``rollout_infos`` key of the per-turn rewards
TURN_REWARDS_KEY = 'turn_rewards'


def turn_reward_entry(turn: int, reward: float, source: str) -> Dict[str, Any]:
    """One per-turn reward as schedulers record it."""
    return {'turn': int(turn), 'reward': float(reward), 'source': str(source)}


def with_spans(entries: Any, ids: Any, num_turns: int) -> List[Dict[str, Any]]:
    """``entries`` with ``segment`` and ``span`` added from the trajectory's id segments."""
    segments = ids if isinstance(ids, list) and all(isinstance(s, list) for s in ids) else None
    per_turn = segments is not None and len(segments) == num_turns
    starts: List[int] = []
    if per_turn:
        offset = 0
        for seg in segments:
            starts.append(offset)
            offset += len(seg)
    out = []
    for entry in entries or ():
        item = dict(entry)
        k = int(item.get('turn', 0)) - 1
        if per_turn and 0 <= k < len(segments):
            item['segment'], item['span'] = k, [starts[k], starts[k] + len(segments[k])]
        else:
            item['segment'], item['span'] = None, None
        out.append(item)
    return out
