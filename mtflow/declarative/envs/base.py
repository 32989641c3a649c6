"""The environment protocol's shared parts: what one step returns (:class:`StepOutcome`, read from
any ``step`` by :func:`normalize_step`), the per-request seed, and the missing-extra error of a
kind whose library is not installed."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Dict

from mtflow.core.errors import MtflowError
from mtflow.core.images import env_observation
from mtflow.core.seeds import stable_seed
from mtflow.engine.branching import branch_root

__all__ = ['MissingExtra', 'require', 'StepOutcome', 'normalize_step', 'request_seed', 'EnvFailure']


class MissingExtra(ImportError):
    """An environment kind whose library is not installed; names the pip extra."""

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(f"{module!r} is not installed: pip install 'mtflow[{extra}]'")


def require(module: str, extra: str) -> Any:
    """Import an optional library, or raise :class:`MissingExtra` naming the pip extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(module, extra) from None


class EnvFailure(MtflowError):
    """An environment of another library failed for one request (it could not be made, reset or
    stepped; its server is down; its verifier raised). The message names the kind, the environment,
    the step and the library's own error; it fails that request only, never the run."""

    def __init__(self, kind: str, name: str, where: str, exc: BaseException) -> None:
        text = ' '.join(str(exc).split())
        super().__init__(f'{kind} environment {name!r} failed {where}: {type(exc).__name__}'
                         + (f': {text}' if text else ''))


@dataclass
class StepOutcome:
    """One environment step. ``terminated``: the episode reached an end state (its reward is
    final: ``stop_rule:env_done``); ``truncated``: it was cut short, e.g. by a step limit
    (``stop_rule:env_truncated``)."""
    observation: Any  # text, or an Observation with images (mtflow.core.images.env_observation)
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: Dict[str, Any] = field(default_factory=dict)


def normalize_step(out: Any) -> StepOutcome:
    """A :class:`StepOutcome` from what ``step`` returned: a StepOutcome, mtflow's 4-tuple
    ``(observation, reward, done, info)`` (done counts as terminated) or Gymnasium's 5-tuple."""
    if isinstance(out, StepOutcome):
        return out
    if isinstance(out, tuple) and len(out) == 5:
        obs, reward, terminated, truncated, info = out
    elif isinstance(out, tuple) and len(out) == 4:
        obs, reward, terminated, info = out
        truncated = False
    else:
        raise TypeError('env.step must return (observation, reward, done, info), (observation, reward, terminated, '
                        f'truncated, info) or a StepOutcome, not {type(out).__name__}'
                        + (f' of length {len(out)}' if isinstance(out, tuple) else ''))
    return StepOutcome('' if obs is None else env_observation(obs), float(reward or 0.0), bool(terminated),
                       bool(truncated),
                       dict(info) if isinstance(info, dict) else {'info': info})


def request_seed(infer_request: Any, seed: int = 0) -> int:
    """``data_dict['seed']`` when given, else a stable 31-bit number from ``seed`` and the uuid (the
    same request gets the same episode on every run; a branch of a request, ``<uuid>~<k>``
    (``docs/branching.md``), its root's)."""
    data = getattr(infer_request, 'data_dict', None) or {}
    if isinstance(data.get('seed'), int):
        return data['seed']
    return stable_seed(seed, branch_root(getattr(infer_request, 'uuid', None) or ''))
