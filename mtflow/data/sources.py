"""Where ``mtflow run`` gets its requests: a JSONL file (``dataset: path``), the bundled
guess-the-number set (``dataset: null``), or generated tasks (``dataset: {reasoning_gym: ...}``);
then ``num_generations`` copies of each prompt, the groups GRPO compares.

A copy's uuid is ``<uuid>#<k>`` (k = 0..n-1) and its ``data_dict['group']`` the prompt's uuid;
with ``num_generations: 1`` requests are left as they are (their group is their own uuid).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional

from ..protocol import RolloutInferRequest
from . import DatasetError, read_prompts

__all__ = ['DATASET_KINDS', 'check_dataset_mapping', 'load_requests', 'expand_groups', 'group_of']

#: the keys a ``dataset:`` mapping may have (one of them)
DATASET_KINDS = ('reasoning_gym', )


def check_dataset_mapping(value: Dict[str, Any]) -> Dict[str, Any]:
    """Validate a ``dataset:`` mapping; ``ValueError`` naming the problem."""
    if set(value) - set(DATASET_KINDS) or len(value) != 1:
        raise ValueError(f'a dataset mapping has one key, one of: {", ".join(DATASET_KINDS)} (got '
                         f'{", ".join(map(str, value)) or "none"}); a JSONL file is given as a path')
    from .reasoning_gym import check_spec
    try:
        check_spec(value['reasoning_gym'])
    except ImportError as exc:
        raise ValueError(str(exc)) from None
    return value


def load_requests(dataset: Any, path: Optional[Any], limit: Optional[int] = None,
                  num_generations: int = 1) -> List[RolloutInferRequest]:
    """The run's requests. ``dataset`` is the run config's value; ``path`` its resolved path (a
    string dataset) or ``None``. ``limit`` counts prompts (before the copies)."""
    if isinstance(dataset, dict):
        from .reasoning_gym import check_spec, make_requests
        try:
            spec = check_spec(dataset['reasoning_gym'])
        except (ValueError, ImportError) as exc:
            raise DatasetError(f'dataset: {exc}') from None
        requests = make_requests(spec, limit)
    else:
        requests = read_prompts(path, limit=limit)
    return expand_groups(requests, num_generations)


def expand_groups(requests: List[RolloutInferRequest], n: int) -> List[RolloutInferRequest]:
    """``n`` copies of each request, next to each other (one GRPO group)."""
    if n <= 1:
        return requests
    out: List[RolloutInferRequest] = []
    for r in requests:
        for k in range(n):
            c = copy.deepcopy(r)
            c.uuid = f'{r.uuid}#{k}'
            c.data_dict = {**(c.data_dict or {}), 'group': r.uuid}
            out.append(c)
    return out


def group_of(uuid: str, data_dict: Optional[Dict[str, Any]] = None) -> str:
    """A request's group: ``data_dict['group']``, else its uuid up to ``#``."""
    if data_dict and isinstance(data_dict.get('group'), str):
        return data_dict['group']
    return uuid.split('#', 1)[0]
