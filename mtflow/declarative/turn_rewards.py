"""The YAML scheduler's per-turn rewards: environment steps, tool rewards, the ``turn_reward`` hook.

Each is recorded for the turn it rewards as ``{'turn', 'reward', 'source'}`` in
``rollout_infos['turn_rewards']`` (``env``: the environment's step reward; ``tools``: the sum
of the ``reward: {ok, error}`` of the turn's calls, for tools that declare one;
``turn_reward``: what the config's hook returned, ``None`` records nothing). The output adds each
turn's token span (``mtflow.accounting.turn_spans``); the trajectory reward is untouched.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from mtflow.accounting.turn_spans import TURN_REWARDS_KEY, checked_turn_reward, turn_reward_entry
from mtflow.core.registry import resolve_reference
from mtflow.declarative.request_state import RequestState, maybe_await
from mtflow.declarative.schema import SchedulerConfig
from mtflow.tools.runner import ToolResult

__all__ = ['TurnRewards']


class TurnRewards:
    """What the config says about per-turn rewards, applied to one request's state at a time."""

    def __init__(self, config: SchedulerConfig, base_dir: Optional[str]) -> None:
        self.hook = resolve_reference(config.turn_reward, base_dir) if config.turn_reward else None
        self.tool_rewards = {t.name: t.reward for t in config.tools if t.reward is not None}

    def env(self, state: RequestState, turn: int, reward: float) -> None:
        state.turn_rewards.append(turn_reward_entry(turn, reward, 'env'))

    def tools(self, state: RequestState, turn: int, results: List[ToolResult]) -> None:
        if not self.tool_rewards:
            return
        total, rewarded = 0.0, False
        for result in results:
            spec = self.tool_rewards.get(result.name)
            if spec is not None:
                total += spec.ok if result.ok else spec.error
                rewarded = True
        if rewarded:
            state.turn_rewards.append(turn_reward_entry(turn, total, 'tools'))

    async def hook_reward(self, state: RequestState, request: Any, completion: str, infos: Dict[str, Any],
                          turn: int) -> None:
        if self.hook is None:
            return
        value = await maybe_await(self.hook(request, completion, dict(infos), turn))
        entry = checked_turn_reward(value, turn, getattr(request, 'uuid', None))
        if entry is not None:
            state.turn_rewards.append(entry)

    @staticmethod
    def infos(state: RequestState) -> Dict[str, Any]:
        """The ``rollout_infos`` entry (a copy: later turns add to the state's list)."""
        return {TURN_REWARDS_KEY: [dict(e) for e in state.turn_rewards]} if state.turn_rewards else {}
