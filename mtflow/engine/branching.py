"""Branching rollouts: a request's machine forked into children that share its history exactly.

A GRPO group of N independent copies regenerates (and prefills) the same early turns N times. A
branched group grows a tree instead: where a :class:`Branching` policy says (a turn, a state,
after tool calls, a hook, a high-entropy turn), the request's record is *forked*: the record goes
on as the first branch and ``copies - 1`` children are born in the same state with the same
history (messages, token record, images, infos, the scheduler's own per-request state through its
``on_fork`` hook, the environment when it can be copied or replayed). From then on each child is a
machine of its own; every record of the tree is a leaf and its output an ordinary, complete
trajectory. ``docs/branching.md`` has the whole story; this module holds the parts:

* :class:`Branching`: the policy (where, how many copies, the tree's leaf budget), checked once;
* :class:`Branch`: what a record keeps about its place in the tree (``RequestRecord.branch``);
* :class:`Tree`: what the records of one root share (the live count, the forks, the prompt a
  tree short of its leaf budget is topped up from);
* :func:`fork_request` and :func:`child_record`: the copies a fork makes (the token record and
  the images are shared, never copied: the prefix is held once);
* :func:`tree_record`: the tree as written beside the trajectories (nodes, parents, turns, token
  spans, rewards, values).

The move itself (the scheduler's hook, the backend told, the children entering the run) is
:mod:`mtflow.engine.moves`'s, the only place states change; drivers only take the new records
(:meth:`mtflow.engine.run_state.RunState.take_entering`).

**The leaf budget** (``leaves=N``): the root holds N; a fork into ``k`` branches splits the
record's budget as evenly as it goes (the record keeps the first share), and a record whose
budget is 1 never forks. Each record's share depends on its own path only, so every driver
forks the same records the same way. A record that finishes with more than 1 (its forks never
came: the episode ended first) gives the rest back at once as copies of the root's prompt
(``fork`` from ``pending``, budget 1 each): a group has exactly N leaves.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from mtflow.accounting.token_record import RECORD_ATTR, record_of
from mtflow.core.errors import ForkRefused
from mtflow.core.keys import coerce_fields
from mtflow.core.machine import GENERATING, PENDING, TOOL_STEP, WAITING_STATES, RequestRecord
from mtflow.core.protocol import extract_logprobs

__all__ = ['Branching', 'Branch', 'Tree', 'BRANCH_STATES', 'AT_KEYS', 'CHILD_SEP', 'fork_request', 'child_record',
           'child_uuid', 'branch_root', 'plant', 'tree_record', 'trees_of', 'split_budget', 'turn_entropy',
           'fork_point']

#: what ``at: {state: ...}`` may name: before the model's turn, or after its output is applied
BRANCH_STATES = ('generating', 'tool_step')
#: the keys of ``at`` (a dict); all that are given must hold
AT_KEYS = ('turn', 'state', 'tool_calls', 'entropy', 'hook')
#: a child's uuid is its parent's, ``~`` and its number (``r1~2``, ``r1~2~1``)
CHILD_SEP = '~'
_ENTROPY_KEYS = ('above', 'rise')


def child_uuid(parent: str, number: int) -> str:
    return f'{parent}{CHILD_SEP}{number}'


def branch_root(uuid: str) -> str:
    """The uuid of the tree root a branch's uuid belongs to (``r1~2~1`` -> ``r1``); a uuid that is
    not a branch's is its own root."""
    head = str(uuid)
    while True:
        stem, sep, tail = head.rpartition(CHILD_SEP)
        if not sep or not stem or not tail.isdigit():
            return head
        head = stem


def split_budget(budget: Optional[int], k: int) -> List[Optional[int]]:
    """``k`` shares of a leaf budget, as even as it goes, the larger first (``None``: unbounded)."""
    if budget is None:
        return [None] * k
    q, r = divmod(budget, k)
    return [q + (1 if i < r else 0) for i in range(k)]


