"""``mtflow trace html``: one self-contained HTML page (inline CSS, JS and SVG; no network at all).

The page holds the view model as JSON in a ``<script type="application/json">`` element and draws
the request swimlanes and the detail view from it with a small inline script; the state graph and
the charts are SVG rendered here in Python. Everything from the trace or the trajectories reaches
the page through ``textContent`` (never ``innerHTML``), so message text cannot inject markup.
"""
from __future__ import annotations

import json
from collections import Counter
from html import escape
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from mtflow.core.machine import FINISH_REASONS, FINISHED, StateGraph, reason_kind
from mtflow.core.trace import Trace
from mtflow.run.trajectories import Trajectory
from mtflow.viewer.budget import response_text, sent_text, turn_budgets
from mtflow.viewer.images import image_refs, per_message, thumbnails
from mtflow.viewer.model import RequestView, request_views, state_spans, summarize, trace_t0, turn_windows
from mtflow.viewer.results import (RESULTS_CSS, RESULTS_HTML, RESULTS_SCRIPT, header_run_html, plots_html,
                                   request_results, summary_cards_html)
from mtflow.viewer.svg import STATE_COLORS, bar_chart_svg, state_graph_svg
from mtflow.viewer.tokens import token_texts


#: the columns of one event in the page (uuid, index and rank are the request's)
PAGE_EVENT_FIELDS = ('turn', 'from', 'to', 'trigger', 'reason', 'tokens', 'duration_s', 'extra')


def _cell_dict(c: Any) -> Dict[str, Any]:
    """A turn cell for the page: keys without a value are left out (the page stays small)."""
    d = {
        'turn': c.turn, 'wait': c.wait, 'stepped': c.stepped, 'tokens': c.tokens,
        'step_s': None if c.step_s is None else round(c.step_s, 6), 'tools': c.tool_calls,
        'tool_errors': c.tool_errors, 'finished': c.finished, 'error': c.error
    }
    return {k: v for k, v in d.items() if v is not None and v is not False and v != []}


def _request_dict(v: RequestView, t0: Optional[float], traj: Any = None) -> Dict[str, Any]:
    events = [[e.turn, e.src, e.dst, e.trigger, e.reason, e.tokens,
               None if e.duration_s is None else round(e.duration_s, 6), e.extra] for e in v.events]
    # [state, start, end, turn] in seconds since the run's first event: the time axis' blocks
    spans = [[sp.state, round(sp.start - t0, 5), round(sp.end - t0, 5), sp.turn]
             for sp in state_spans(v.events, t0)] if t0 is not None else []
    return {
        'uuid': v.uuid, 'index': v.index, 'rank': v.rank, 'reason': v.reason, 'turns': v.turns, 'tokens': v.tokens,
        'path': v.path, 'cells': [_cell_dict(c) for c in v.cells], 'events': events, 'spans': spans,
        'end': round(v.events[-1].t - t0, 5) if t0 is not None and v.events[-1].t is not None else None,
        **request_results(v, traj),
    }


#: a turn whose outputs were all applied within this share of the run's wall time (and at
#: least 1 ms) is drawn as a barrier line: every request waited for that turn's slowest work
BARRIER_SHARE = 0.004


def _turn_marks(views: List[RequestView], t0: Optional[float], wall: Optional[float]) -> List[Dict[str, Any]]:
    """One mark per turn for the time axis: when its outputs were applied, and whether that was a
    barrier (lockstep) or spread out (async)."""
    if t0 is None or not wall:
        return []
    marks = []
    for turn, (first, last, n) in turn_windows(views).items():
        barrier = n > 1 and last - first <= max(BARRIER_SHARE * wall, 0.001)
        marks.append({'turn': turn, 'first': round(first - t0, 5), 'last': round(last - t0, 5), 'n': n,
                      'barrier': barrier})
    return marks


def _time_table_html(summary: Any) -> str:
    """Wall time per state (the terminal's ``time per state`` table)."""
    if not summary.time_per_state:
        return ''
    grand = sum(st.total_s for st in summary.time_per_state.values()) or 1.0
    rows = ''.join(
        f'<tr class="open" data-uuid="{escape(st.max_uuid)}"><td><i class="sw {escape(st.state)}"></i>'
        f'{escape(st.state)}</td><td>{_fmt_s(st.total_s)}</td><td>{100 * st.total_s / grand:.0f}%</td>'
        f'<td>{st.requests}</td><td>{_fmt_s(st.mean_s)}</td><td>{_fmt_s(st.max_s)}</td><td>{escape(st.max_uuid)}</td></tr>'
        for st in summary.time_per_state.values())
    return ('<div class="card time-per-state"><h3>Time per state</h3><table class="events"><tr><th>state</th>'
            '<th>total</th><th>share</th><th>requests</th><th>mean</th><th>max</th><th>slowest request</th></tr>'
            f'{rows}</table></div>')


def _fmt_s(seconds: Optional[float]) -> str:
    if seconds is None:
        return ''
    return f'{seconds * 1000:.1f} ms' if seconds < 1 else f'{seconds:.2f} s'


