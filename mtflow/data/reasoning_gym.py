"""reasoning-gym as a prompt source and a reward: ``dataset: {reasoning_gym: {name, size, seed,
config}}`` in a run config generates the prompts; the task's own ``score_answer`` scores the
model's answer.

Each request carries ``data_dict['reasoning_gym'] = {name, size, seed, config, index}`` (plain
JSON), so the entry is regenerated deterministically where the answer is scored (in another
process too): reasoning-gym's entries hold Python objects (tuples, sets) that JSON would not
round-trip. ``data_dict['answer']`` is the reference answer, for reading trajectories.

Use in a scheduler YAML (see ``schedulers/reasoning_gym.yaml``)::

    answer:
      pattern: '<answer>(.*?)</answer>'
      field: reasoning_gym
      compare: mtflow.data.reasoning_gym:is_correct      # score_answer(answer, entry) == 1.0
    reward: mtflow.data.reasoning_gym:reward             # score_answer of the final answer

``reasoning_gym`` is imported only here, when a config names it (``pip install
'mtflow[reasoning-gym]'``).
"""
from __future__ import annotations

import difflib
import functools
import json
import re
from typing import Any, Dict, Iterator, List, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mtflow.core.protocol import RolloutInferRequest

__all__ = ['ReasoningGymSpec', 'check_spec', 'make_requests', 'score', 'is_correct', 'reward', 'entry_of']


class ReasoningGymSpec(BaseModel):
    """The ``reasoning_gym:`` mapping of a run config's ``dataset``."""
    model_config = ConfigDict(extra='forbid')
    name: str = Field(description="A reasoning-gym task, e.g. 'basic_arithmetic', 'leg_counting'.")
    size: int = Field(16, ge=1, description='How many tasks to generate.')
    seed: int = Field(0, description='The generator seed: the same seed gives the same tasks.')
    config: Dict[str, Any] = Field(default_factory=dict,
                                   description="The task's own config keys (e.g. max_terms, max_digits).")
    system: Optional[str] = Field(None, description='A system message before each question (the scheduler may '
                                  'add its own system_prompt instead).')

    @field_validator('config')
    @classmethod
    def _plain(cls, v: Dict[str, Any]) -> Dict[str, Any]:
        try:
            json.dumps(v)
        except (TypeError, ValueError) as exc:
            raise ValueError(f'config must be plain YAML data: {exc}') from None
        return v


def _require() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("reasoning-gym is not installed: pip install 'mtflow[reasoning-gym]'") from None
    return reasoning_gym


@functools.lru_cache(maxsize=32)
def _dataset(name: str, size: int, seed: int, config_json: str) -> Any:
    rg = _require()
    return rg.create_dataset(name, size=size, seed=seed, **json.loads(config_json))


def _dataset_of(spec: Dict[str, Any]) -> Any:
    return _dataset(spec['name'], int(spec['size']), int(spec['seed']),
                    json.dumps(spec.get('config') or {}, sort_keys=True))


def check_spec(data: Any) -> ReasoningGymSpec:
    """A validated spec; ``ValueError`` naming the problem (an unknown task lists the known
    ones; a config key the task does not have is reasoning-gym's own message)."""
    try:
        spec = ReasoningGymSpec.model_validate(data)
    except ValidationError as exc:
        raise ValueError('; '.join(f"reasoning_gym.{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}"
                                   for e in exc.errors(include_url=False))) from None
    rg = _require()
    known = sorted(rg.factory.DATASETS)
    if spec.name not in known:
        close = difflib.get_close_matches(spec.name, known, n=5, cutoff=0.6)
        raise ValueError(f'reasoning_gym.name: unknown task {spec.name!r}'
                         + (f' (similar: {", ".join(close)})' if close else f' ({len(known)} known, e.g. '
                            f'{", ".join(known[:6])})'))
    try:
        _dataset_of(spec.model_dump())
    except Exception as exc:
        raise ValueError(f'reasoning_gym.config: {spec.name} rejects it: {type(exc).__name__}: {exc}') from None
    return spec


def make_requests(spec: ReasoningGymSpec, limit: Optional[int] = None) -> List[RolloutInferRequest]:
    """One request per generated task: the question as the user message."""
    return list(iter_requests(spec, limit))


def count_requests(spec: ReasoningGymSpec, limit: Optional[int] = None) -> int:
    """How many requests :func:`iter_requests` yields (nothing is generated)."""
    return spec.size if limit is None else min(spec.size, limit)


def iter_requests(spec: ReasoningGymSpec, limit: Optional[int] = None) -> Iterator[RolloutInferRequest]:
    """The requests of :func:`make_requests`, generated one at a time (a streaming run holds only
    its batch; reasoning-gym builds entry ``i`` from ``seed`` and ``i`` alone)."""
    ds = _dataset_of(spec.model_dump())
    for i in range(count_requests(spec, limit)):
        entry = ds[i]
        messages = ([{'role': 'system', 'content': spec.system}] if spec.system else []) + [
            {'role': 'user', 'content': entry['question']}]
        data = {'reasoning_gym': {'name': spec.name, 'size': spec.size, 'seed': spec.seed, 'config': spec.config,
                                  'index': i},
                'answer': _plain(entry.get('answer'))}
        yield RolloutInferRequest(messages=messages, data_dict=data, uuid=f'{spec.name}-{spec.seed}-{i}')


def _plain(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def entry_of(ref: Dict[str, Any]) -> Dict[str, Any]:
    """The task entry a request's ``data_dict['reasoning_gym']`` names (regenerated)."""
    if not isinstance(ref, dict) or not {'name', 'size', 'seed', 'index'} <= set(ref):
        raise ValueError("data_dict['reasoning_gym'] must hold name, size, seed and index (made by a "
                         'reasoning_gym dataset)')
    return _dataset_of(ref)[int(ref['index'])]


def score(answer: Optional[str], ref: Dict[str, Any]) -> float:
    """The task's own ``score_answer(answer, entry)`` (0.0 for no answer)."""
    if answer is None:
        return 0.0
    return float(_dataset_of(ref).score_answer(answer, entry_of(ref)))


def is_correct(answer: str, ref: Dict[str, Any]) -> bool:
    """For ``answer.compare``: full marks from ``score_answer``."""
    return score(answer, ref) >= 1.0


_TAG = re.compile(r'<answer>(.*?)</answer>', re.DOTALL)


def reward(infer_request: Any, rollout_infos: Dict[str, Any]) -> float:
    """For ``reward:``: ``score_answer`` of the final turn's answer (``rollout_infos['answer']``,
    read by the scheduler's ``answer`` section; without one, the last ``<answer>...</answer>`` of
    the last assistant message, as reasoning-gym's ``extract_answer``)."""
    data = getattr(infer_request, 'data_dict', None) or {}
    ref = data.get('reasoning_gym')
    if 'answer' in rollout_infos:
        answer = rollout_infos['answer']
    else:
        last = next((m.get('content') or '' for m in reversed(infer_request.messages) if m.get('role') == 'assistant'),
                    '')
        found = _TAG.findall(last)
        answer = found[-1].strip() if found else None
    return score(answer, ref)