def turn_entropy(choice: Any) -> Optional[float]:
    """The entropy estimate of one sampled turn: the mean surprisal ``-logprob`` of its sampled
    tokens (an unbiased estimate of the per-token entropy, from the sampled tokens' logprobs
    only); ``None`` when the turn carried no logprobs."""
    values = extract_logprobs(choice) if choice is not None else []
    if not values:
        return None
    return -sum(float(v) for v in values) / len(values)


def fork_point(rec: RequestRecord) -> Tuple[int, str]:
    """``(turn, state)`` of a record resting where a fork may happen: before the model's turn
    ``turn`` (state ``'generating'``, also for ``continuing``), after turn ``turn``'s output was
    applied (``'tool_step'``), or, for a prompt, ``(0, 'pending')``."""
    state = rec.state
    if state in WAITING_STATES:
        return rec.turns + 1, GENERATING
    if state == PENDING:
        return 0, PENDING
    return rec.turns, state


@dataclass(frozen=True)
class Branching:
    """Where a request's machine forks, into how many branches, and the tree's leaf budget.

    Args:
        at: where to fork. A dict whose given keys must all hold (``AT_KEYS``):

            * ``turn``: before the model's turn ``turn`` (with ``state: tool_step``: after its
              output was applied, before the step);
            * ``state``: ``'generating'`` (default: before a model turn) or ``'tool_step'``;
            * ``tool_calls``: ``True``: right after a step that ran tool calls (its trace info
              has ``calls``, or its last message is a ``tool`` message), before the next turn;
            * ``entropy``: ``{'above': x}`` and/or ``{'rise': d}``: the turn just generated had a
              mean surprisal (``-logprob`` of its sampled tokens, :func:`turn_entropy`) of at least
              ``x``, or at least ``d`` over the request's first turn (ARPO's rule; the request
              config must ask for logprobs);
            * ``hook``: ``fn(infer_request, state, turn)`` returning the number of branches
              (``True``: ``copies``; ``0``, ``1``, ``False``, ``None``: no fork); sync or async.

            The string ``'tool_calls'`` is ``{'tool_calls': True}``; a callable is ``{'hook': fn}``.
        copies: the branches at each fork (the record itself is the first); at least 2.
        leaves: the tree's leaf budget (module docstring): exactly this many leaves per prompt;
            ``None``: no bound.
    """
    at: Any = field(default_factory=dict)
    copies: int = 2
    leaves: Optional[int] = None

    def __post_init__(self) -> None:
        at = self.at
        if at == 'tool_calls':
            at = {'tool_calls': True}
        elif callable(at) and not isinstance(at, Mapping):
            at = {'hook': at}
        if not isinstance(at, Mapping):
            raise ValueError(f"branch.at must be a dict of {', '.join(AT_KEYS)}, 'tool_calls' or a callable, "
                             f'not {at!r}')
        at = dict(at)
        unknown = sorted(set(at) - set(AT_KEYS))
        if unknown:
            raise ValueError(f'branch.at: unknown key(s) {unknown}; keys: {", ".join(AT_KEYS)}')
        if not at:
            raise ValueError(f'branch.at: say where to fork ({", ".join(AT_KEYS)})')
        turn = at.get('turn')
        if turn is not None and (isinstance(turn, bool) or not isinstance(turn, int) or turn < 1):
            raise ValueError(f'branch.at.turn must be an int >= 1, not {turn!r}')
        state = at.setdefault('state', 'generating')
        if state not in BRANCH_STATES:
            raise ValueError(f'branch.at.state must be one of {", ".join(BRANCH_STATES)}, not {state!r}')
        if at.get('tool_calls') not in (None, True, False):
            raise ValueError(f'branch.at.tool_calls must be true or false, not {at["tool_calls"]!r}')
        if at.get('tool_calls') and state != 'generating':
            raise ValueError('branch.at.tool_calls forks before the turn that reads the tool results: state must '
                             'be generating')
        entropy = at.get('entropy')
        if entropy is not None:
            if isinstance(entropy, (int, float)) and not isinstance(entropy, bool):
                entropy = at['entropy'] = {'above': float(entropy)}
            if not isinstance(entropy, Mapping) or not entropy or set(entropy) - set(_ENTROPY_KEYS) or any(
                    isinstance(v, bool) or not isinstance(v, (int, float)) for v in entropy.values()):
                raise ValueError(f'branch.at.entropy must be a number or a dict of above: / rise: numbers, '
                                 f'not {entropy!r}')
        hook = at.get('hook')
        if hook is not None and not callable(hook):
            raise ValueError(f'branch.at.hook must be callable, not {type(hook).__name__}')
        object.__setattr__(self, 'at', at)
        if isinstance(self.copies, bool) or not isinstance(self.copies, int) or self.copies < 2:
            raise ValueError(f'branch.copies must be an int >= 2, not {self.copies!r}')
        leaves = self.leaves
        if leaves is not None and (isinstance(leaves, bool) or not isinstance(leaves, int) or leaves < 1):
            raise ValueError(f'branch.leaves must be an int >= 1, not {leaves!r}')

    @classmethod
    def coerce(cls, value: Any) -> Optional['Branching']:
        """``None``, a :class:`Branching`, or a dict of its fields (``{'at': {'turn': 2}, 'copies': 4}``)."""
        return coerce_fields(cls, value, 'branch')

    @classmethod
    def of(cls, given: Any, scheduler: Any) -> Optional['Branching']:
        """A run's branching: ``given`` (coerced), else the scheduler's own ``branch`` attribute
        when it is a :class:`Branching` (a YAML scheduler's ``branch:`` section), else ``None``."""
        own = getattr(scheduler, 'branch', None)
        return cls.coerce(given) if given is not None else (own if isinstance(own, cls) else None)

    # ---- the decision -------------------------------------------------------------------------
    def branches(self, rec: RequestRecord, extra: Optional[dict], call: Callable[[Any], Any]) -> int:
        """How many branches ``rec`` forks into where it rests now (``<= 1``: none). ``extra`` is
        the trace info of the move that brought it here (a step's ``calls``); ``call`` gets the
        hook's value (awaiting it). Each point is considered once per record: its children,
        born there, do not fork there again. Raises :class:`ForkRefused` for what cannot be
        decided (a hook that failed, an entropy rule without logprobs)."""
        branch = rec.branch
        point = fork_point(rec)
        if branch is None or branch.checked == point or point[1] == PENDING:
            return 0
        branch.checked = point
        turn, state = point
        at = self.at
        budget = branch.budget
        if (budget is not None and budget < 2) or state != at['state']:
            return 0
        if at.get('turn') is not None and turn != at['turn']:
            return 0
        if at.get('tool_calls') and not _after_tool_calls(rec, extra):
            return 0
        if at.get('entropy') is not None and not self._entropy_holds(rec, turn, state):
            return 0
        k = self.copies
        hook = at.get('hook')
        if hook is not None:
            try:
                value = call(hook(rec.request, state, turn))
            except Exception as exc:
                raise ForkRefused(f'branch.at.hook raised {type(exc).__name__}: {exc}', uuid=rec.uuid, turn=turn,
                                  field='branch.at.hook') from exc
            if value is True:
                value = k
            if value in (None, False):
                return 0
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ForkRefused(f'branch.at.hook must return a number of branches (an int), True or None, not '
                                  f'{value!r}', uuid=rec.uuid, turn=turn, field='branch.at.hook')
            k = value
        return k if budget is None else min(k, budget)

    def _entropy_holds(self, rec: RequestRecord, turn: int, state: str) -> bool:
        generated = turn - 1 if state == 'generating' else turn  # the turn whose tokens are measured
        if generated < 1:
            return False
        value = turn_entropy(rec.choice)
        if value is None:
            raise ForkRefused('branch.at.entropy needs the logprobs of the sampled tokens, and turn '
                              f'{generated} has none: ask for them (request config logprobs: true)', uuid=rec.uuid,
                              turn=generated, field='branch.at.entropy')
        branch = rec.branch
        if generated == 1:
            branch.first_entropy = value
        rule = self.at['entropy']
        if 'above' in rule and value < rule['above']:
            return False
        if 'rise' in rule:
            first = branch.first_entropy
            if first is None or generated == 1 or value - first < rule['rise']:
                return False
        return True


