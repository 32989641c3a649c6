"""Where ``mtflow run`` gets its requests: a JSONL file (``dataset: path``), the bundled
guess-the-number set (``dataset: null``), or generated tasks (``dataset: {reasoning_gym: ...}``);
then ``num_generations`` copies of each prompt, the groups GRPO compares.

A copy's uuid is ``<uuid>#<k>`` (k = 0..n-1) and its ``data_dict['group']`` the prompt's uuid;
with ``num_generations: 1`` requests are left as they are (their group is their own uuid).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from mtflow.core.protocol import RolloutInferRequest
from mtflow.engine.branching import branch_root
from mtflow.data import DatasetError, count_prompts, iter_located_prompts, iter_prompts
from mtflow.data.reasoning_gym import ReasoningGymSpec, check_spec
from mtflow.data.reasoning_gym import count_requests as count_generated_requests
from mtflow.data.reasoning_gym import iter_requests as iter_generated_requests

__all__ = ['DATASET_KINDS', 'check_dataset_mapping', 'load_requests', 'count_requests', 'iter_requests',
           'expand_groups', 'iter_groups', 'group_of', 'first_requests']

#: the keys a ``dataset:`` mapping may have (one of them)
DATASET_KINDS = ('reasoning_gym', )


def check_dataset_mapping(value: Dict[str, Any]) -> Dict[str, Any]:
    """Validate a ``dataset:`` mapping; ``ValueError`` naming the problem."""
    if set(value) - set(DATASET_KINDS) or len(value) != 1:
        raise ValueError(f'a dataset mapping has one key, one of: {", ".join(DATASET_KINDS)} (got '
                         f'{", ".join(map(str, value)) or "none"}); a JSONL file is given as a path')
    try:
        check_spec(value['reasoning_gym'])
    except ImportError as exc:
        raise ValueError(str(exc)) from None
    return value


def load_requests(dataset: Any, path: Optional[Any], limit: Optional[int] = None,
                  num_generations: int = 1) -> List[RolloutInferRequest]:
    """The run's requests as a list (tests, small tools; ``mtflow run`` streams them with
    :func:`iter_requests`). ``dataset`` is the run config's value; ``path`` its resolved path (a
    string dataset) or ``None``. ``limit`` counts prompts (before the copies)."""
    return list(iter_requests(dataset, path, limit, num_generations))


def _spec(dataset: Dict[str, Any]) -> ReasoningGymSpec:
    try:
        return check_spec(dataset['reasoning_gym'])
    except (ValueError, ImportError) as exc:
        raise DatasetError(f'dataset: {exc}') from None


def count_requests(dataset: Any, path: Optional[Any], limit: Optional[int] = None, num_generations: int = 1) -> int:
    """How many requests :func:`iter_requests` yields, holding none: a JSONL file is checked line
    by line (a bad line is reported before the run starts); a generated dataset is checked by its
    spec (nothing is generated)."""
    if isinstance(dataset, dict):
        prompts = count_generated_requests(_spec(dataset), limit)
    else:
        prompts = count_prompts(path, limit)
    return prompts * max(num_generations, 1)


def iter_requests(dataset: Any, path: Optional[Any], limit: Optional[int] = None, num_generations: int = 1, *,
                  check_unique: bool = True) -> Iterator[RolloutInferRequest]:
    """The requests of :func:`load_requests`, one at a time (what ``mtflow run`` streams, locally
    and to Ray actors): the run holds only its batch, whatever the dataset's size.
    ``check_unique=False`` skips the uuid table of a JSONL file already checked by
    :func:`count_requests`."""
    if isinstance(dataset, dict):
        prompts: Iterable[RolloutInferRequest] = iter_generated_requests(_spec(dataset), limit)
    else:
        prompts = iter_prompts(path, limit=limit, check_unique=check_unique)
    return iter_groups(prompts, num_generations)


def first_requests(dataset: Any, path: Optional[Any], n: int) -> List[Tuple[str, RolloutInferRequest]]:
    """The first ``n`` prompts with where each comes from (``file:line``, or the generated task),
    for the checks that compare a scheduler with its data before the run (``answer.field``)."""
    if isinstance(dataset, dict):
        spec = _spec(dataset)
        return [(f'dataset reasoning_gym {spec.name} task {k}', r)
                for k, r in enumerate(iter_generated_requests(spec, n))]
    return list(iter_located_prompts(path, limit=n, check_unique=False))


def iter_groups(requests: Iterable[RolloutInferRequest], n: int) -> Iterator[RolloutInferRequest]:
    """``n`` copies of each request, next to each other (one GRPO group), lazily."""
    for r in requests:
        if n <= 1:
            yield r
            continue
        for k in range(n):
            c = copy.deepcopy(r)
            c.uuid = f'{r.uuid}#{k}'
            c.data_dict = {**(c.data_dict or {}), 'group': r.uuid}
            yield c


def expand_groups(requests: List[RolloutInferRequest], n: int) -> List[RolloutInferRequest]:
    """``n`` copies of each request, next to each other (one GRPO group)."""
    return requests if n <= 1 else list(iter_groups(requests, n))


def group_of(uuid: str, data_dict: Optional[Dict[str, Any]] = None) -> str:
    """A request's group: ``data_dict['group']``, else its uuid without the ``~<k>`` suffixes of a
    branch (``docs/branching.md``: every leaf of a tree is in its root's group) and without a
    ``#<k>`` copy suffix (what a trajectory line gives: it has no ``data_dict``)."""
    if data_dict and isinstance(data_dict.get('group'), str):
        return data_dict['group']
    root = branch_root(uuid)
    head, sep, tail = root.rpartition('#')
    return head if sep and tail.isdigit() else root
