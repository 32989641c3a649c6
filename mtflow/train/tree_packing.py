"""Tree training: a branched group packed as one tree, its shared prefix through the model once.

A branched run (``docs/branching.md``) writes one tree per prompt beside its leaves: node 0 is
the prompt, every other node a run of one record's turns, with ``span`` (``[start, end)`` in the
full exact-id sequence of every leaf under it). Per-leaf packing (:mod:`mtflow.train.packing`)
puts each leaf's whole sequence in the batch, so the shared turns go through the model once per
leaf. :func:`pack_trees` puts each node's tokens in the row once instead, in depth-first order,
each at its position in the leaves' sequences, and :func:`tree_tensors` gives the attention mask
that lets each token see exactly its ancestors: the tokens of its node's ancestor nodes and the
earlier tokens of its own node (a ``[rows, 1, T, T]`` boolean mask, the 4D-mask path of
transformers' SDPA and eager attention). With ``position_ids`` as in the leaves, every token gets
exactly the logits it gets in each leaf's own sequence.

The loss stays the leaves': each token carries one column per leaf of the row (``leaf_mask``,
``leaf_advantages``: each leaf's own mask and advantage of that token, 0 for a leaf the token is
not in), and :func:`tree_policy_loss` sums the clipped policy-gradient term of
:func:`mtflow.train.loop.policy_loss` over the leaves of every token, normalised as the per-leaf
loss is (``'token-mean'``: over every (leaf, trained token) pair; ``'sample-mean'``: each leaf's
mean, averaged), so the loss and its gradients equal per-leaf training on the same leaves
(``tests/train/test_tree_packing.py``: within 1e-5 in float32 on branched runs of the tiny
model). ``reference_loop(..., trees=True)`` steps this way. The token whose logits predict a node's first token is the last token of its parent's
node (``pred_index``), not the token before it in the row.

torch is imported when a function runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from mtflow.train.errors import SampleError
from mtflow.train.packing import token_advantages_of
from mtflow.train.samples import Sample
from mtflow.train.weights import LOSS_AGGREGATIONS, behaviour_logprobs, truncated_is, uncorrected_samples

__all__ = ['TreeRow', 'pack_trees', 'tree_tensors', 'tree_attention_mask', 'tree_token_logprobs', 'tree_policy_loss',
           'tree_train_step', 'tree_token_counts']

#: a rollout logprob a token's leaves may disagree on (they were sampled once, so they agree exactly)
LOGPROB_TOLERANCE = 1e-6


@dataclass
class TreeRow:
    """One row of whole trees, each node's tokens once (every per-token list has the row's length;
    ``leaf_mask`` and ``leaf_advantages`` hold one value per leaf of :attr:`leaves` per token)."""
    input_ids: List[int] = field(default_factory=list)
    #: each token's position in the sequences of the leaves under it
    position_ids: List[int] = field(default_factory=list)
    #: the row index of the token whose logits predict this one (``-1``: a sequence's first token, padding)
    pred_index: List[int] = field(default_factory=list)
    #: the row-local node of each token (``-1``: padding)
    node_index: List[int] = field(default_factory=list)
    #: per row-local node: its ancestors and itself
    node_ancestors: List[List[int]] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    has_logprobs: List[int] = field(default_factory=list)  # 1 where a leaf sharing the token has its rollout logprob
    leaf_mask: List[List[int]] = field(default_factory=list)
    leaf_advantages: List[List[float]] = field(default_factory=list)
    #: the leaf uuids whose columns the row holds, in order
    leaves: List[str] = field(default_factory=list)
    #: the roots of the trees in the row
    roots: List[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)


def _leaf_samples(tree: Mapping[str, Any], by_uuid: Mapping[str, Sample]) -> List[Sample]:
    out = []
    for leaf in tree['leaves']:
        sample = by_uuid.get(leaf)
        if sample is None:
            raise SampleError(f'tree {tree["root"]}: no sample for its leaf', uuid=leaf, field='tree')
        out.append(sample)
    return out


def _children(tree: Mapping[str, Any]) -> Dict[Optional[int], List[Dict[str, Any]]]:
    kids: Dict[Optional[int], List[Dict[str, Any]]] = {}
    for node in tree['nodes']:
        kids.setdefault(node['parent'], []).append(node)
    return kids


def _add_tree(row: TreeRow, tree: Mapping[str, Any], leaves: List[Sample]) -> None:
    """Append ``tree``'s nodes to ``row`` depth first (each node after its ancestors)."""
    column = {s.uuid: len(row.leaves) + k for k, s in enumerate(leaves)}
    by_uuid = {s.uuid: s for s in leaves}
    row.leaves += [s.uuid for s in leaves]
    row.roots.append(str(tree['root']))
    for values in row.leaf_mask:
        values += [0] * len(leaves)
    for values in row.leaf_advantages:
        values += [0.0] * len(leaves)
    width = len(row.leaves)
    advantages = {s.uuid: token_advantages_of(s) for s in leaves}
    kids = _children(tree)
    # (node, the row index of the last token of its nearest ancestor with tokens, its ancestors)
    stack: List[Tuple[Dict[str, Any], int, List[int]]] = [(n, -1, []) for n in reversed(kids.get(None, []))]
    while stack:
        node, before, ancestors = stack.pop()
        local = len(row.node_ancestors)
        row.node_ancestors.append(ancestors + [local])
        span = node.get('span')
        under = [by_uuid[u] for u in node['leaves'] if u in by_uuid]
        if span is None:
            raise SampleError(f'tree {tree["root"]}: node {node["id"]} has no token span (the run kept no exact ids)',
                              uuid=node.get('uuid') or str(tree['root']), field='span')
        start, end = int(span[0]), int(span[1])
        if under and end > start:
            ids = under[0].input_ids[start:end]
            for other in under[1:]:
                if other.input_ids[start:end] != ids:
                    raise SampleError(f'tree {tree["root"]}: node {node["id"]} holds other ids in leaf {other.uuid} '
                                      f'than in leaf {under[0].uuid} (span {start}-{end}): not a shared prefix',
                                      uuid=other.uuid, field='span')
            for k, p in enumerate(range(start, end)):
                _add_token(row, ids[k], p, before, local, under, column, advantages, width)
                before = len(row.input_ids) - 1
        for child in reversed(kids.get(node['id'], [])):
            stack.append((child, before, ancestors + [local]))