def _trajectory_dict(t: Trajectory, tokenizer: Any, images: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    segments = []
    for ids, mask, k in zip(t.response_token_ids, t.masks(), range(len(t.response_token_ids))):
        lps = t.rollout_logprobs[k] if k < len(t.rollout_logprobs) else []
        segments.append({'ids': ids, 'mask': mask, 'logprobs': lps,
                         'text': token_texts(ids, tokenizer) if tokenizer is not None else None})
    return {
        'messages': t.messages, 'segments': segments, 'infos': t.rollout_infos, 'finish_reason': t.finish_reason,
        'num_turns': t.num_turns, 'has_mask': bool(t.response_loss_mask), 'images': images or [],
        'message_images': per_message(t) if images else [],
    }


def _graph_for(trace: Trace) -> StateGraph:
    """Without a scheduler: the core graph plus every finish reason the trace shows."""
    seen = [e.reason for e in trace.events if e.dst == FINISHED and e.reason]
    return StateGraph(tuple(FINISH_REASONS) + tuple(dict.fromkeys(seen)), name='mtflow')


_KIND_COLORS = {'error': '#ef4444', 'limit': '#eab308', 'ok': '#22c55e'}


def _reason_color(reason: str) -> str:
    return _KIND_COLORS.get(reason_kind(reason), _KIND_COLORS['ok'])


def _charts(summary: Any) -> List[str]:
    """The small bar charts under the stats: live requests per turn, turns per request, finish
    reasons, tool error kinds (when there are any)."""
    charts = [
        bar_chart_svg({f'turn {t}': n for t, n in summary.live_per_turn.items()}, 'live requests per turn',
                      css_class='chart chart-live'),
        bar_chart_svg({f'{t} turn{"s" if t != 1 else ""}': n for t, n in summary.turns_per_request.items()},
                      'turns per request', css_class='chart chart-turns'),
        bar_chart_svg(summary.finish_reasons, 'finish reasons', {r: _reason_color(r) for r in summary.finish_reasons},
                      css_class='chart chart-reasons'),
    ]
    if summary.tool_error_kinds:
        charts.append(bar_chart_svg(summary.tool_error_kinds, 'tool error kinds', css_class='chart chart-tool-errors'))
    return charts


def _stats_html(summary: Any) -> str:
    """The row of figures at the top of the trace view."""
    stats = [
        ('requests', summary.requests), ('events', summary.events), ('turns', summary.max_turn),
        ('completion tokens', summary.tokens), ('tool calls', summary.tool_calls),
        ('tool errors', len(summary.tool_errors)), ('errors', len(summary.errors))
    ]
    if summary.wall_s is not None:
        stats.append(('wall time', _fmt_s(summary.wall_s)))
    if len(summary.ranks) > 1:
        stats.append(('ranks', len(summary.ranks)))
    stats_html = ''.join(f'<div class="stat"><b>{n}</b><span>{escape(label)}</span></div>' for label, n in stats)
    return stats_html


def render_html(trace: Trace, *, trajectories: Optional[Mapping[str, Trajectory]] = None, tokenizer: Any = None,
                graph: Optional[StateGraph] = None, title: str = 'mtflow trace',
                summary: Optional[Mapping[str, Any]] = None, run_name: Optional[str] = None,
                config_text: Optional[str] = None, images_dir: Optional[Path] = None,
                page_dir: Optional[Path] = None) -> str:
    """The page as a string. ``trajectories`` (``{uuid: Trajectory}``) feed the detail view's
    messages and tokens, the rewards, groups, the request table and the group view;
    ``tokenizer`` decodes the tokens (else ids are shown). ``summary`` (``summary.json``),
    ``run_name`` and ``config_text`` fill the results cards and the header
    (:mod:`mtflow.viewer.results`). ``images_dir`` (the run directory) and ``page_dir`` (where
    the page goes) place each trajectory's images: thumbnails inline, full size linked
    (:mod:`mtflow.viewer.images`)."""
    run_summary = summary
    views = request_views(trace)
    summary = summarize(views, len(trace.events))
    trajectories = trajectories or {}
    wanted = {v.uuid for v in views}
    t0 = trace_t0(trace.events)
    data = {
        'title': title,
        'requests': [_request_dict(v, t0, trajectories.get(v.uuid)) for v in views],
        'wall': None if summary.wall_s is None else round(summary.wall_s, 5),
        'turn_marks': _turn_marks(views, t0, summary.wall_s),
        'trajectories': {u: _trajectory_dict(t, tokenizer,
                                             thumbnails(t, images_dir, page_dir) if image_refs(t) else None)
                         for u, t in trajectories.items() if u in wanted},
        'decoded': tokenizer is not None,
        'max_turn': summary.max_turn,
        # how each finish reason is coloured: one table, mtflow.core.machine.FINISH_REASON_TABLE
        'reason_kinds': {r: reason_kind(r) for r in dict.fromkeys(tuple(FINISH_REASONS) + tuple(summary.finish_reasons))},
    }
    counts: Dict[Any, int] = Counter((e.src, e.dst) for e in trace.events)
    for reason, n in summary.finish_reasons.items():
        counts[('reason', reason)] = n
    graph_svg = state_graph_svg(graph or _graph_for(trace), counts=counts, title='state graph')
    charts = _charts(summary)
    problems = _trees_html(views, trajectories) + _problems_html(summary) + _compactions_html(views) + \
        _budget_html(views)
    stats_html = _stats_html(summary)
    reasons_opts = ''.join(f'<option value="{escape(r)}">{escape(r)}</option>' for r in summary.finish_reasons)
    # '<' as \u003c: no '</script>' or '<!--' from a message can end the data block early
    payload = json.dumps(data, ensure_ascii=False, default=str).replace('<', '\\u003c')
    css_vars = ''.join(f'--{k.replace("_", "-")}:{v};' for k, v in STATE_COLORS.items())
    results = (RESULTS_HTML.replace('%CARDS%', summary_cards_html(run_summary, views, trajectories))
               .replace('%PLOTS%', plots_html(views, trajectories, summary.finish_reasons)))
    return (_TEMPLATE.replace('%RESULTS_CSS%', RESULTS_CSS).replace('%RESULTS_SCRIPT%', RESULTS_SCRIPT)
            .replace('%RUN%', header_run_html(run_name, config_text)).replace('%RESULTS%', results)
            .replace('%TITLE%', escape(title)).replace('%CSSVARS%', css_vars)
            .replace('%STATS%', stats_html).replace('%REASONS%', reasons_opts)
            .replace('%GRAPH%', graph_svg).replace('%CHARTS%', ''.join(charts)).replace('%PROBLEMS%', problems)
            .replace('%TIMETABLE%', _time_table_html(summary))
            .replace('%LIMIT_REASONS%', '/'.join(r for r in FINISH_REASONS if reason_kind(r) == 'limit'))
            .replace('%ERROR_REASONS%', '/'.join(r for r in FINISH_REASONS if reason_kind(r) == 'error'))
            .replace('%SCRIPT%', _SCRIPT).replace('%DATA%', payload))


def _table(title: str, css: str, head: Sequence[str], rows: List[tuple]) -> str:
    """A server-rendered table; the first cell of each row is a uuid (a click opens its detail)."""
    out = [f'<div class="card {css}"><h3>{escape(title)}</h3><table class="events"><tr>']
    out += [f'<th>{escape(h)}</th>' for h in head]
    out.append('</tr>')
    for row in rows:
        out.append(f'<tr class="open" data-uuid="{escape(str(row[0]))}">')
        out += [f'<td>{escape(str(v))}</td>' for v in row]
        out.append('</tr>')
    out.append('</table></div>')
    return ''.join(out)


def _problems_html(summary: Any) -> str:
    """Errors, tool errors and the slowest steps (the terminal summary's tables)."""
    parts = []
    if summary.errors:
        parts.append(_table('Errors', 'errors', ('request', 'turn', 'phase', 'error'), [
            (e['uuid'], e['turn'], e.get('phase', ''), f'{e.get("type", "")}: {e.get("message", "")}'.lstrip(': '))
            for e in summary.errors[:200]]))
    if summary.tool_errors:
        parts.append(_table('Tool errors', 'tool-errors', ('request', 'turn', 'error'),
                            [(t.uuid, t.turn, t.message) for t in summary.tool_errors[:200]]))
    if summary.slowest_steps:
        parts.append(_table('Slowest steps', 'slowest', ('request', 'turn', 'time', 'tools'), [
            (st.uuid, st.turn, f'{st.duration_s * 1000:.1f} ms' if st.duration_s < 1 else f'{st.duration_s:.2f} s',
             ', '.join(st.tools)) for st in summary.slowest_steps]))
    if not parts:
        return ''
    return '<h2>Problems and slow steps</h2><div class="panels">' + ''.join(parts) + '</div>'


def _trees_html(views: Sequence[Any], trajectories: Mapping[str, Trajectory]) -> str:
    """A branched run's groups as trees (``docs/branching.md``): each root with its children nested
    under it, where each was forked (turn, state), its own turns, its finish reason and reward (with
    trajectories); a click opens its detail. Empty when nothing forked."""
    children: Dict[str, List[Any]] = {}
    for v in views:
        if v.parent is not None:
            children.setdefault(v.parent, []).append(v)
    if not children:
        return ''

    def born(v: Any) -> str:
        e = next((e for e in v.events if e.trigger == 'fork' and (e.extra or {}).get('parent')), None)
        if e is None:
            return 'the prompt'
        return 'a copy of the prompt' if not e.turn else f'forked at turn {e.turn} ({e.src})'

    def item(v: Any) -> str:
        traj = trajectories.get(v.uuid)
        reward = getattr(traj, 'reward', None)
        facts = [born(v), f'{v.turns} turns', v.reason or 'unfinished'] + ([f'reward {reward:.4g}']
                                                                          if reward is not None else [])
        kids = ''.join(item(c) for c in children.get(v.uuid, ()))
        return (f'<li><span class="open" data-uuid="{escape(v.uuid)}">{escape(v.uuid)}</span> '
                f'<span class="muted">{escape(" · ".join(facts))}</span>' + (f'<ul>{kids}</ul>' if kids else '') +
                '</li>')

    roots = [v for v in views if v.parent is None and v.uuid in children]
    cards = ''.join(f'<div class="card tree"><h3>{escape(v.uuid)} ({1 + _descendants(v.uuid, children)} leaves)</h3>'
                    f'<ul>{item(v)}</ul></div>' for v in roots[:200])
    return f'<h2>Branched groups ({len(roots)})</h2><div class="panels">{cards}</div>'


def _descendants(uuid: str, children: Mapping[str, List[Any]]) -> int:
    return sum(1 + _descendants(c.uuid, children) for c in children.get(uuid, ()))


def _compactions_html(views: Sequence[Any]) -> str:
    """The requests whose context was compacted (docs/context.md): how often, after which turns,
    by which policy, and the prompt tokens before and after each compaction; empty when none was."""
    rows = []
    for view in views:
        done = [c for c in view.cells if c.compaction is not None]
        if not done:
            continue
        policies = sorted({str(c.compaction.get('policy', '')) for c in done})
        tokens = ', '.join(f"{c.compaction.get('prompt_tokens_before', '?')} → {c.compaction.get('prompt_tokens_after', '?')}"
                           for c in done)
        rows.append((view.uuid, len(done), ', '.join(str(c.turn) for c in done), ', '.join(policies), tokens))
    if not rows:
        return ''
    return ('<h2>Context compactions</h2><div class="panels">'
            + _table(f'Compacted requests ({len(rows)})', 'compactions',
                     ('request', 'compactions', 'after turns', 'policy', 'prompt tokens before → after'), rows[:200])
            + '</div>')


def _budget_html(views: Sequence[Any]) -> str:
    """Each request's turns against the context budget (docs/context.md): its fullest turn's
    prompt tokens plus ``max_tokens`` against the context, the turns whose ``max_tokens`` was cut,
    and the sum of every turn; empty when the run had no budget."""
    rows = []
    for view in views:
        turns = turn_budgets(view)
        if not turns:
            continue
        fullest = max(turns, key=lambda b: -1 if b.sent is None else b.sent)
        cut = ', '.join(str(b.turn) for b in turns if b.asked is not None) or '-'
        per_turn = ', '.join('?' if b.sent is None else str(b.sent) for b in turns)
        last = turns[-1]
        rows.append((view.uuid, fullest.turn, sent_text(fullest), cut, per_turn,
                     response_text(last.used, last.total) or '-'))
    if not rows:
        return ''
    return ('<h2>Tokens against the context budget</h2><div class="panels">'
            + _table(f'Requests under a budget ({len(rows)})', 'budget',
                     ('request', 'fullest turn', 'prompt + max_tokens / context', 'max_tokens cut at turns',
                      'prompt + max_tokens per turn', 'response budget before the last turn'), rows[:200])
            + '</div>')


def write_html(path: Union[str, Path], trace: Trace, **kwargs: Any) -> Path:
    """Write :func:`render_html` to ``path``; return the path."""
    path = Path(path)
    path.write_text(render_html(trace, **kwargs), encoding='utf-8')
    return path


_TEMPLATE = '''<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>%TITLE% · mtflow trace</title>
<style>
:root{%CSSVARS%--error:#ef4444;--warn:#eab308;--ok:#22c55e;--fg:#0f172a;--muted:#64748b;--line:#e2e8f0;--bg:#f8fafc}
*{box-sizing:border-box}
body{margin:0;font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;color:var(--fg);background:var(--bg)}
header{padding:14px 20px;background:#fff;border-bottom:1px solid var(--line);position:sticky;top:0;z-index:5}
h1{font-size:18px;margin:0 0 8px}
h2{font-size:15px;margin:18px 0 8px}
.stats{display:flex;gap:18px;flex-wrap:wrap}
.stat b{font-size:18px;margin-right:4px}.stat span{color:var(--muted)}
.controls{display:flex;gap:10px;align-items:center;margin-top:10px;flex-wrap:wrap}
.controls input,.controls select{font:inherit;padding:3px 6px;border:1px solid #cbd5e1;border-radius:5px}
.legend{display:flex;gap:12px;color:var(--muted);font-size:12px;flex-wrap:wrap}
.legend i{display:inline-block;width:12px;height:12px;border-radius:3px;vertical-align:-2px;margin-right:4px}
main{padding:8px 20px 40px}
#lanes{background:#fff;border:1px solid var(--line);border-radius:8px;overflow:auto;max-height:60vh}
.lane{display:flex;align-items:center;border-bottom:1px solid #f1f5f9;cursor:pointer;min-width:max-content}
.lane:hover,.lane.selected{background:#eff6ff}
.lane .who{width:220px;flex:none;padding:3px 8px;font-family:ui-monospace,monospace;font-size:12px;
  white-space:nowrap;overflow:hidden;text-overflow:ellipsis;position:sticky;left:0;background:inherit}
.lane .why{width:170px;flex:none;padding:3px 8px;font-size:12px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
.lane .track{display:flex;gap:2px;padding:3px 4px}
.turn{width:46px;height:18px;display:flex;gap:1px;border-radius:3px;background:#f1f5f9;flex:none}
.turn.empty{background:transparent}
.blk{flex:1;border-radius:2px}
.blk.generating{background:var(--generating)}.blk.continuing{background:var(--continuing)}
.blk.tool_step{background:var(--tool-step)}.blk.tool_step.bad{background:repeating-linear-gradient(45deg,var(--tool-step) 0 4px,var(--error) 4px 7px)}
.blk.finished{background:var(--ok);flex:0 0 9px}.blk.finished.error{background:var(--error)}
.blk.finished.limit{background:var(--warn)}
.lanehead{display:flex;position:sticky;top:0;background:#fff;border-bottom:1px solid var(--line);z-index:2;min-width:max-content}
.lanehead .who,.lanehead .why{font-weight:600;font-family:inherit;font-size:12px;padding:4px 8px}
.lanehead .who{width:220px;position:sticky;left:0;background:#fff}.lanehead .why{width:170px}
.lanehead .track{display:flex;gap:2px;padding:4px}.lanehead .turn{background:none;font-size:11px;color:var(--muted);justify-content:center}
.badge{display:inline-block;padding:0 6px;border-radius:9px;font-size:11px;color:#fff;background:var(--ok)}
.badge.error{background:var(--error)}.badge.limit{background:var(--warn);color:#111}.badge.none{background:#a855f7}
.panels{display:flex;gap:16px;flex-wrap:wrap;align-items:flex-start}
.card{background:#fff;border:1px solid var(--line);border-radius:8px;padding:10px;overflow:auto;max-width:100%}
#detail{position:fixed;top:0;right:0;bottom:0;width:min(760px,96vw);background:#fff;border-left:1px solid #cbd5e1;
  box-shadow:-6px 0 24px rgba(15,23,42,.15);overflow:auto;padding:16px 20px;z-index:10}
#detail[hidden]{display:none}
#detail .close{position:absolute;top:10px;right:14px;font-size:22px;border:none;background:none;cursor:pointer}
#detail h2{margin-top:0;font-family:ui-monospace,monospace}
.path{font-family:ui-monospace,monospace;font-size:12px;background:#f1f5f9;padding:6px 8px;border-radius:5px;word-break:break-word}
table.events{border-collapse:collapse;font-size:12px;width:100%}
table.events td,table.events th{border-bottom:1px solid #f1f5f9;padding:3px 6px;text-align:left;vertical-align:top}
table.events td:nth-child(7){white-space:nowrap}
table.events td.extra{font-family:ui-monospace,monospace;word-break:break-word}
.msg{border:1px solid var(--line);border-radius:6px;margin:6px 0;padding:6px 8px}
.msg a.thumb{display:inline-block;margin:4px 6px 0 0}.msg a.thumb img{max-width:96px;max-height:96px;border:1px solid var(--line);image-rendering:pixelated}
.msg .role{font-weight:600;font-size:12px;text-transform:uppercase;color:var(--muted)}
.msg.assistant{border-left:4px solid var(--generating)}.msg.tool{border-left:4px solid var(--tool-step)}
.msg.user{border-left:4px solid #a855f7}.msg.system{border-left:4px solid #64748b}
.msg pre{margin:4px 0 0;white-space:pre-wrap;word-break:break-word;font:13px/1.4 ui-monospace,monospace}
.seg{font:12px/1.9 ui-monospace,monospace;word-break:break-all;margin:4px 0 10px}
.tok{padding:1px 1px;margin-right:1px;border-radius:2px;white-space:pre-wrap}
.tok.on{background:#dcfce7;border-bottom:2px solid var(--ok)}
.tok.off{background:#f1f5f9;color:#94a3b8;text-decoration:line-through}
.err{color:var(--error);font-weight:600}
tr.open{cursor:pointer}tr.open:hover{background:#eff6ff}.tree ul{margin:2px 0;padding-left:18px}.tree .open{cursor:pointer;font-family:monospace}.tree .open:hover{background:#eff6ff}.card h3{margin:2px 0 6px;font-size:14px}
.muted{color:var(--muted)}
#timeaxis{background:#fff;border:1px solid var(--line);border-radius:8px;overflow:auto;max-height:60vh}
.tlane{display:flex;align-items:center;border-bottom:1px solid #f1f5f9;cursor:pointer;min-width:900px}
.tlane:hover,.tlane.selected{background:#eff6ff}
.tlane .who{width:220px;flex:none;padding:2px 8px;font-family:ui-monospace,monospace;font-size:12px;
  white-space:nowrap;overflow:hidden;text-overflow:ellipsis;position:sticky;left:0;background:inherit;z-index:1}
.ttrack{position:relative;flex:1;height:14px;margin:2px 10px 2px 4px}
.tspan{position:absolute;top:1px;bottom:1px;min-width:1px;border-radius:2px}
.tspan.pending{background:#e2e8f0}.tspan.generating{background:var(--generating)}
.tspan.continuing{background:var(--continuing)}.tspan.tool_step{background:var(--tool-step)}
.tend{position:absolute;top:0;bottom:0;width:3px;border-radius:1px;background:var(--ok)}
.tend.error{background:var(--error)}.tend.limit{background:var(--warn)}.tend.none{background:#a855f7}
.tbar{position:absolute;top:-2px;bottom:-2px;width:0;border-left:1px dashed #0f172a;opacity:.55;pointer-events:none}
.taxis{display:flex;position:sticky;top:0;background:#fff;border-bottom:1px solid var(--line);z-index:2;min-width:900px}
.taxis .who{width:220px;flex:none;padding:4px 8px;font-size:12px;font-weight:600;position:sticky;left:0;background:#fff}
.taxis .ttrack{height:34px}
.tick{position:absolute;top:0;font-size:11px;color:var(--muted);border-left:1px solid var(--line);padding-left:3px;height:16px}
.tturn{position:absolute;top:17px;height:14px;font-size:10px;line-height:14px;color:#fff;background:#475569;
  border-radius:3px;padding:0 3px;white-space:nowrap;min-width:2px;opacity:.8}
.tturn.spread{background:#cbd5e1;color:#0f172a}
i.sw{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:5px;vertical-align:-1px}
i.sw.pending{background:#e2e8f0}i.sw.generating{background:var(--generating)}i.sw.continuing{background:var(--continuing)}
i.sw.tool_step{background:var(--tool-step)}
%RESULTS_CSS%
</style>
</head>
<body>
<header>
<h1>%TITLE%</h1>
%RUN%
<div class="stats">%STATS%</div>
<div class="controls">
<input id="filter" type="search" placeholder="filter by uuid" aria-label="filter by uuid">
<select id="reason" aria-label="finish reason"><option value="">all finish reasons</option>%REASONS%<option value="__none">unfinished</option></select>
<span id="shown" class="muted"></span>
<div class="legend"><span><i style="background:var(--generating)"></i>generating</span>
<span><i style="background:var(--continuing)"></i>continuing</span><span><i style="background:var(--tool-step)"></i>tool_step</span>
<span><i style="background:repeating-linear-gradient(45deg,var(--tool-step) 0 4px,var(--error) 4px 7px)"></i>tool error</span>
<span><i style="background:var(--ok)"></i>finished</span><span><i style="background:var(--warn)"></i>%LIMIT_REASONS%</span>
<span><i style="background:var(--error)"></i>%ERROR_REASONS%</span></div>
</div>
</header>
<main>
%RESULTS%
<h2>Requests</h2>
<div id="lanes" role="list"></div>
<h2>Time axis</h2>
<p class="muted" id="timeaxis-note">Each request's states drawn by wall time. Dashed lines: a turn barrier (every request
applied that turn's output at the same moment, waiting for the slowest generation and tool of the batch: a lockstep run).
Grey bands: turns whose outputs arrived spread over time (async mode).</p>
<div id="timeaxis" role="list"></div>
<div class="panels">%TIMETABLE%</div>
<h2>State graph and charts</h2>
<div class="panels"><div class="card">%GRAPH%</div><div class="card">%CHARTS%</div></div>
%PROBLEMS%
</main>
<aside id="detail" hidden aria-live="polite"><button class="close" title="close (Esc)" aria-label="close">×</button><div id="detail-body"></div></aside>
<script type="application/json" id="mtflow-data">%DATA%</script>
<script>%SCRIPT%
%RESULTS_SCRIPT%</script>
</body>
</html>
'''

_SCRIPT = r'''
(function(){
'use strict';
var DATA = JSON.parse(document.getElementById('mtflow-data').textContent);
function el(tag, cls, text){var e=document.createElement(tag); if(cls) e.className=cls; if(text!==undefined&&text!==null) e.textContent=String(text); return e;}
function reasonClass(r){ if(r===null||r===undefined) return 'none'; return DATA.reason_kinds[r] || 'ok'; }
function ms(s){ if(s===null||s===undefined) return ''; return s<1 ? (s*1000).toFixed(1)+' ms' : s.toFixed(2)+' s'; }
var lanes = document.getElementById('lanes');
var head = el('div','lanehead'); head.appendChild(el('div','who','request')); head.appendChild(el('div','why','finish'));
var ht = el('div','track'); for(var t=1;t<=DATA.max_turn;t++){ ht.appendChild(el('div','turn',t)); } head.appendChild(ht);
lanes.appendChild(head);
var laneEls = [];
DATA.requests.forEach(function(r, ri){
  var lane = el('div','lane'); lane.setAttribute('role','listitem'); lane.dataset.uuid = r.uuid; lane.dataset.reason = r.reason===null?'__none':r.reason;
  var who = el('div','who', r.uuid); who.title = r.uuid + ' (index '+r.index+', rank '+r.rank+')'; lane.appendChild(who);
  var why = el('div','why'); why.appendChild(el('span','badge '+reasonClass(r.reason), r.reason===null?'unfinished':r.reason)); lane.appendChild(why);
  var track = el('div','track'); var byTurn = {};
  r.cells.forEach(function(c){ byTurn[c.turn]=c; });
  for(var t=1;t<=DATA.max_turn;t++){
    var c = byTurn[t]; var slot = el('div', c ? 'turn' : 'turn empty');
    if(c){
      var tip = ['turn '+t];
      var tools = c.tools||[], terrs = c.tool_errors||[];
      if(c.wait){ slot.appendChild(el('div','blk '+c.wait)); tip.push(c.wait + (c.tokens!=null?' ('+c.tokens+' tokens)':'')); }
      if(c.stepped){ var b = el('div','blk tool_step'+(terrs.length?' bad':'')); slot.appendChild(b);
        tip.push('tool_step'+(c.step_s!=null?' '+ms(c.step_s):'')+(tools.length?' tools: '+tools.join(', '):''));
        terrs.forEach(function(m){ tip.push('tool error: '+m); }); }
      if(c.finished!=null){ slot.appendChild(el('div','blk finished '+reasonClass(c.finished))); tip.push('finished('+c.finished+')');
        if(c.error) tip.push((c.error.type||'')+': '+(c.error.message||'')); }
      slot.title = tip.join('\n');
    }
    track.appendChild(slot);
  }
  lane.appendChild(track);
  lane.addEventListener('click', function(){ openDetail(ri); });
  lanes.appendChild(lane); laneEls.push(lane);
});
var timeEls = [];
(function timeAxis(){
  var box = document.getElementById('timeaxis'), wall = DATA.wall;
  if(!wall || wall <= 0){ box.appendChild(el('p','muted','The trace has no event times: no time axis.')); return; }
  function pct(t){ return (100 * t / wall).toFixed(3) + '%'; }
  var axis = el('div','taxis'); axis.appendChild(el('div','who','request / wall time'));
  var at = el('div','ttrack');
  for(var k=0;k<=4;k++){ var tk = el('div','tick', ms(wall*k/4)); tk.style.left = pct(wall*k/4); if(k===4){ tk.style.left=''; tk.style.right='0'; } at.appendChild(tk); }
  var barriers = [];
  (DATA.turn_marks||[]).forEach(function(m){
    var b = el('div', 'tturn' + (m.barrier ? '' : ' spread'), m.barrier ? String(m.turn) : 't' + m.turn);
    b.style.left = pct(m.first); if(!m.barrier) b.style.width = 'calc(' + pct(Math.max(m.last - m.first, 0)) + ' + 2px)';
    b.title = 'turn ' + m.turn + ': ' + m.n + ' outputs applied between ' + ms(m.first) + ' and ' + ms(m.last) +
      (m.barrier ? ' (a turn barrier)' : '');
    at.appendChild(b); if(m.barrier) barriers.push(m.first);
  });
  axis.appendChild(at); box.appendChild(axis);
  DATA.requests.forEach(function(r, ri){
    var lane = el('div','tlane'); lane.setAttribute('role','listitem'); lane.dataset.uuid = r.uuid;
    lane.dataset.reason = r.reason===null?'__none':r.reason;
    lane.appendChild(el('div','who', r.uuid));
    var tr = el('div','ttrack');
    r.spans.forEach(function(sp){
      var b = el('div','tspan '+sp[0]); b.style.left = pct(sp[1]); b.style.width = pct(Math.max(sp[2]-sp[1], 0));
      b.title = sp[0] + ' · turn ' + sp[3] + ' · ' + ms(sp[2]-sp[1]) + ' (' + ms(sp[1]) + ' → ' + ms(sp[2]) + ')';
      tr.appendChild(b); });
    if(r.end !== null && r.end !== undefined){ var e = el('div','tend '+reasonClass(r.reason)); e.style.left = 'calc(' + pct(r.end) + ' - 1px)';
      e.title = (r.reason===null?'unfinished':'finished('+r.reason+')') + ' at ' + ms(r.end); tr.appendChild(e); }
    barriers.forEach(function(t){ var bl = el('div','tbar'); bl.style.left = pct(t); tr.appendChild(bl); });
    lane.appendChild(tr);
    lane.addEventListener('click', function(){ openDetail(ri); });
    box.appendChild(lane); timeEls.push(lane);
  });
})();
var byUuid = {}; DATA.requests.forEach(function(r, ri){ if(!(r.uuid in byUuid)) byUuid[r.uuid]=ri; });
var filter = document.getElementById('filter'), reasonSel = document.getElementById('reason'), shown = document.getElementById('shown');
function applyFilter(){
  var q = filter.value.trim().toLowerCase(), rs = reasonSel.value, n = 0;
  var also = window.mtflowVisible || function(){ return true; };  // the request table's where/search (results.py)
  laneEls.forEach(function(l){ var ok = (!q || l.dataset.uuid.toLowerCase().indexOf(q)>=0) && (!rs || l.dataset.reason===rs) && also(l.dataset.uuid);
    l.style.display = ok ? '' : 'none'; if(ok) n++; });
  timeEls.forEach(function(l){ var ok = (!q || l.dataset.uuid.toLowerCase().indexOf(q)>=0) && (!rs || l.dataset.reason===rs) && also(l.dataset.uuid);
    l.style.display = ok ? '' : 'none'; });
  shown.textContent = n + ' of ' + laneEls.length + ' requests shown';
}
filter.addEventListener('input', applyFilter); reasonSel.addEventListener('change', applyFilter); applyFilter();
window.mtflowFilterLanes = applyFilter;

var detail = document.getElementById('detail'), body = document.getElementById('detail-body');
function section(title){ var h = el('h3', null, title); body.appendChild(h); return h; }
function openDetail(ri){
  var r = DATA.requests[ri], uuid = r.uuid, tr = DATA.trajectories[uuid];
  laneEls.forEach(function(l, li){ l.classList.toggle('selected', li===ri); });
  timeEls.forEach(function(l, li){ l.classList.toggle('selected', li===ri); });
  body.textContent = '';
  body.appendChild(el('h2', null, uuid));
  if(r){
    var meta = el('p'); meta.appendChild(el('span','badge '+reasonClass(r.reason), r.reason===null?'unfinished':r.reason));
    meta.appendChild(document.createTextNode('  index '+r.index+' · rank '+r.rank+' · '+r.turns+' turns · '+r.tokens+' completion tokens'));
    body.appendChild(meta);
    body.appendChild(el('div','path',r.path));
    section('Events');
    var tbl = el('table','events'); var hr = el('tr');
    ['turn','from','to','trigger','reason','tokens','time','extra'].forEach(function(h){ hr.appendChild(el('th',null,h)); });
    tbl.appendChild(hr);
    r.events.forEach(function(e){ var row = el('tr');  // [turn, from, to, trigger, reason, tokens, duration_s, extra]
      [e[0],e[1],e[2],e[3],e[4]||'',e[5]==null?'':e[5],ms(e[6])].forEach(function(v){ row.appendChild(el('td',null,v)); });
      var x = el('td','extra', e[7] ? JSON.stringify(e[7]) : ''); if(e[7] && e[7].error) x.classList.add('err'); row.appendChild(x);
      tbl.appendChild(row); });
    body.appendChild(tbl);
  }
  if(!tr){ body.appendChild(el('p','muted','No trajectory for this request: pass --trajectories FILE to see its messages and loss mask.')); }
  else {
    section('Messages ('+tr.messages.length+')');
    tr.messages.forEach(function(m, k){ var box = el('div','msg '+(m.role||''));
      box.appendChild(el('div','role','['+k+'] '+(m.role||'?')));
      if(typeof m.reasoning_content === 'string') box.appendChild(el('pre','muted','reasoning: '+m.reasoning_content));
      var content = (typeof m.content === 'string') ? m.content : JSON.stringify(m.content);
      box.appendChild(el('pre', null, content));
      ((tr.message_images||[])[k]||[]).forEach(function(i){ var im = tr.images[i]; if(!im) return;  // the images this message brought
        var a = el('a','thumb'); a.href = im.href; a.target = '_blank'; a.title = im.name + ' (full size)';
        if(im.thumb){ var img = document.createElement('img'); img.src = im.thumb; img.alt = im.name; a.appendChild(img); }
        else a.appendChild(document.createTextNode('missing: '+im.name));
        box.appendChild(a); });
      if(m.tool_calls) box.appendChild(el('pre','muted','tool_calls: '+JSON.stringify(m.tool_calls)));
      body.appendChild(box); });
    section('Tokens and loss mask');
    var legend = el('p','muted'); legend.appendChild(el('span','tok on','trained (mask 1)')); legend.appendChild(document.createTextNode(' '));
    legend.appendChild(el('span','tok off','masked (mask 0)'));
    legend.appendChild(document.createTextNode(DATA.decoded ? '  · tokens decoded one by one' : '  · token ids (no tokenizer given)'));
    if(!tr.has_mask) legend.appendChild(document.createTextNode('  · no loss mask recorded: every token is trained'));
    body.appendChild(legend);
    tr.segments.forEach(function(s, k){
      var trained = s.mask.reduce(function(a,b){return a+(b?1:0);},0);
      body.appendChild(el('div','muted','segment '+(k+1)+': '+s.ids.length+' tokens, '+trained+' trained, '+s.logprobs.length+' logprobs'));
      var seg = el('div','seg'); var lpAll = s.logprobs.length === s.ids.length, j = 0;
      s.ids.forEach(function(id, i){ var on = !!s.mask[i];
        var text = s.text ? s.text[i] : String(id);
        var t = el('span','tok '+(on?'on':'off'), s.text ? text.replace(/\n/g,'\u23ce\n') : text);
        var lp = lpAll ? s.logprobs[i] : (on && s.logprobs.length===trained ? s.logprobs[j] : undefined); if(on) j++;
        t.title = 'id '+id+' · mask '+(on?1:0)+(lp!==undefined?' · logprob '+Number(lp).toFixed(4):'');
        seg.appendChild(t); if(!s.text) seg.appendChild(document.createTextNode(' ')); });
      body.appendChild(seg); });
    if(tr.infos && Object.keys(tr.infos).length){ section('rollout_infos');
      var infos = {}, record = tr.infos.token_record; Object.keys(tr.infos).forEach(function(k){ if(k!=='token_record') infos[k] = tr.infos[k]; });
      body.appendChild(el('pre','path',JSON.stringify(infos, null, 1)));
      if(record!==undefined){ var d = el('details','token-record'), ids = JSON.stringify(record);  // hundreds of ids: collapsed
        d.appendChild(el('summary',null,'token_record ('+ids.length+' characters)')); d.appendChild(el('pre','path',ids)); body.appendChild(d); } }
  }
  detail.hidden = false;
  if(location.hash !== '#'+encodeURIComponent(uuid)) history.replaceState(null,'','#'+encodeURIComponent(uuid));
}
function closeDetail(){ detail.hidden = true; laneEls.concat(timeEls).forEach(function(l){ l.classList.remove('selected'); });
  history.replaceState(null,'',location.pathname+location.search); }
detail.querySelector('.close').addEventListener('click', closeDetail);
document.addEventListener('keydown', function(e){ if(e.key==='Escape') closeDetail(); });
function fromHash(){ if(location.hash.length>1){ var u = decodeURIComponent(location.hash.slice(1)); if(u in byUuid) openDetail(byUuid[u]); } }
window.addEventListener('hashchange', fromHash); fromHash();
window.mtflowOpen = openDetail;
document.querySelectorAll('tr.open, .tree .open').forEach(function(tr){ tr.addEventListener('click', function(){
  var u = tr.getAttribute('data-uuid'); if(u in byUuid) openDetail(byUuid[u]); }); });
})();
'''
