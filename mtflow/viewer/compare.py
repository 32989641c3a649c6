"""The two-run HTML view (``mtflow trace html RUN_A --compare RUN_B``): which requests two runs
disagree on, and each one's turns side by side with the first difference highlighted.

The comparison is ``mtflow diff``'s (:class:`mtflow.run.diff.DiffRun`: matched by uuid, the
first differing turn and its fields); the page lists the totals, a table of the requests that
differ (and those only in one run), and for each differing request (at most ``max_shown``) its
turns in two columns (model text, the observation after it, the step reward), the first
differing turn marked and its differing fields outlined. Only the shown requests' lines are read
back (by byte offset), so the page costs the diff's memory plus what it shows.
"""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Union

from mtflow.run.diff import FIELDS, DiffRun, RequestDiff, iter_offsets, turn_views

__all__ = ['render_compare_html']

_CSS = '''
body{margin:0;font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;color:#0f172a;background:#f8fafc}
header{padding:14px 20px;background:#fff;border-bottom:1px solid #e2e8f0}
main{padding:10px 20px}h1{font-size:18px;margin:0 0 6px}h2{font-size:15px;margin:18px 0 6px}
.stats span{margin-right:18px}.stats b{font-size:17px;margin-right:4px}
table{border-collapse:collapse;background:#fff}td,th{border:1px solid #e2e8f0;padding:4px 8px;vertical-align:top;
text-align:left}th{background:#f1f5f9}pre{margin:0;white-space:pre-wrap;word-break:break-word;font:12px/1.35 ui-monospace,
Menlo,monospace}.req{margin:14px 0;background:#fff;border:1px solid #e2e8f0;border-radius:6px;padding:8px}
.req h3{margin:0 0 6px;font-size:14px}tr.first-diff td{background:#fef9c3}td.differs{outline:2px solid #ef4444;
outline-offset:-2px}.muted{color:#64748b}.only{color:#b45309}
'''


def _text(value: Any) -> str:
    if value is None:
        return ''
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _cell(value: Any, differs: bool) -> str:
    cls = ' class="differs"' if differs else ''
    return f'<td{cls}><pre>{html.escape(_text(value))}</pre></td>'


def _lines_of(path: Path, uuids: Set[str]) -> Dict[str, Dict[str, Any]]:
    """The lines of ``uuids`` (the last line of each, as the diff pairs them)."""
    offsets = {u: off for u, off in iter_offsets(path) if u in uuids}
    out = {}
    with open(path, 'rb') as f:
        for uuid, off in offsets.items():
            f.seek(off)
            out[uuid] = json.loads(f.readline())
    return out


def _request_block(d: RequestDiff, a: Dict[str, Any], b: Dict[str, Any]) -> str:
    va, vb = turn_views(a), turn_views(b)
    rows = []
    for k in range(max(len(va), len(vb))):
        ta = va[k] if k < len(va) else {}
        tb = vb[k] if k < len(vb) else {}
        first = k + 1 == d.turn
        differ = set(d.fields) if first else set()
        cls = ' class="first-diff"' if first else ''
        rows.append(f'<tr{cls}><td>{k + 1}{" ◀ first difference" if first else ""}</td>'
                    + _cell(ta.get('text'), 'text' in differ or 'token_ids' in differ)
                    + _cell(ta.get('observation'), 'observation' in differ)
                    + _cell(ta.get('reward'), 'reward' in differ)
                    + _cell(tb.get('text'), 'text' in differ or 'token_ids' in differ)
                    + _cell(tb.get('observation'), 'observation' in differ)
                    + _cell(tb.get('reward'), 'reward' in differ) + '</tr>')
    request_fields = [f for f in d.fields if f not in ('text', 'token_ids', 'observation', 'reward')]
    ends = (f'<p class="muted">finish: {html.escape(str(a.get("finish_reason")))} vs '
            f'{html.escape(str(b.get("finish_reason")))}; final reward: {html.escape(_text(_reward(a)))} vs '
            f'{html.escape(_text(_reward(b)))}'
            + (f'; differs over the request: {html.escape(", ".join(request_fields))}' if request_fields else '')
            + '</p>')
    token = d.detail.get('first_token')
    token_note = (f'<p class="muted">first differing token id at position {token["position"]}: '
                  f'{html.escape(_text(token["a"]))} vs {html.escape(_text(token["b"]))}</p>') if token else ''
    return (f'<div class="req" id="r-{html.escape(d.uuid)}"><h3>{html.escape(d.uuid)}: {_where(d)}: '
            f'{html.escape(", ".join(d.fields))}</h3>{ends}{token_note}<table><tr><th>turn</th><th>A: model</th>'
            '<th>A: observation</th><th>A: reward</th><th>B: model</th><th>B: observation</th><th>B: reward</th></tr>'
            + ''.join(rows) + '</table></div>')


