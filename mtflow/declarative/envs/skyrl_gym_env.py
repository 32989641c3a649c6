"""SkyRL's text environments (``skyrl-gym``: ``BaseTextEnv``) as YAML environments, through their
own API: ``skyrl_gym.make(id, env_config=..., extras=...)``, ``init(prompt) -> (prompt, info)``,
``step(action) -> {observations, reward, done, metadata}``, ``close()``.

A SkyRL environment is made for one episode from its dataset row (``extras``: ``reward_spec``,
``extra_info``, ``max_turns``...), so each request makes its own at reset, from its
``data_dict`` (a JSONL row's keys other than the prompt land there) over ``extras`` of the config.
``init`` may rewrite the prompt (the conversation then starts from its prompt); each step's
``observations`` (chat messages) are the next message, their texts joined; ``done`` stops with
``stop_rule:env_done``; each step's reward is the environment's own (GSM8K's ``compute_score``, a
multi-turn env's per-turn format reward...). ``postprocessed_action`` is kept in ``env_info``:
the model's tokens stay what it sampled. A failure of ``make``, ``init`` or ``step`` (an
assertion on a missing ``reward_spec``, an exception in the reward) fails that request with
:class:`EnvFailure`, naming the environment and the step.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from mtflow.core.registry import resolve_reference
from mtflow.declarative.envs.base import EnvFailure, StepOutcome, require
from mtflow.declarative.envs.config import SkyRLGymConfig

__all__ = ['SkyRLGymEnv', 'skyrl_gym_factory']

KIND = 'skyrl-gym'


class SkyRLGymEnv:
    """One request's SkyRL environment."""

    def __init__(self, config: SkyRLGymConfig, make: Callable[..., Any]) -> None:
        self.config = config
        self.make = make
        self.env: Any = None
        self.steps = 0

    def reset(self, infer_request: Any) -> Optional[str]:
        data = getattr(infer_request, 'data_dict', None) or {}
        extras = {**self.config.extras, **data}
        try:
            self.env = self.make(env_config=dict(self.config.env_config), extras=extras)
            prompt = [dict(m) for m in infer_request.messages]
            out = self.env.init(prompt)
        except Exception as exc:
            raise EnvFailure(KIND, self.config.id, 'at reset (make and init)', exc) from exc
        new_prompt = out[0] if isinstance(out, tuple) else out
        if isinstance(new_prompt, list) and new_prompt != prompt:
            infer_request.messages[:] = [dict(m) for m in new_prompt]
        return None

    def step(self, action: str) -> StepOutcome:
        self.steps += 1
        try:
            out = self.env.step(action)
            reward = float(out['reward'] or 0.0)
        except Exception as exc:
            raise EnvFailure(KIND, self.config.id, f'at step {self.steps}', exc) from exc
        info: Dict[str, Any] = dict(out.get('metadata') or {})
        if out.get('postprocessed_action') is not None:
            info['postprocessed_action'] = out['postprocessed_action']
        return StepOutcome(observation_text(out.get('observations')), reward, bool(out['done']), False, info)

    def close(self) -> None:
        env, self.env = self.env, None
        if env is not None:
            env.close()


def observation_text(observations: Any) -> str:
    """The text of a step's observations: chat messages (their contents joined), or text."""
    if isinstance(observations, list):
        parts: List[str] = [str(m.get('content') or '') if isinstance(m, dict) else str(m) for m in observations]
        return '\n'.join(p for p in parts if p)
    return '' if observations is None else str(observations)


def skyrl_gym_factory(config: SkyRLGymConfig, base_dir: Optional[str] = None) -> Callable[[], SkyRLGymEnv]:
    """Check the id now (a registered one, or ``module:Class``); each request makes its own."""
    sg = require('skyrl_gym', 'skyrl-gym')
    if ':' in config.id:
        cls = resolve_reference(config.id, base_dir)

        def make(**kwargs: Any) -> Any:
            return cls(**kwargs)
    else:
        if config.id not in sg.registry:
            raise ValueError(f'no skyrl-gym environment {config.id!r}; registered: {", ".join(sorted(sg.registry))}')

        def make(**kwargs: Any) -> Any:
            return sg.make(config.id, **kwargs)
    return lambda: SkyRLGymEnv(config, make)
