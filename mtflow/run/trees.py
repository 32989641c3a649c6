"""A branched run's trees in the run directory (``docs/branching.md``): written whole, checked whole.

A prompt of a branched run is a tree of leaves, and a trainer needs the whole tree: a tree short
of a leaf has the wrong node values, and a tree mixed from two runs of its prompt has leaves the
tree record does not describe. So the run directory holds a prompt's leaves only together with
its tree:

* the writers (``mtflow run``'s batches, its streams, the Ray driver) write a tree's leaves
  together, then its line of ``trees.jsonl`` (:meth:`mtflow.run.store.RunStore.write_trees`
  flushes the leaves first); a tree an interrupt cut (some leaf unfinished) goes whole to
  ``interrupted.jsonl``, its finished leaves too, and runs again from its prompt on ``--resume``
  (:func:`whole_trees` says which);
* ``--resume`` skips every prompt with a leaf on disk (:func:`prompts_of`: a leaf's uuid names
  its root, ``q1~2~1`` -> ``q1``), so no prompt runs twice into one tree, and reports each tree
  that is still short (:func:`short_trees`: its line is missing, or names a leaf that is not on
  disk: a crash between the leaves' fsync and the tree's line, a torn last line, a run written
  before trees were written whole); the run then exits 1, naming them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Sequence, Set, Tuple, Union

from mtflow.engine.branching import branch_root
from mtflow.run.files import TREES

__all__ = ['read_tree_lines', 'prompts_of', 'whole_trees', 'ShortTree', 'short_trees']


def read_tree_lines(path: Union[str, Path]) -> Dict[str, Dict[str, Any]]:
    """The trees of a ``trees.jsonl`` by root, the last line of each (a resumed run may have written
    a prompt's tree again), in the order their roots first appear; ``{}`` when there is no file."""
    latest: Dict[str, Dict[str, Any]] = {}
    path = Path(path)
    if not path.is_file():
        return latest
    with open(path, encoding='utf-8') as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                tree = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f'{path}:{no}: not a tree record: {exc.msg}') from None
            latest[str(tree['root'])] = tree
    return latest


def prompts_of(uuids: Iterable[str]) -> Set[str]:
    """The prompts (tree roots) the leaves ``uuids`` belong to."""
    return {branch_root(str(u)) for u in uuids}


def whole_trees(trees: Sequence[Dict[str, Any]], finished: Set[str]) -> Tuple[List[Dict[str, Any]], Set[str]]:
    """``(the trees every leaf of which is in finished, the leaves of the other trees)``."""
    whole, cut = [], set()
    for tree in trees:
        leaves = [str(u) for u in tree['leaves']]
        if all(u in finished for u in leaves):
            whole.append(tree)
        else:
            cut.update(leaves)
    return whole, cut


@dataclass(frozen=True)
class ShortTree:
    """A prompt whose tree is not whole on disk: its leaves there, and why it is short."""
    root: str
    on_disk: int
    why: str

    def line(self) -> str:
        return f'{self.root} ({self.on_disk} leaves on disk; {self.why})'

    def to_dict(self) -> Dict[str, Any]:
        return {'root': self.root, 'leaves_on_disk': self.on_disk, 'why': self.why}


def short_trees(out_dir: Union[str, Path], done: Iterable[str]) -> List[ShortTree]:
    """The trees of the prompts with a leaf in ``done`` that are not whole on disk."""
    trees = read_tree_lines(Path(out_dir) / TREES)
    done = {str(u) for u in done}
    on_disk: Dict[str, int] = {}
    for uuid in done:
        root = branch_root(uuid)
        on_disk[root] = on_disk.get(root, 0) + 1
    short = []
    for root in sorted(on_disk):
        tree = trees.get(root)
        if tree is None:
            short.append(ShortTree(root, on_disk[root], f'no line in {TREES}'))
            continue
        missing = [str(u) for u in tree['leaves'] if str(u) not in done]
        if missing:
            short.append(ShortTree(root, on_disk[root], f'{len(missing)} of its {len(tree["leaves"])} leaves missing: '
                                   f'{", ".join(missing[:3])}' + (' ...' if len(missing) > 3 else '')))
    return short