def _where(d: RequestDiff) -> str:
    """Where a request first differs: a turn, or before it (another prompt or reference)."""
    return 'started from another prompt or reference' if d.is_input else f'turn {d.turn}'


def _reward(line: Dict[str, Any]) -> Any:
    infos = line.get('rollout_infos')
    return infos.get('reward') if isinstance(infos, dict) else None


def render_compare_html(run_a: Union[str, Path], run_b: Union[str, Path], *, fields: Sequence[str] = FIELDS,
                        max_shown: int = 200, title: Optional[str] = None) -> str:
    """The page (see the module docstring)."""
    diff = DiffRun(run_a, run_b, fields)
    shown: List[RequestDiff] = []
    only: List[str] = []
    for item in diff:
        if isinstance(item, RequestDiff):
            if len(shown) < max_shown:
                shown.append(item)
        elif len(only) < max_shown:
            kind, uuid = item
            only.append(f'<tr><td>{html.escape(uuid)}</td><td class="only">only in {"A" if kind == "only_in_a" else "B"}'
                        '</td><td></td></tr>')
    wanted = {d.uuid for d in shown}
    lines_a, lines_b = _lines_of(diff.path_a, wanted), _lines_of(diff.path_b, wanted)
    t = diff.totals
    rows = ''.join(f'<tr><td><a href="#r-{html.escape(d.uuid)}">{html.escape(d.uuid)}</a></td><td>{_where(d)}</td>'
                   f'<td>{html.escape(", ".join(d.fields))}</td></tr>' for d in shown) + ''.join(only)
    more = t.different + t.different_input - len(shown)
    changes = t.reward_changes()
    change_rows = ''.join(f'<tr><td>{html.escape(g)}</td><td>{c["a"]:g}</td><td>{c["b"]:g}</td><td>{c["change"]:+g}</td>'
                          '</tr>' for g, c in list(changes.items())[:max_shown])
    name = title or f'{Path(run_a).name} vs {Path(run_b).name}'
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>'
            f'{html.escape(name)} · mtflow compare</title><style>{_CSS}</style></head><body><header>'
            f'<h1>{html.escape(name)}</h1><div class="muted">A: {html.escape(str(diff.path_a))}<br>B: '
            f'{html.escape(str(diff.path_b))}</div><div class="stats">'
            + (f'<span><b>{t.different_input}</b>other prompt or reference</span>' if t.different_input else '')
            + f'<span><b>{t.identical}</b>identical</span><span><b>{t.different}</b>different</span>'
            f'<span><b>{t.only_in_a}</b>only in A</span><span><b>{t.only_in_b}</b>only in B</span></div></header><main>'
            '<h2>Requests that differ</h2>'
            + (f'<table><tr><th>request</th><th>first difference</th><th>fields</th></tr>{rows}</table>' if rows
               else '<p>none: the runs are identical on the fields compared</p>')
            + (f'<p class="muted">... and {more} more (max_shown {max_shown})</p>' if more > 0 else '')
            + (f'<h2>Mean reward per group that changed</h2><table><tr><th>group</th><th>A</th><th>B</th>'
               f'<th>change</th></tr>{change_rows}</table>' if change_rows else '')
            + ''.join(_request_block(d, lines_a[d.uuid], lines_b[d.uuid]) for d in shown)
            + '</main></body></html>')