def _add_token(row: TreeRow, token: int, position: int, before: int, node: int, under: Sequence[Sample],
               column: Mapping[str, int], advantages: Mapping[str, List[float]], width: int) -> None:
    mask = [0] * width
    adv = [0.0] * width
    logprob: Optional[float] = None
    for s in under:
        c = position - len(s.prompt_ids)  # the token's place in the leaf's completion (< 0: the prompt)
        if c < 0 or not s.loss_mask[c]:
            continue
        mask[column[s.uuid]] = 1
        adv[column[s.uuid]] = advantages[s.uuid][c]
        if s.logprobs is None:  # a leaf without rollout logprobs: no correction from it
            continue
        value = s.logprobs[c]
        if logprob is not None and abs(value - logprob) > LOGPROB_TOLERANCE:
            raise SampleError(f'the rollout logprob of position {position} is {value} in this leaf but {logprob} in '
                              'another leaf sharing the token', uuid=s.uuid, field='logprobs')
        logprob = value
    row.input_ids.append(int(token))
    row.position_ids.append(position)
    row.pred_index.append(before)
    row.node_index.append(node)
    row.logprobs.append(0.0 if logprob is None else float(logprob))
    row.has_logprobs.append(int(logprob is not None))
    row.leaf_mask.append(mask)
    row.leaf_advantages.append(adv)


def _tree_size(tree: Mapping[str, Any]) -> int:
    return sum(max(0, int(n['span'][1]) - int(n['span'][0])) for n in tree['nodes'] if n.get('span') and n['leaves'])


