"""Training on a branched group's tree (``docs/branching.md``): node values and TreeRL's advantages.

A branched run writes, beside its leaves' trajectories, one tree per prompt (``RunResult.trees``,
``StreamGroup.trees``, ``trees.jsonl``): node 0 is the prompt, every other node a run of one
record's turns, with its parent and its leaves. The leaves are ordinary exact-token samples
(:mod:`mtflow.train.samples`); the tree adds credit per node:

* :func:`tree_values`: ``V(n)``, the mean reward of the leaves under node ``n`` (TreeRL's value);
* :func:`tree_advantages`: ``A(n) = (V(n) - V(root)) + (V(n) - V(parent(n)))``, each term
  optional (``global_``, ``local``), scaled by ``1 / sqrt(|leaves(n)|)`` (``weight='sqrt'``,
  TreeRL's reweighting: a node shared by many leaves is trained once per leaf) or not
  (``weight='none'``); the prompt node has ``A = 0``;
* :func:`assign_tree_advantages`: each leaf sample's trained tokens get the advantage of the node
  their turn lies in (``Sample.token_advantages``, which packing uses), glue ``0``.

The functions take the tree records as written (plain dicts) and the leaves' rewards (default:
the ones the tree recorded), so a rescored run's rewards can be passed in.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from mtflow.run.trees import read_tree_lines
from mtflow.train.errors import SampleError
from mtflow.train.samples import Sample

__all__ = ['WEIGHTS', 'read_trees', 'tree_values', 'tree_advantages', 'leaf_path', 'assign_tree_advantages']

#: how a node's advantage is scaled by the leaves under it
WEIGHTS = ('sqrt', 'none')


def read_trees(path: Union[str, Path]) -> Iterator[Dict[str, Any]]:
    """The trees of a run's ``trees.jsonl``, the last line of each root (a resumed run may have
    written a prompt's tree again), in the order their roots first appear
    (:func:`mtflow.run.trees.read_tree_lines`; a missing file has none)."""
    yield from read_tree_lines(path).values()


def _rewards(tree: Mapping[str, Any], rewards: Optional[Mapping[str, float]]) -> Dict[str, Optional[float]]:
    given = tree.get('rewards') or {}
    out: Dict[str, Optional[float]] = {}
    for leaf in tree['leaves']:
        value = rewards.get(leaf) if rewards is not None and leaf in rewards else given.get(leaf)
        out[leaf] = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return out


def tree_values(tree: Mapping[str, Any], rewards: Optional[Mapping[str, float]] = None) -> Dict[int, float]:
    """``{node id: V(node)}``: the mean reward of the leaves under each node (``rewards``: leaf uuid
    -> reward, default the tree's own). A leaf without a numeric reward is an error (a value over
    the others would be biased)."""
    values = _rewards(tree, rewards)
    missing = sorted(leaf for leaf, v in values.items() if v is None)
    if missing:
        raise SampleError(f'tree {tree["root"]}: leaves without a numeric reward: {", ".join(missing)} (pass rewards=)',
                          uuid=missing[0], field='reward')
    out: Dict[int, float] = {}
    for node in tree['nodes']:
        leaves = node['leaves']
        out[node['id']] = sum(values[u] for u in leaves) / len(leaves) if leaves else 0.0
    return out


def tree_advantages(tree: Mapping[str, Any], rewards: Optional[Mapping[str, float]] = None, *,
                    global_: bool = True, local: bool = True, weight: str = 'sqrt') -> Dict[int, float]:
    """``{node id: A(node)}`` (module docstring): TreeRL's global plus local advantage of every
    node, scaled by ``1 / sqrt(leaves under it)`` with ``weight='sqrt'``; ``0`` for the prompt."""
    if weight not in WEIGHTS:
        raise ValueError(f'weight must be one of {WEIGHTS}, not {weight!r}')
    values = tree_values(tree, rewards)
    root = values[0]
    out: Dict[int, float] = {}
    for node in tree['nodes']:
        parent = node['parent']
        if parent is None:
            out[node['id']] = 0.0
            continue
        v = values[node['id']]
        a = (v - root if global_ else 0.0) + (v - values[parent] if local else 0.0)
        leaves = len(node['leaves'])
        out[node['id']] = a / math.sqrt(leaves) if weight == 'sqrt' and leaves else a
    return out


def leaf_path(tree: Mapping[str, Any], leaf: str) -> List[Dict[str, Any]]:
    """The nodes from the prompt down to ``leaf``'s last node, in order."""
    by_id = {n['id']: n for n in tree['nodes']}
    own = [n for n in tree['nodes'] if n['uuid'] == leaf]  # a record's nodes, in the order it made them
    if not own:
        raise SampleError(f'tree {tree["root"]} has no leaf {leaf!r}', uuid=leaf, field='tree')
    path = [max(own, key=lambda n: n['id'])]
    while path[-1]['parent'] is not None:
        path.append(by_id[path[-1]['parent']])
    return path[::-1]


def assign_tree_advantages(samples: Sequence[Sample], trees: Sequence[Mapping[str, Any]],
                           rewards: Optional[Mapping[str, float]] = None, **options: Any) -> List[Sample]:
    """Set ``token_advantages`` on every sample of a leaf of ``trees``: each trained token the
    advantage of the node its turn lies in (:func:`tree_advantages`, ``options`` as there), glue
    and untrained tokens ``0``. Returns ``samples``; a sample of no tree, or whose tokens' turns
    cannot be placed, is an error."""
    by_leaf: Dict[str, Mapping[str, Any]] = {leaf: tree for tree in trees for leaf in tree['leaves']}
    cache: Dict[str, Dict[int, float]] = {}
    for s in samples:
        tree = by_leaf.get(s.uuid)
        if tree is None:
            raise SampleError('the sample is no leaf of the trees given', uuid=s.uuid, field='tree')
        if s.token_turns is None:
            raise SampleError('the turn of each token cannot be placed (turns share assistant messages), so the '
                              'tokens cannot be given their nodes', uuid=s.uuid, turn=s.turns[0], field='tree')
        root = str(tree['root'])
        if root not in cache:
            cache[root] = tree_advantages(tree, rewards, **options)
        advantage = cache[root]
        node_of: Dict[int, float] = {}
        for node in leaf_path(tree, s.uuid)[1:]:
            first, last = node['turns']
            for t in range(first, last + 1):
                node_of[t] = advantage[node['id']]
        s.token_advantages = [0.0 if t is None or not m else node_of.get(t, 0.0)
                              for t, m in zip(s.token_turns, s.loss_mask)]
    return list(samples)
