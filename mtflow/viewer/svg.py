"""SVG drawn by hand (no graphviz, no JS): the declared state graph and the small bar charts.

The state graph comes from :meth:`mtflow.core.machine.StateGraph.edges` (the same declaration the
executor fires), laid out in layers by distance from ``pending``: forward moves are gentle curves
left to right, moves back (``tool_step -> generating``) and within a layer arc around, and
parallel moves between the same two states share one arrow with their triggers joined.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from mtflow.core.machine import OPTIONAL_STATES, PENDING, StateGraph

STATE_COLORS = {
    'pending': '#9aa5b1',
    'generating': '#3b82f6',
    'continuing': '#06b6d4',
    'tool_step': '#f59e0b',
    'compacting': '#a855f7',
    'finished': '#22c55e',
}
NODE_W, NODE_H, LAYER_GAP, ROW_GAP = 118, 40, 120, 40


def _back_edges(states: Sequence[str], edges: Sequence[Tuple[str, str, str]], initial: str) -> set:
    """The moves that go back: ``u -> v`` where ``v`` can reach ``u`` again (a cycle) and ``v`` is
    no farther from ``initial`` than ``u``, nor declared after it at the same distance
    (``tool_step -> generating``, not the other way)."""
    succ: Dict[str, set] = {s: set() for s in states}
    for src, _, dst in edges:
        succ[src].add(dst)

    def reach(start: str) -> set:
        seen, todo = set(), [start]
        while todo:
            for d in succ[todo.pop()]:
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return seen

    dist = {initial: 0}
    frontier = [initial]
    while frontier:
        nxt = []
        for s in frontier:
            for d in sorted(succ[s], key=states.index):
                if d not in dist:
                    dist[d] = dist[s] + 1
                    nxt.append(d)
        frontier = nxt
    far = len(states)
    reachable = {s: reach(s) for s in states}
    # at the same distance (``pending`` reaches ``generating`` and ``tool_step`` in one move each), the
    # state declared first is the one the other moves back to
    return {(u, v) for u, _, v in edges
            if u in reachable[v] and (dist.get(v, far), states.index(v)) <= (dist.get(u, far), states.index(u))}


def _layers(states: Sequence[str], edges: Sequence[Tuple[str, str, str]], initial: str) -> Dict[str, int]:
    """Layer of each state: the longest path to it from ``initial`` once the moves back are set
    aside, so that every forward move goes left to right (``finished`` ends up last)."""
    back = _back_edges(states, edges, initial)
    forward = {(src, dst) for src, _, dst in edges if (src, dst) not in back and src != dst}
    layer = {s: 0 for s in states}
    for _ in states:  # Bellman-Ford style relaxation: the graph is tiny
        changed = False
        for src, dst in forward:
            if layer[dst] < layer[src] + 1:
                layer[dst] = layer[src] + 1
                changed = True
        if not changed:
            break
    return layer


def _clip(cx: float, cy: float, tx: float, ty: float) -> Tuple[float, float]:
    """Where the ray from a node's center (cx, cy) towards (tx, ty) leaves the node's box."""
    dx, dy = tx - cx, ty - cy
    if dx == 0 and dy == 0:
        return cx, cy
    sx = (NODE_W / 2) / abs(dx) if dx else math.inf
    sy = (NODE_H / 2) / abs(dy) if dy else math.inf
    s = min(sx, sy)
    return cx + dx * s, cy + dy * s


@dataclass
class _Layout:
    """Where the state graph's boxes go: each state's center, and the drawing's size."""
    pos: Dict[str, Tuple[float, float]]
    layer: Dict[str, int]
    mid_y: float
    width: float
    height: float
    top: int