def pack_trees(trees: Sequence[Mapping[str, Any]], samples: Sequence[Sample], row_len: Optional[int] = None,
               pad_id: int = 0) -> List[TreeRow]:
    """Rows of whole trees (``trees``: tree records, ``RunResult.trees`` or ``trees.jsonl``;
    ``samples``: the leaves' samples, advantages assigned), first fit in order into rows of
    ``row_len`` tokens (``None``: all in one row, padded to the longest); a tree is never split.
    A leaf whose trajectory compacted (several segments), a node without a span, a leaf missing
    from ``samples`` or a tree longer than a row is an error naming it."""
    by_uuid: Dict[str, Sample] = {}
    for s in samples:
        if s.segments != 1:
            raise SampleError(f'{s.segments} context segments: a compacted leaf is no path of one tree', uuid=s.uuid,
                              turn=s.turns[0], field='context_segments')
        by_uuid[s.uuid] = s
    rows: List[TreeRow] = []
    for tree in trees:
        size = _tree_size(tree)
        if row_len is not None and size > row_len:
            raise ValueError(f'tree {tree["root"]}: {size} tokens do not fit a row of {row_len} (a tree is never split)')
        row = next((r for r in rows if row_len is None or len(r) + size <= row_len), None)
        if row is None:
            row = TreeRow()
            rows.append(row)
        _add_tree(row, tree, _leaf_samples(tree, by_uuid))
    width = row_len if row_len is not None else max((len(r) for r in rows), default=0)
    for row in rows:
        _fill(row, width, pad_id)
    return rows


def _fill(row: TreeRow, length: int, pad_id: int) -> None:
    extra = length - len(row)
    row.input_ids += [pad_id] * extra
    row.position_ids += [0] * extra
    row.pred_index += [-1] * extra
    row.node_index += [-1] * extra
    row.logprobs += [0.0] * extra
    row.has_logprobs += [0] * extra
    row.leaf_mask += [[0] * len(row.leaves) for _ in range(extra)]
    row.leaf_advantages += [[0.0] * len(row.leaves) for _ in range(extra)]


def tree_attention_mask(node_index: Any, node_ancestors: Sequence[Sequence[Sequence[int]]]) -> Any:
    """``[rows, 1, T, T]`` boolean mask: a token attends to the tokens of its node's ancestors and
    the earlier tokens of its own node (padding to itself, so no row of the softmax is empty)."""
    import torch

    rows, length = node_index.shape
    out = torch.zeros(rows, length, length, dtype=torch.bool)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    for r in range(rows):
        nodes = len(node_ancestors[r])
        anc = torch.zeros(nodes + 1, nodes + 1, dtype=torch.bool)  # the last slot: padding's node -1
        for n, chain in enumerate(node_ancestors[r]):
            anc[n, list(chain)] = True
        index = node_index[r].clone()
        index[index < 0] = nodes
        out[r] = anc[index[:, None], index[None, :]] & causal
        out[r] &= (node_index[r] >= 0)[None, :]
    return (out | torch.eye(length, dtype=torch.bool))[:, None]


def tree_tensors(rows: Sequence[TreeRow]) -> Dict[str, Any]:
    """The rows as torch tensors: ``input_ids``, ``position_ids``, ``pred_index``, ``logprobs``
    ``[rows, T]``; ``leaf_mask`` and ``leaf_advantages`` ``[rows, T, leaves]`` (rows with fewer
    leaves padded with 0 columns); ``attention_mask`` from :func:`tree_attention_mask`;
    ``leaf_id`` ``[rows, leaves]`` (a batch-wide number per leaf, ``-1`` for a padding column)."""
    import torch

    width = max((len(r.leaves) for r in rows), default=0)
    names = sorted({u for r in rows for u in r.leaves})
    number = {u: k for k, u in enumerate(names)}

    def widen(values: List[List[Any]], fill: Any) -> List[List[Any]]:
        return [v + [fill] * (width - len(v)) for v in values]

    node_index = torch.tensor([r.node_index for r in rows], dtype=torch.long)
    return {'input_ids': torch.tensor([r.input_ids for r in rows], dtype=torch.long),
            'position_ids': torch.tensor([r.position_ids for r in rows], dtype=torch.long),
            'pred_index': torch.tensor([r.pred_index for r in rows], dtype=torch.long),
            'logprobs': torch.tensor([r.logprobs for r in rows], dtype=torch.float32),
            'has_logprobs': torch.tensor([r.has_logprobs for r in rows], dtype=torch.bool),
            'leaf_mask': torch.tensor([widen(r.leaf_mask, 0) for r in rows], dtype=torch.float32),
            'leaf_advantages': torch.tensor([widen(r.leaf_advantages, 0.0) for r in rows], dtype=torch.float32),
            'leaf_id': torch.tensor([[number[u] for u in r.leaves] + [-1] * (width - len(r.leaves)) for r in rows],
                                    dtype=torch.long),
            'node_index': node_index,
            'attention_mask': tree_attention_mask(node_index, [r.node_ancestors for r in rows])}