def _after_tool_calls(rec: RequestRecord, extra: Optional[dict]) -> bool:
    if isinstance(extra, dict) and extra.get('calls'):
        return True
    messages = getattr(rec.request, 'messages', None) or []
    last = messages[-1] if messages else None
    return isinstance(last, dict) and last.get('role') == 'tool'


class Tree:
    """What the records of one root share: its uuid and input index, the leaf budget, the records
    still live, the forks made, every record of it, and (with a budget) the root's prompt as a
    record in ``pending``, never driven: the leaves a finished record did not spend are topped up
    by forking it."""
    __slots__ = ('root', 'root_index', 'limit', 'live', 'forks', 'records', 'seed', 'topped_up')

    def __init__(self, root: RequestRecord, limit: Optional[int], seed: Optional[RequestRecord]) -> None:
        self.root = root.uuid
        self.root_index = root.index
        self.limit = limit
        self.live = 1
        self.forks: List[Dict[str, Any]] = []
        self.records: List[RequestRecord] = [root]
        self.seed = seed
        self.topped_up = 0

    @property
    def leaves(self) -> int:
        return len(self.records)


class Branch:
    """A record's place in its tree (``RequestRecord.branch``): the tree, its parent's uuid, its
    leaf budget, where it was born, the forks it made (each ``(turn, state)``), how many children
    it numbered, the last point a fork was considered at, its first turn's entropy."""
    __slots__ = ('tree', 'parent', 'budget', 'born', 'forks', 'children', 'checked', 'first_entropy')

    def __init__(self, tree: Tree, parent: Optional[str], budget: Optional[int], born: Tuple[int, str]) -> None:
        self.tree = tree
        self.parent = parent
        self.budget = budget
        self.born = born
        self.forks: List[Tuple[int, str]] = []
        self.children = 0
        self.checked: Optional[Tuple[int, str]] = born
        self.first_entropy: Optional[float] = None


