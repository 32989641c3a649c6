"""A multi-agent episode as its roles interleaved (``docs/multi-agent.md``): who acted at each step,
at which of its turns, what it said (and the inner tool turns of a role with its own scheduler
before it), as one transcript, from the episode's role trajectories (each line's
``rollout_infos.episode``: its place, and the episode record of who acted when).

``mtflow trace show TRACE --trajectories TRAJ --episode ID`` prints it; :func:`episode_rows` is
the view model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from mtflow.run.diff import turn_views

__all__ = ['EpisodeRow', 'episode_ids', 'episode_lines', 'episode_rows', 'episode_renderable']


@dataclass
class EpisodeRow:
    """One turn of one role: ``step`` (the environment step it acted in; ``None``: an inner turn,
    e.g. a tool call of its own scheduler), ``role``, its ``turn``, what it said and what came back."""
    step: Optional[int]
    role: str
    turn: int
    text: str
    observation: List[str]


def _place(line: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    place = (line.get('rollout_infos') or {}).get('episode')
    return place if isinstance(place, dict) and place.get('id') is not None else None


def episode_ids(trajectories: Dict[str, Any]) -> List[str]:
    """The episodes the trajectories hold, in order of first appearance."""
    seen: Dict[str, None] = {}
    for traj in trajectories.values():
        place = _place(traj.to_dict())
        if place is not None:
            seen.setdefault(str(place['id']))
    return list(seen)


def episode_lines(trajectories: Dict[str, Any], episode: str) -> Dict[str, Dict[str, Any]]:
    """The trajectory lines of ``episode``'s roles, by role."""
    out: Dict[str, Dict[str, Any]] = {}
    for traj in trajectories.values():
        line = traj.to_dict()
        place = _place(line)
        if place is not None and str(place['id']) == episode:
            out[str(place['role'])] = line
    return out


def _record(lines: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """The fullest episode record among the roles' lines (a role that failed carries its place only)."""
    records = [_place(line) for line in lines.values()]
    return max(records, key=lambda r: (len(r.get('steps') or []), 'reason' in r))


def episode_rows(lines: Dict[str, Dict[str, Any]]) -> List[EpisodeRow]:
    """Every role's turns, interleaved in the order of the episode's steps (see the module docstring)."""
    record = _record(lines)
    views = {role: turn_views(line) for role, line in lines.items()}
    done = {role: 0 for role in lines}
    rows: List[EpisodeRow] = []

    def take(role: str, upto: int, step: Optional[int]) -> None:
        for turn in range(done[role] + 1, upto + 1):
            view = views[role][turn - 1] if turn - 1 < len(views[role]) else {'text': '', 'observation': []}
            rows.append(EpisodeRow(step if turn == upto else None, role, turn, str(view.get('text') or ''),
                                   [str(o) for o in view.get('observation') or []]))
        done[role] = max(done[role], upto)

    for entry in record.get('steps') or []:
        for role in entry.get('acted') or []:
            if role in views:
                take(role, int(entry['turns'][role]), int(entry['step']))
    for role in lines:  # turns after the last step (a role the episode's end cut short)
        take(role, len(views[role]), None)
    return rows


def episode_renderable(episode: str, lines: Dict[str, Dict[str, Any]], width: int = 100) -> RenderableType:
    """The episode's header (roles, policies, rewards, how it ended) and its interleaved turns."""
    record = _record(lines)
    rewards = record.get('rewards') or {}
    head = Text(f'episode {episode}: ', style='bold')
    head.append(', '.join(f'{r["role"]} ({r.get("policy")}{"" if r.get("train", True) else ", not trained"}): '
                          f'{lines.get(r["role"], {}).get("finish_reason")}'
                          + (f', reward {rewards[r["role"]]:g}' if r['role'] in rewards else '')
                          for r in record.get('roles') or []))
    ended = record.get('ended_by')
    if ended:
        head.append(f'\nended by {ended.get("role")} ({ended.get("reason")} at its turn {ended.get("turn")})',
                    style='red')
    table = Table(show_header=True, header_style='bold', expand=False, width=width)
    for name, kw in (('step', {'justify': 'right'}), ('role', {}), ('turn', {'justify': 'right'}),
                     ('said', {'overflow': 'fold', 'ratio': 3}), ('then', {'overflow': 'fold', 'ratio': 2})):
        table.add_column(name, **kw)
    for row in episode_rows(lines):
        table.add_row('' if row.step is None else str(row.step), row.role, str(row.turn), Text(row.text[:400]),
                      Text(' | '.join(o[:200] for o in row.observation)),
                      style=None if row.step is not None else 'dim')
    return Group(head, table)
