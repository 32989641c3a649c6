"""The Python form of ``guess_number.yaml``: a plain :class:`mtflow.Scheduler` driving one gym
environment per request. Use it as the starting point for an environment that needs Python
(shared state, a remote simulator): the YAML form covers the common case."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional

from mtflow import Scheduler
from mtflow.accounting.turn_spans import turn_reward_entry
from mtflow.declarative.gym import GuessNumberEnv


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class GymScheduler(Scheduler):
    """Each completion is an action; the environment's observation becomes the next user message;
    ``done`` stops the request with ``stop_rule:env_done``; rewards go to ``rollout_infos``.
    Environments are closed in :meth:`on_request_finished` (every finish path)."""
    finish_reasons = ('stop_rule:env_done', )

    def __init__(self, env_factory: Callable[[], Any] = GuessNumberEnv, max_turns: Optional[int] = None,
                 system_prompt: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(kwargs.pop('infer_engine', None), max_turns, **kwargs)
        self.env_factory = env_factory
        self.system_prompt = system_prompt
        self.envs: Dict[Any, Any] = {}
        self.rewards: Dict[Any, List[float]] = {}
        self.pending: Dict[Any, str] = {}

    @staticmethod
    def key(request: Any) -> Any:
        return getattr(request, 'uuid', None) or id(request)

    async def _env(self, request: Any) -> Any:
        k = self.key(request)
        if k not in self.envs:
            self.envs[k] = self.env_factory()
            self.rewards[k] = []
            await _maybe_await(self.envs[k].reset(request))
        return self.envs[k]

    async def on_trajectory_start(self, requests: List[Any]) -> None:
        for request in requests:
            if self.system_prompt and not (request.messages and request.messages[0]['role'] == 'system'):
                request.messages.insert(0, {'role': 'system', 'content': self.system_prompt})
            await self._env(request)

    async def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        k = self.key(infer_request)
        env = await self._env(infer_request)
        obs, reward, done, info = await _maybe_await(env.step(response_choice.message.content or ''))
        self.rewards[k].append(float(reward))
        infos = {'env_steps': len(self.rewards[k]), 'rewards': list(self.rewards[k]),
                 'reward': float(sum(self.rewards[k])), 'env_info': info,
                 'turn_rewards': [turn_reward_entry(t, r, 'env') for t, r in enumerate(self.rewards[k], 1)]}
        if done:
            infos['stop_rule'] = 'stop_rule:env_done'
            return {'done': True, 'finish_reason': 'stop_rule:env_done', 'rollout_infos': infos}
        if self.max_turns and current_turn >= self.max_turns:
            infos['stop_rule'] = 'max_turns'
            return {'done': True, 'finish_reason': 'max_turns', 'rollout_infos': infos}
        self.pending[k] = str(obs)
        return {'done': False, 'rollout_infos': infos}

    async def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        obs = self.pending.pop(self.key(infer_request))
        infer_request.messages.append({'role': 'user', 'content': obs})
        result: Dict[str, Any] = {'infer_request': infer_request, 'trace_info': {'env_observation': obs[:200]}}
        if response_choice.token_ids:
            ids = list(response_choice.token_ids)
            result.update(response_token_ids=ids, response_loss_mask=[1] * len(ids))
        return result

    async def on_request_finished(self, infer_request: Any, reason: str, turn: int) -> None:
        k = self.key(infer_request)
        self.pending.pop(k, None)
        self.rewards.pop(k, None)
        env = self.envs.pop(k, None)
        if env is not None:
            await _maybe_await(env.close())