def _layout(graph: StateGraph, states: List[str], edges: Sequence[Tuple[str, str, str]],
            title: Optional[str]) -> _Layout:
    """States in columns by layer, each column centered vertically; room on the right for the
    list of finish reasons and below for the arcs."""
    layer = _layers(states, edges, PENDING)
    by_layer: Dict[int, List[str]] = {}
    for s in states:
        by_layer.setdefault(layer[s], []).append(s)
    rows = max(len(v) for v in by_layer.values())
    height_body = rows * NODE_H + (rows - 1) * ROW_GAP
    top = 46 if title else 20
    pos: Dict[str, Tuple[float, float]] = {}
    for k, members in sorted(by_layer.items()):
        x = 30 + NODE_W / 2 + k * (NODE_W + LAYER_GAP)
        block = len(members) * NODE_H + (len(members) - 1) * ROW_GAP
        y0 = top + 60 + (height_body - block) / 2 + NODE_H / 2
        for j, s in enumerate(members):
            pos[s] = (x, y0 + j * (NODE_H + ROW_GAP))
    width = 30 + len(by_layer) * (NODE_W + LAYER_GAP) - LAYER_GAP + 30 + 200
    height = top + 60 + height_body + 80 + 16 * max(0, len(graph.finish_reasons) - 4)
    return _Layout(pos, layer, top + 60 + height_body / 2, width, height, top)


def _arrow_svg(layout: _Layout, src: str, dst: str, triggers: List[str],
               counts: Optional[Mapping[Tuple[str, str], int]]) -> List[str]:
    """One move ``src -> dst`` (its triggers joined) as a curved arrow and its label."""
    layer = layout.layer
    (x1, y1), (x2, y2) = layout.pos[src], layout.pos[dst]
    back = layer[dst] <= layer[src]
    mx, my = (x1 + x2) / 2, (y1 + y2) / 2
    dx, dy = x2 - x1, y2 - y1
    dist = math.hypot(dx, dy) or 1.0
    nx, ny = -dy / dist, dx / dist  # unit normal
    bend = 0.12 * dist if not back else 0.3 * dist + 20
    if layer[dst] - layer[src] > 1:
        # skips a layer: arc around the states in between, away from the middle of the drawing
        side = -1.0 if my < layout.mid_y - 1 else 1.0
        nx, ny, bend = 0.0, side, 0.28 * dist + 24
    cx, cy = mx + nx * bend, my + ny * bend
    sx, sy = _clip(x1, y1, cx, cy)
    ex, ey = _clip(x2, y2, cx, cy)
    unused = counts is not None and not counts.get((src, dst), 0)  # never taken in this trace: faded
    stroke = 'stroke="#cbd5e1" stroke-dasharray="4 3"' if unused else 'stroke="#475569"'
    lx, ly = 0.25 * sx + 0.5 * cx + 0.25 * ex, 0.25 * sy + 0.5 * cy + 0.25 * ey
    label = ' | '.join(triggers)
    if counts is not None:
        label += f' ×{counts.get((src, dst), 0)}'
    return [f'<path d="M{sx:.1f},{sy:.1f} Q{cx:.1f},{cy:.1f} {ex:.1f},{ey:.1f}" fill="none" {stroke} '
            f'stroke-width="1.4" marker-end="url(#mtf-arrow)" data-edge="{escape(src)}-&gt;{escape(dst)}"/>',
            f'<text class="sg-label" x="{lx:.1f}" y="{ly - 4:.1f}" text-anchor="middle">{escape(label)}</text>']


def _reasons_svg(layout: _Layout, reasons: Sequence[str], counts: Optional[Mapping[Tuple[str, str], int]]) -> List[str]:
    """The finish reasons, listed beside ``finished`` (with their counts from a trace)."""
    fx, fy = layout.pos.get('finished', (layout.width - 200, layout.top + 60))
    note_x = fx + NODE_W / 2 + 16
    out = [f'<text class="sg-note" x="{note_x:.1f}" y="{fy - 10:.1f}" font-weight="bold">finish reasons</text>']
    for k, r in enumerate(reasons):
        n = ''
        if counts is not None:
            n = f' ×{counts.get(("reason", r), 0)}'
        out.append(f'<text class="sg-note" x="{note_x:.1f}" y="{fy + 6 + 15 * k:.1f}">{escape(r + n)}</text>')
    return out