def plant(branching: Optional[Branching], records: Sequence[RequestRecord]) -> None:
    """Make each record without a tree the root of one (with a leaf budget, its prompt is kept as
    the tree's seed while the record is still ``pending``: the copies that top the tree up)."""
    if branching is None:
        return
    for rec in records:
        if rec.branch is not None:
            continue
        seed = None
        if branching.leaves is not None and rec.state == PENDING:
            seed = RequestRecord(rec.index, rec.uuid, fork_request(rec.request, rec.uuid))
            seed.group = rec.group  # a stream's: the copies join the group of the tree
        rec.branch = Branch(Tree(rec, branching.leaves, seed), None, branching.leaves, (0, PENDING))


def fork_request(request: Any, uuid: str) -> Any:
    """A copy of ``request`` under ``uuid``: messages, data and everything else copied deeply,
    the token record and the images shared (they are never changed in place: a backend gives a
    request a new token record each turn, :meth:`mtflow.backends.tokens.TokenPrompter.commit`)."""
    memo: Dict[int, Any] = {}
    record = getattr(request, RECORD_ATTR, None)
    if record is not None:
        memo[id(record)] = record
    for image in getattr(request, 'images', None) or ():
        memo[id(image)] = image
    child = copy.deepcopy(request, memo)
    try:
        child.uuid = uuid
    except (AttributeError, TypeError, ValueError) as exc:
        raise ForkRefused(f'cannot give the copy its own uuid: {type(exc).__name__}: {exc}', uuid=uuid,
                          field='uuid') from exc
    return child


