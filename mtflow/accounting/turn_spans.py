"""Per-turn rewards and the tokens they belong to.

Environments reward each step, tools can reward each call, and a ``turn_reward`` hook can score
each reply; a trainer that credits turns (turn-level advantages, GiGPO, a turn discount) needs each
such reward next to the token span of the turn it rewards. Schedulers record
``rollout_infos['turn_rewards']`` as ``[{'turn': t, 'reward': r, 'source': s}, ...]`` (the
YAML scheduler does it for ``env``, ``tools`` and ``turn_reward``; the executor does it for a
Python scheduler's ``turn_reward`` hook, or ``Executor(turn_reward=fn)``); a hook's value is
checked by :func:`checked_turn_reward`, the one rule both use. When the output is built this
module adds where turn ``t``'s tokens are in ``response_token_ids``:

* ``segment``: the index of the turn's segment (``response_token_ids[segment]``);
* ``span``: ``[start, end)`` of that segment in the flattened ids (``sum(response_token_ids, [])``).

Both are set only when the trajectory has one segment per turn (a turn that continued the
previous assistant message shares its segment: then they are ``None`` and ``turn`` is what
locates it). The trajectory reward (``rollout_infos['reward']``) is unchanged.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from mtflow.core.errors import SchedulerResultError

__all__ = ['TURN_REWARDS_KEY', 'HOOK_SOURCE', 'turn_reward_entry', 'checked_turn_reward', 'merged_entries',
           'with_spans']

#: the ``rollout_infos`` key of the per-turn rewards
TURN_REWARDS_KEY = 'turn_rewards'
#: the ``source`` of an entry a ``turn_reward`` hook returned (YAML or Python alike)
HOOK_SOURCE = 'turn_reward'


def turn_reward_entry(turn: int, reward: float, source: str) -> Dict[str, Any]:
    """One per-turn reward as schedulers record it."""
    return {'turn': int(turn), 'reward': float(reward), 'source': str(source)}


def checked_turn_reward(value: Any, turn: int, uuid: Optional[str]) -> Optional[Dict[str, Any]]:
    """The entry of what a ``turn_reward`` hook returned for ``turn``: a number is recorded (source
    ``turn_reward``), ``None`` records nothing, anything else is a :class:`SchedulerResultError`
    naming the request, the turn and the field (it fails that request only)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SchedulerResultError(f'turn_reward must return a number or None, got {type(value).__name__}',
                                   uuid=uuid, turn=turn, field='turn_reward')
    return turn_reward_entry(turn, value, HOOK_SOURCE)


def merged_entries(scheduler_entries: Any, hook_entries: List[Dict[str, Any]]) -> Any:
    """The scheduler's own entries (``rollout_infos``) and the executor's hook entries, in turn
    order (a turn's scheduler entries first); the scheduler's list as it is when there are none
    of the executor's, so that outputs without the hook are unchanged."""
    if not hook_entries:
        return scheduler_entries
    both = list(scheduler_entries or ()) + list(hook_entries)
    return sorted(both, key=lambda e: int(e.get('turn', 0)))


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