def state_graph_svg(graph: StateGraph, counts: Optional[Mapping[Tuple[str, str], int]] = None,
                    title: Optional[str] = None) -> str:
    """The declared graph as one ``<svg>`` element. ``counts[(src, dst)]``, when given (from a
    trace), is written on each arrow; finish reasons are listed next to ``finished``."""
    states = list(graph.states)
    edges = graph.edges()
    if counts is not None:  # a trace's drawing: a state only some runs enter is drawn when this one did
        unused = {s for s in OPTIONAL_STATES
                  if not any(counts.get((a, b), 0) for a, _, b in edges if s in (a, b))}
        states = [s for s in states if s not in unused]
        edges = [(a, t, b) for a, t, b in edges if a not in unused and b not in unused]
    layout = _layout(graph, states, edges, title)
    width, height = layout.width, layout.height
    # one arrow per (src, dst): parallel triggers share it
    merged: Dict[Tuple[str, str], List[str]] = {}
    for src, trig, dst in edges:
        merged.setdefault((src, dst), []).append(trig)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="state-graph" viewBox="0 0 {width:.0f} {height:.0f}" '
           f'width="{width:.0f}" height="{height:.0f}" role="img" aria-label="state graph">',
           '<defs><marker id="mtf-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#475569"/></marker></defs>',
           '<style>.sg-label{font:11px sans-serif;fill:#334155}.sg-node{font:bold 12px sans-serif;fill:#fff}'
           '.sg-note{font:11px sans-serif;fill:#334155}.sg-title{font:bold 14px sans-serif;fill:#0f172a}</style>']
    if title:
        out.append(f'<text class="sg-title" x="20" y="24">{escape(title)}</text>')
    for (src, dst), triggers in merged.items():
        out.extend(_arrow_svg(layout, src, dst, triggers, counts))
    for s in states:
        x, y = layout.pos[s]
        color = STATE_COLORS.get(s, '#64748b')
        out.append(f'<g data-state="{escape(s)}"><rect x="{x - NODE_W / 2:.1f}" y="{y - NODE_H / 2:.1f}" '
                   f'width="{NODE_W}" height="{NODE_H}" rx="9" fill="{color}"/>'
                   f'<text class="sg-node" x="{x:.1f}" y="{y + 4:.1f}" text-anchor="middle">{escape(s)}</text></g>')
    out.extend(_reasons_svg(layout, list(graph.finish_reasons), counts))
    out.append('</svg>')
    return '\n'.join(out)


def bar_chart_svg(data: Mapping[str, int], title: str, colors: Optional[Mapping[str, str]] = None,
                  css_class: str = 'chart') -> str:
    """A horizontal bar chart (label, bar, count per row) as one ``<svg>`` element."""
    items = list(data.items())
    label_w = max([len(str(k)) for k, _ in items] + [4]) * 7 + 12
    bar_w, row_h = 220, 20
    width = label_w + bar_w + 60
    height = 28 + row_h * max(1, len(items)) + 6
    top = max([v for _, v in items] + [1])
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="{escape(css_class)}" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" role="img" aria-label="{escape(title)}">',
           f'<text x="4" y="16" style="font:bold 13px sans-serif;fill:#0f172a">{escape(title)}</text>']
    if not items:
        out.append('<text x="4" y="40" style="font:12px sans-serif;fill:#64748b">nothing</text>')
    for k, (label, value) in enumerate(items):
        y = 28 + k * row_h
        w = max(2.0 if value else 0.0, bar_w * value / top)
        color = (colors or {}).get(label, '#3b82f6')
        out.append(f'<text x="{label_w - 6}" y="{y + 13}" text-anchor="end" style="font:12px sans-serif;'
                   f'fill:#334155">{escape(str(label))}</text>'
                   f'<rect x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" rx="3" fill="{color}">'
                   f'<title>{escape(str(label))}: {value}</title></rect>'
                   f'<text x="{label_w + w + 6:.1f}" y="{y + 13}" style="font:12px sans-serif;fill:#334155">'
                   f'{value}</text>')
    out.append('</svg>')
    return ''.join(out)
