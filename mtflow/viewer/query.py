"""Finding the bad episodes: ``--where 'reward<0.5'`` filters and ``--sort reward`` orders over
the requests of a trace joined with their trajectory lines (``mtflow trace show``; the HTML page
does the same in the browser).

A condition is ``FIELD OP VALUE``: ``OP`` one of ``<``, ``<=``, ``>``, ``>=``, ``==`` (or ``=``),
``!=``; numeric fields (``reward``, ``turns``, ``tokens``, ``index``, ``rank``, ``tool_errors``)
compare as numbers, text fields (``reason``, ``group``, ``uuid``, ``tool_error``) with ``==``/``!=``
as shell patterns (``reason==stop_rule:*``). ``tool_error`` is any of the request's failed tool
calls' kinds (``timeout``, ``memory``, ``exit``, ...). A request without a reward never matches a
condition on ``reward`` (except ``reward==none``).
"""
from __future__ import annotations

import fnmatch
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from mtflow.run.tally import tool_error_kinds
from mtflow.viewer.model import RequestView

__all__ = ['Row', 'rows_of', 'parse_where', 'select_rows', 'sort_rows', 'QueryError', 'FIELDS', 'SORT_KEYS']

NUMERIC = ('reward', 'turns', 'tokens', 'index', 'rank', 'tool_errors')
TEXT = ('reason', 'group', 'uuid', 'tool_error')
#: the fields a condition may name
FIELDS = NUMERIC + TEXT
#: what ``--sort`` takes (``KEY:desc`` or ``-KEY``: descending)
SORT_KEYS = ('reward', 'turns', 'tokens', 'index', 'rank', 'tool_errors', 'reason', 'group', 'uuid')
_OPS: Dict[str, Callable[[Any, Any], bool]] = {'<=': operator.le, '>=': operator.ge, '==': operator.eq,
                                              '!=': operator.ne, '<': operator.lt, '>': operator.gt,
                                              '=': operator.eq}
_CONDITION = re.compile(r'^\s*([a-z_]+)\s*(<=|>=|==|!=|<|>|=)\s*(.*?)\s*$')


class QueryError(ValueError):
    """A ``--where`` or ``--sort`` that cannot be read; the message quotes it."""


@dataclass
class Row:
    """One request as the filters see it: its trace view and, when there is a trajectories file,
    its reward and group."""
    view: RequestView
    reward: Optional[float] = None
    group: Optional[str] = None
    tool_error_kinds: List[str] = field(default_factory=list)

    def value(self, name: str) -> Any:
        v = self.view
        return {'reward': self.reward, 'turns': v.turns, 'tokens': v.tokens, 'index': v.index, 'rank': v.rank,
                'tool_errors': len(v.tool_errors), 'reason': v.reason or 'none', 'group': self.group or v.uuid,
                'uuid': v.uuid}[name]


def rows_of(views: Sequence[RequestView], trajectories: Mapping[str, Any]) -> List[Row]:
    """A :class:`Row` per view, with the reward and group of its trajectory line when it has one."""
    rows = []
    for v in views:
        traj = trajectories.get(v.uuid)
        kinds = [k for c in v.cells for k in tool_error_kinds(c.step_extra)]
        rows.append(Row(v, getattr(traj, 'reward', None), getattr(traj, 'group', None), kinds))
    return rows


def parse_where(text: str) -> Callable[[Row], bool]:
    """A predicate from one condition (module docstring); :class:`QueryError` names the problem."""
    m = _CONDITION.match(text)
    if not m:
        raise QueryError(f"--where {text!r}: expected FIELD OP VALUE, e.g. 'reward<0.5' or 'reason==error'")
    name, op, raw = m.groups()
    if name not in FIELDS:
        raise QueryError(f'--where {text!r}: unknown field {name!r}; fields: {", ".join(FIELDS)}')
    compare = _OPS[op]
    if name in TEXT:
        if op not in ('=', '==', '!='):
            raise QueryError(f'--where {text!r}: {name} is text; compare it with == or != (shell patterns)')
        want = op != '!='
        if name == 'tool_error':
            return lambda row: any(fnmatch.fnmatchcase(k, raw) for k in row.tool_error_kinds) == want
        return lambda row: fnmatch.fnmatchcase(str(row.value(name)), raw) == want
    if raw.lower() in ('none', 'null') and op in ('=', '==', '!='):
        want = op != '!='
        return lambda row: (row.value(name) is None) == want
    try:
        number = float(raw)
    except ValueError:
        raise QueryError(f'--where {text!r}: {name} is a number; {raw!r} is not') from None

    def numeric(row: Row) -> bool:
        value = row.value(name)
        return value is not None and compare(value, number)

    return numeric


def select_rows(rows: Sequence[Row], conditions: Sequence[str]) -> List[Row]:
    """The rows that meet every condition."""
    predicates = [parse_where(c) for c in conditions]
    return [r for r in rows if all(p(r) for p in predicates)]


def sort_rows(rows: Sequence[Row], key: Optional[str]) -> List[Row]:
    """Rows ordered by ``key`` (``-key`` or ``key:desc``: descending); rows without the value (no
    reward) go last."""
    if not key:
        return list(rows)
    descending = key.startswith('-') or key.endswith(':desc')
    name = key.lstrip('-').removesuffix(':desc').removesuffix(':asc')
    if name not in SORT_KEYS:
        raise QueryError(f'--sort {key!r}: unknown key; keys: {", ".join(SORT_KEYS)} (KEY:desc for descending)')
    present = [r for r in rows if r.value(name) is not None]
    missing = [r for r in rows if r.value(name) is None]
    return sorted(present, key=lambda r: r.value(name), reverse=descending) + missing