def child_record(parent: RequestRecord, index: int, uuid: str, request: Any, branch: Branch) -> RequestRecord:
    """A new record for a child of ``parent``: its history copied (segments, infos, per-turn
    rewards, the context budget's count), the applied output shared, its place in the tree
    ``branch``. Its state is set by the ``fork`` move (:meth:`mtflow.core.machine.StateGraph.fork`)."""
    child = RequestRecord(index, uuid, request)
    for name in ('turns', 'is_continuation', 'response', 'choice', 'tokens', 'segment_start', 'group'):
        setattr(child, name, getattr(parent, name))
    child.ids = [list(s) for s in parent.ids]
    child.mask = [list(s) for s in parent.mask]
    child.logprobs = [list(s) for s in parent.logprobs]
    child.infos = copy.deepcopy(parent.infos)
    child.turn_result = copy.deepcopy(parent.turn_result)
    child.turn_rewards = copy.deepcopy(parent.turn_rewards)
    child.context_use = copy.deepcopy(parent.context_use)
    child.events = [] if parent.events is not None else None
    child.branch = branch
    if parent.branch is not None:
        branch.first_entropy = parent.branch.first_entropy
    return child


def trees_of(records: Sequence[RequestRecord]) -> List[Tree]:
    """The trees of ``records``, each once, in the order of their roots' first appearance."""
    seen: Dict[int, Tree] = {}
    for rec in records:
        branch = rec.branch
        if branch is not None and id(branch.tree) not in seen:
            seen[id(branch.tree)] = branch.tree
    return list(seen.values())


# ---- the tree record -----------------------------------------------------------------------------
def _first_turn(point: Tuple[int, str]) -> int:
    """The first turn a node started at ``point`` generates."""
    turn, state = point
    if state == PENDING:
        return 1
    return turn + 1 if state == TOOL_STEP else turn