def tree_token_logprobs(model: Any, batch: Dict[str, Any]) -> Any:
    """``[rows, T]``: the model's logprob of each token given its ancestors (the logits of the
    token at ``pred_index``; ``0`` where there is none)."""
    import torch

    logits = model(input_ids=batch['input_ids'], attention_mask=batch['attention_mask'],
                   position_ids=batch['position_ids']).logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    pred = batch['pred_index']
    rows = torch.arange(pred.shape[0])[:, None].expand_as(pred)
    picked = logp[rows, pred.clamp(min=0), batch['input_ids']]
    return torch.where(pred >= 0, picked, torch.zeros_like(picked))


def tree_policy_loss(logp: Any, batch: Dict[str, Any], clip_eps: float = 0.2, tis_cap: Optional[float] = None,
                     agg: str = 'token-mean') -> Any:
    """The per-leaf clipped policy-gradient loss of :func:`mtflow.train.loop.policy_loss`, each
    token's term summed over the leaves it is in (module docstring)."""
    import torch

    if agg not in LOSS_AGGREGATIONS:
        raise ValueError(f'agg must be one of {LOSS_AGGREGATIONS}, not {agg!r}')
    mask, adv = batch['leaf_mask'], batch['leaf_advantages']
    ratio = (logp - logp.detach()).exp()[..., None]
    per = -torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if tis_cap is not None:
        per = per * truncated_is(logp, behaviour_logprobs(logp, batch), cap=tis_cap)[..., None]
    per = per * mask
    if agg == 'token-mean':
        return per.sum() / mask.sum().clamp(min=1)
    ids = batch['leaf_id']
    count = int(ids.max().item()) + 1 if ids.numel() else 0
    slots = ids.clamp(min=0).flatten()
    sums = torch.zeros(count).index_add(0, slots, per.sum(dim=1).flatten())
    tokens = torch.zeros(count).index_add(0, slots, mask.sum(dim=1).flatten())
    live = tokens > 0
    return (sums[live] / tokens[live]).mean() if live.any() else per.sum()


def tree_token_counts(rows: Sequence[TreeRow], samples: Sequence[Sample]) -> Dict[str, int]:
    """What goes through the model: the tree rows' tokens (padding excluded) against the leaves'
    whole sequences (what per-leaf packing feeds)."""
    in_trees = sum(sum(1 for n in r.node_index if n >= 0) for r in rows)
    leaves = {u for r in rows for u in r.leaves}
    return {'tree_tokens': in_trees, 'leaf_tokens': sum(len(s.input_ids) for s in samples if s.uuid in leaves)}


def tree_train_step(model: Any, optimizer: Any, trees: Sequence[Mapping[str, Any]], samples: Sequence[Sample], *,
                    row_len: Optional[int] = None, pad_id: int = 0, clip_eps: float = 0.2,
                    tis_cap: Optional[float] = None, agg: str = 'token-mean',
                    missing_logprobs: str = 'uncorrected') -> Dict[str, Any]:
    """One optimizer step on the leaves of ``trees`` packed as trees (advantages already assigned
    on ``samples``, as for :func:`mtflow.train.loop.train_step`, whose loss and gradients this
    step equals). Returns the loss, the rows, the token counts and the largest trainer-vs-rollout
    logprob gap on the trained tokens."""
    uncorrected = uncorrected_samples(samples, tis_cap is not None, missing_logprobs)
    rows = pack_trees(trees, samples, row_len=row_len, pad_id=pad_id)
    batch = tree_tensors(rows)
    logp = tree_token_logprobs(model, batch)
    loss = tree_policy_loss(logp, batch, clip_eps=clip_eps, tis_cap=tis_cap, agg=agg)
    trained = batch['leaf_mask'].sum(-1) > 0
    gap = None
    known = trained & batch['has_logprobs']
    if bool(known.any()):
        gap = float((logp.detach() - batch['logprobs'])[known].abs().max())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return {'loss': float(loss.detach()), 'rows': len(rows), 'max_logprob_gap': gap,
            'trained_tokens': int(batch['leaf_mask'].sum()), 'uncorrected_samples': len(uncorrected),
            **tree_token_counts(rows, samples)}