def _reward(rec: RequestRecord) -> Optional[float]:
    infos = getattr(rec.output, 'rollout_infos', None) or rec.infos
    value = infos.get('reward') if isinstance(infos, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _offset(rec: RequestRecord, point: Tuple[int, str]) -> Optional[int]:
    """Where a node started at ``point`` begins in ``rec``'s exact sequence (prompt + response
    ids), from its token record; ``None`` when the record cannot say (no exact ids)."""
    tr = record_of(rec.request)
    if tr is None or tr.restarted or not tr.turns or len(tr.turns) != rec.turns - rec.segment_start:
        return None
    turn, state = point
    if state == PENDING:
        return len(tr.turns[0].prompt or [])
    index = turn - 1 - rec.segment_start
    if not 0 <= index < len(tr.turns):
        return len(tr.next_prefix())  # it generated nothing from there: the node is empty
    prompt_len = tr.turns[index].prompt_len
    return prompt_len + len(tr.turns[index].sampled) if state == TOOL_STEP else prompt_len


def _sequence_end(rec: RequestRecord) -> Optional[int]:
    tr = record_of(rec.request)
    if tr is None or tr.restarted or not tr.turns or len(tr.turns) != rec.turns - rec.segment_start:
        return None
    return len(tr.next_prefix())


def tree_record(tree: Tree) -> Dict[str, Any]:
    """The tree as written beside the trajectories (``trees.jsonl``, ``docs/branching.md``).

    Node 0 is the prompt; every other node is a run of one record's turns between the points
    where it or its parent forked: ``uuid`` (the record whose turns they are), ``parent``,
    ``turns`` (``[first, last]`` generated turns; ``last < first``: the node only joins its
    children to its parent), ``span`` (``[start, end)`` in the full exact-id sequence, prompt
    ids first, the same in every leaf under it; ``null`` without exact ids), ``leaves`` (the
    leaves under it) and ``value`` (the mean reward of those leaves, TreeRL's node value;
    ``null`` when none has a numeric reward)."""
    records = {rec.uuid: rec for rec in tree.records}
    nodes: List[Dict[str, Any]] = []
    root_rec = records[tree.root]
    prompt_end = _offset(root_rec, (0, PENDING))
    nodes.append({'id': 0, 'parent': None, 'uuid': None, 'turns': [0, 0],
                  'span': [0, prompt_end] if prompt_end is not None else None, 'leaves': []})
    #: (uuid, fork point) -> the id of the node of that record that ends at that point
    ends_at: Dict[Tuple[str, Tuple[int, str]], int] = {}
    last_node: Dict[str, int] = {}

    def add(rec: RequestRecord, parent: int, start: Tuple[int, str], end: Optional[Tuple[int, str]]) -> int:
        first = _first_turn(start)
        if end is None:
            last, stop = rec.turns, _sequence_end(rec)
        else:
            last, stop = _first_turn(end) - 1, _offset(rec, end)
        begin = _offset(rec, start)
        node = {'id': len(nodes), 'parent': parent, 'uuid': rec.uuid, 'turns': [first, last],
                'span': [begin, stop] if begin is not None and stop is not None else None, 'leaves': []}
        nodes.append(node)
        return node['id']

    def grow(rec: RequestRecord, parent: int) -> None:
        start = rec.branch.born
        for point in rec.branch.forks:
            ends_at[(rec.uuid, point)] = parent = add(rec, parent, start, point)
            start = point
        last_node[rec.uuid] = add(rec, parent, start, None)

    order = sorted(tree.records, key=lambda r: _uuid_key(r.uuid, tree.root))  # parents first, whatever the driver
    for rec in order:
        b = rec.branch
        parent = 0 if b.parent is None or b.born[1] == PENDING else ends_at.get((b.parent, b.born), 0)
        grow(rec, parent)
    rewards = {uuid: _reward(rec) for uuid, rec in records.items()}
    _leaves_and_values(nodes, last_node, rewards)
    return {'root': tree.root, 'leaves': [r.uuid for r in order],
            'budget': tree.limit, 'topped_up': tree.topped_up, 'forks': _forks(tree),
            'rewards': rewards, 'reasons': {uuid: rec.reason for uuid, rec in records.items()}, 'nodes': nodes}


def _leaves_and_values(nodes: List[Dict[str, Any]], last_node: Dict[str, int],
                       rewards: Dict[str, Optional[float]]) -> None:
    """Each node's ``leaves`` (every leaf whose path runs through it) and ``value`` (their mean reward)."""
    by_id = {n['id']: n for n in nodes}
    for uuid, node_id in last_node.items():
        node: Optional[Dict[str, Any]] = by_id[node_id]
        while node is not None:
            node['leaves'].append(uuid)
            node = by_id[node['parent']] if node['parent'] is not None else None
    for node in nodes:
        values = [rewards[u] for u in node['leaves'] if rewards[u] is not None]
        node['value'] = sum(values) / len(values) if values else None


def _forks(tree: Tree) -> List[Dict[str, Any]]:
    """The tree's forks in time order per record, whatever the driver; the copies of the prompt
    that topped it up last, in one entry (which records' unspent budgets they came from, and in
    what order, is the driver's timing)."""
    forks = sorted((f for f in tree.forks if not f.get('top_up')),
                   key=lambda f: (_uuid_key(f['parent'], tree.root), f['turn'], f['state']))
    copies = sorted((c for f in tree.forks if f.get('top_up') for c in f['children']),
                    key=lambda u: _uuid_key(u, tree.root))
    if copies:
        forks.append({'parent': tree.root, 'children': copies, 'turn': 0, 'state': PENDING, 'top_up': True})
    return forks


def _uuid_key(uuid: str, root: str) -> Tuple[int, List[int]]:
    """The order of a tree's uuids: by depth, then by the numbers of their branches (``r~2`` before
    ``r~10``); the same whatever order a driver made them in."""
    numbers = [int(part) for part in uuid[len(root):].split(CHILD_SEP)[1:]]
    return len(numbers), numbers
