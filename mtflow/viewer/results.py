"""The results part of the HTML page: what a run earned and where it went wrong.

* the header's run name and config (``run.json``'s fingerprint config, ``summary.json``'s
  figures, both found next to the trace file by ``mtflow trace html``);
* summary statistics (from ``summary.json``, else computed from the trajectories);
* plots: reward histogram, mean reward per group, turns per request, tokens per turn, finish
  reasons, tool latency when the run made tool calls (:mod:`mtflow.viewer.plots`);
* a table of requests, sortable by any column and filtered by a ``FIELD OP VALUE`` condition
  (the grammar of ``trace show --where``, :mod:`mtflow.viewer.query`), the finish-reason select
  and a text search across the messages;
* a group view: a GRPO group's copies side by side (reward, finish reason, turns, messages).

The page's script reads every value through ``textContent``; nothing here reaches it as markup
but what is escaped.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter
from html import escape
from typing import Any, Dict, List, Mapping, Optional, Sequence

from mtflow.core.machine import reason_kind
from mtflow.run.tally import tool_error_kinds
from mtflow.viewer.model import RequestView
from mtflow.viewer.plots import column_chart_svg, histogram_svg
from mtflow.viewer.svg import bar_chart_svg

__all__ = ['request_results', 'summary_cards_html', 'plots_html', 'header_run_html', 'RESULTS_HTML', 'RESULTS_CSS',
           'RESULTS_SCRIPT']

_KIND_COLORS = {'error': '#ef4444', 'limit': '#eab308', 'ok': '#22c55e'}


def request_results(view: RequestView, traj: Any) -> Dict[str, Any]:
    """The table's columns of one request (reward and group from its trajectory line)."""
    kinds = [k for c in view.cells for k in tool_error_kinds(c.step_extra)]
    return {'reward': getattr(traj, 'reward', None), 'group': getattr(traj, 'group', None) or view.uuid,
            'tool_error_kinds': kinds, 'n_tool_errors': len(view.tool_errors)}


def _rewards(views: Sequence[RequestView], trajectories: Mapping[str, Any]) -> Dict[str, float]:
    out = {}
    for v in views:
        reward = getattr(trajectories.get(v.uuid), 'reward', None)
        if reward is not None and not math.isnan(reward):
            out[v.uuid] = reward
    return out


def _group_means(views: Sequence[RequestView], trajectories: Mapping[str, Any]) -> Dict[str, float]:
    by_group: Dict[str, List[float]] = {}
    for uuid, reward in _rewards(views, trajectories).items():
        group = getattr(trajectories.get(uuid), 'group', None) or uuid
        by_group.setdefault(group, []).append(reward)
    return {g: round(sum(rs) / len(rs), 4) for g, rs in by_group.items()}


def summary_cards_html(summary: Optional[Mapping[str, Any]], views: Sequence[RequestView],
                       trajectories: Mapping[str, Any]) -> str:
    """The run's figures, one card each: from ``summary.json`` when given, else from the files."""
    rewards = list(_rewards(views, trajectories).values())
    groups = _group_means(views, trajectories)
    cards: List[tuple] = []
    s = dict(summary or {})
    cards.append(('requests', s.get('requests', len(views))))
    mean = s.get('reward_mean', round(statistics.fmean(rewards), 4) if rewards else None)
    if mean is not None:
        cards.append(('mean reward', mean))
    if rewards:
        cards.append(('rewarded (> 0)', f'{sum(1 for r in rewards if r > 0)} of {len(rewards)}'))
    rg = s.get('reward_groups') or {}
    if rg:
        cards.append(('groups', rg.get('groups')))
        cards.append(('groups with a reward spread', f"{rg.get('with_spread')} of {rg.get('groups')}"))
        cards.append(('mean in-group std', rg.get('mean_std')))
    elif len(groups) < len(rewards):
        cards.append(('groups', len(groups)))
    turns = s.get('turns') or {}
    if turns:
        cards.append(('turns per request', f"{turns.get('min')} / {turns.get('mean')} / {turns.get('max')}"))
    for key, label in (('tool_calls', 'tool calls'), ('tool_errors', 'tool errors'), ('errors', 'request errors'),
                       ('generated_tokens', 'generated tokens'), ('tokens_per_s', 'tokens/s'), ('wall_s', 'wall s')):
        if s.get(key) is not None:
            cards.append((label, s[key]))
    if s.get('status') and s.get('status') != 'complete':
        cards.append(('status', s['status']))
    body = ''.join(f'<div class="rcard" data-key="{escape(label)}"><b>{escape(str(value))}</b>'
                   f'<span>{escape(label)}</span></div>' for label, value in cards)
    note = '' if summary else '<p class="muted">No summary.json next to the trace: figures from the files.</p>'
    return f'<div class="rcards">{body}</div>{note}'


def plots_html(views: Sequence[RequestView], trajectories: Mapping[str, Any],
               finish_reasons: Mapping[str, int]) -> str:
    """The six plots, each an inline ``<svg class="plot ...">``."""
    rewards = list(_rewards(views, trajectories).values())
    tokens_per_turn = [c.tokens for v in views for c in v.cells if c.tokens is not None]
    latencies = []  # of tool calls only: a step without one (an environment's move) is no tool's latency
    for v in views:
        for c in v.cells:
            calls = (c.step_extra or {}).get('calls') if isinstance(c.step_extra, dict) else None
            timed = [x.get('seconds') for x in calls if isinstance(x, dict)] if isinstance(calls, list) else []
            latencies += [t * 1000 for t in timed if isinstance(t, (int, float))]
    turns = Counter(v.turns for v in views)
    plots = [
        histogram_svg(rewards, 'reward', 'plot plot-reward', color='#8b5cf6') if rewards else '',
        column_chart_svg(_group_means(views, trajectories), 'mean reward per group', 'plot plot-groups',
                         color='#8b5cf6', note='click a group in the table to compare its copies') if rewards else '',
        column_chart_svg({str(t): n for t, n in sorted(turns.items())}, 'turns per request', 'plot plot-turns'),
        histogram_svg(tokens_per_turn, 'tokens per turn', 'plot plot-tokens', color='#06b6d4'),
        bar_chart_svg(dict(finish_reasons), 'finish reasons',
                      {r: _KIND_COLORS.get(reason_kind(r), _KIND_COLORS['ok']) for r in finish_reasons},
                      css_class='plot plot-reasons'),
        histogram_svg(latencies, 'tool latency (ms)', 'plot plot-latency', color='#f59e0b') if latencies else '',
    ]
    return ''.join(f'<div class="card">{p}</div>' for p in plots if p)


def header_run_html(run_name: Optional[str], config_text: Optional[str]) -> str:
    """The run's name and, collapsed, its config."""
    parts = []
    if run_name:
        parts.append(f'<span class="runname">run <b>{escape(run_name)}</b></span>')
    if config_text:
        parts.append(f'<details class="runconfig"><summary>config</summary><pre>{escape(config_text)}</pre></details>')
    return f'<div class="run">{"".join(parts)}</div>' if parts else ''


RESULTS_HTML = '''<h2>Results</h2>
%CARDS%
<div class="panels plots">%PLOTS%</div>
<h2>Request table</h2>
<div class="controls tablecontrols">
<input id="where" type="search" placeholder="where: reward==0, turns>=3, reason==stop_rule:*, group==p7" aria-label="where" size="42">
<input id="search" type="search" placeholder="search the messages" aria-label="search the messages">
<span id="where-error" class="err"></span><span id="table-shown" class="muted"></span>
</div>
<div id="tablebox"><table id="reqtable" class="events"><thead><tr>
<th data-key="uuid">request</th><th data-key="group">group</th><th data-key="reward">reward</th>
<th data-key="reason">finish</th><th data-key="turns">turns</th><th data-key="tokens">tokens</th>
<th data-key="tool_errors">tool errors</th></tr></thead><tbody></tbody></table></div>
<section id="groupview" hidden><h2 id="group-title"></h2><button class="close" id="group-close" aria-label="close">×</button>
<div id="group-copies"></div></section>
'''

RESULTS_CSS = '''
.run{display:flex;gap:14px;align-items:baseline;margin:-4px 0 8px;flex-wrap:wrap}.runname{color:var(--muted)}
.runconfig summary{cursor:pointer;color:var(--muted)}.runconfig pre{font:12px/1.4 ui-monospace,monospace;background:#f1f5f9;
  padding:6px 8px;border-radius:5px;max-height:40vh;overflow:auto;margin:4px 0}
.rcards{display:flex;gap:10px;flex-wrap:wrap}.rcard{background:#fff;border:1px solid var(--line);border-radius:8px;padding:8px 12px}
.rcard b{display:block;font-size:18px}.rcard span{color:var(--muted);font-size:12px}
.plots{margin-top:10px}
#tablebox{background:#fff;border:1px solid var(--line);border-radius:8px;overflow:auto;max-height:50vh}
#reqtable{width:100%}#reqtable th{cursor:pointer;position:sticky;top:0;background:#fff;user-select:none}
#reqtable th.asc::after{content:" \\25B2"}#reqtable th.desc::after{content:" \\25BC"}
#reqtable td.num{text-align:right;font-variant-numeric:tabular-nums}
#reqtable a.grp{color:#7c3aed;cursor:pointer;text-decoration:underline}
#groupview{background:#fff;border:1px solid var(--line);border-radius:8px;padding:10px 14px;margin-top:12px;position:relative}
#groupview .close{position:absolute;top:6px;right:10px;font-size:20px;border:none;background:none;cursor:pointer}
#group-copies{display:flex;gap:10px;overflow-x:auto;align-items:flex-start}
.copy{flex:1 0 240px;max-width:420px;border:1px solid var(--line);border-radius:6px;padding:6px 8px}
.copy h4{margin:0 0 4px;font-family:ui-monospace,monospace;cursor:pointer}
.copy .msg pre{max-height:180px;overflow:auto}
mark{background:#fde68a}
details.token-record summary{cursor:pointer;color:var(--muted)}
'''

RESULTS_SCRIPT = r'''
(function(){
'use strict';
var DATA = JSON.parse(document.getElementById('mtflow-data').textContent);
function el(tag, cls, text){var e=document.createElement(tag); if(cls) e.className=cls; if(text!==undefined&&text!==null) e.textContent=String(text); return e;}
var tbody = document.querySelector('#reqtable tbody'); if(!tbody) return;
var NUM = ['reward','turns','tokens','index','rank','tool_errors'], TEXT = ['reason','group','uuid','tool_error'];
function val(r, f){ if(f==='tool_errors') return r.n_tool_errors; if(f==='reason') return r.reason===null?'none':r.reason; return r[f]; }
function glob(p){ return new RegExp('^'+p.replace(/[.+^${}()|\\]/g,'\\$&').replace(/\*/g,'.*').replace(/\?/g,'.')+'$'); }
// the grammar of `mtflow trace show --where` (mtflow/viewer/query.py)
function parseWhere(text){
  var m = /^\s*([a-z_]+)\s*(<=|>=|==|!=|<|>|=)\s*(.*?)\s*$/.exec(text);
  if(!m) throw new Error("expected FIELD OP VALUE, e.g. reward<0.5");
  var f = m[1], op = m[2], raw = m[3];
  if(NUM.indexOf(f)<0 && TEXT.indexOf(f)<0) throw new Error('unknown field '+f+'; fields: '+NUM.concat(TEXT).join(', '));
  if(TEXT.indexOf(f)>=0){
    if(['=','==','!='].indexOf(op)<0) throw new Error(f+' is text; compare it with == or !=');
    var re = glob(raw), want = op!=='!=';
    if(f==='tool_error') return function(r){ return r.tool_error_kinds.some(function(k){ return re.test(k); })===want; };
    return function(r){ return re.test(String(val(r,f)))===want; };
  }
  if(/^(none|null)$/i.test(raw) && ['=','==','!='].indexOf(op)>=0){ var w = op!=='!='; return function(r){ return (val(r,f)===null||val(r,f)===undefined)===w; }; }
  var x = Number(raw); if(raw==='' || isNaN(x)) throw new Error(f+' is a number; '+JSON.stringify(raw)+' is not');
  var cmp = {'<':function(a){return a<x;},'<=':function(a){return a<=x;},'>':function(a){return a>x;},'>=':function(a){return a>=x;},
             '==':function(a){return a===x;},'=':function(a){return a===x;},'!=':function(a){return a!==x;}}[op];
  return function(r){ var v = val(r,f); return v!==null && v!==undefined && cmp(v); };
}
var texts = {};  // uuid -> all message text, lower case (the search)
DATA.requests.forEach(function(r){ var t = DATA.trajectories[r.uuid];
  texts[r.uuid] = t ? t.messages.map(function(m){ return typeof m.content==='string' ? m.content : JSON.stringify(m.content); }).join('\n').toLowerCase() : ''; });
var rows = DATA.requests.map(function(r, ri){
  var tr = el('tr','open'); tr.dataset.uuid = r.uuid;
  tr.appendChild(el('td',null,r.uuid));
  var g = el('td'); var a = el('a','grp',r.group); a.title = 'compare the copies of group '+r.group;
  a.addEventListener('click', function(ev){ ev.stopPropagation(); openGroup(r.group); }); g.appendChild(a); tr.appendChild(g);
  tr.appendChild(el('td','num reward', r.reward===null||r.reward===undefined ? '-' : Number(r.reward.toPrecision(4))));
  tr.appendChild(el('td',null, r.reason===null?'unfinished':r.reason));
  tr.appendChild(el('td','num',r.turns)); tr.appendChild(el('td','num',r.tokens)); tr.appendChild(el('td','num',r.n_tool_errors));
  tr.addEventListener('click', function(){ if(window.mtflowOpen) window.mtflowOpen(ri); });
  tbody.appendChild(tr); return {r: r, tr: tr};
});
var where = document.getElementById('where'), search = document.getElementById('search'), werr = document.getElementById('where-error');
var shown = document.getElementById('table-shown'), predicate = null;
function visible(r){
  var q = search.value.trim().toLowerCase();
  return (!predicate || predicate(r)) && (!q || texts[r.uuid].indexOf(q)>=0);
}
window.mtflowVisible = function(uuid){ var row = rows.filter(function(x){ return x.r.uuid===uuid; })[0]; return !row || visible(row.r); };
function apply(){
  werr.textContent = ''; predicate = null;
  var conds = where.value.split(/\s*(?:,|&&|\band\b)\s*/).filter(function(c){ return c.trim(); });
  try { var ps = conds.map(parseWhere); predicate = ps.length ? function(r){ return ps.every(function(p){ return p(r); }); } : null; }
  catch(e){ werr.textContent = e.message; }
  var n = 0; rows.forEach(function(x){ var ok = visible(x.r); x.tr.style.display = ok ? '' : 'none'; if(ok) n++; });
  shown.textContent = n + ' of ' + rows.length + ' requests in the table';
  if(window.mtflowFilterLanes) window.mtflowFilterLanes();
}
where.addEventListener('input', apply); search.addEventListener('input', apply);
var sortKey = null, sortDir = 1;
document.querySelectorAll('#reqtable th').forEach(function(th){ th.addEventListener('click', function(){
  var k = th.dataset.key; sortDir = (sortKey===k) ? -sortDir : (NUM.indexOf(k)>=0 ? -1 : 1); sortKey = k;
  document.querySelectorAll('#reqtable th').forEach(function(h){ h.classList.remove('asc','desc'); });
  th.classList.add(sortDir>0 ? 'asc' : 'desc');
  rows.sort(function(a, b){ var x = val(a.r,k), y = val(b.r,k);
    var nx = x===null||x===undefined, ny = y===null||y===undefined; if(nx||ny) return nx===ny ? 0 : (nx ? 1 : -1);  // no value: last
    return (x<y ? -1 : x>y ? 1 : 0) * sortDir; });
  rows.forEach(function(x){ tbody.appendChild(x.tr); });
}); });
var gv = document.getElementById('groupview'), gcopies = document.getElementById('group-copies');
function openGroup(g){
  gcopies.textContent = '';
  var members = DATA.requests.map(function(r, ri){ return [r, ri]; }).filter(function(x){ return x[0].group===g; })
    .sort(function(a, b){ return a[0].index - b[0].index; });  // the copies in dataset order
  var rw = members.map(function(x){ return x[0].reward; }).filter(function(v){ return v!==null&&v!==undefined; });
  var mean = rw.length ? rw.reduce(function(a,b){return a+b;},0)/rw.length : null;
  document.getElementById('group-title').textContent = 'group ' + g + ': ' + members.length + ' copies' +
    (mean===null ? '' : ', mean reward ' + Number(mean.toPrecision(4)));
  var q = search.value.trim().toLowerCase();
  members.forEach(function(x){ var r = x[0], ri = x[1], c = el('div','copy'); c.dataset.uuid = r.uuid;
    var h = el('h4',null,r.uuid); h.addEventListener('click', function(){ if(window.mtflowOpen) window.mtflowOpen(ri); }); c.appendChild(h);
    c.appendChild(el('div','muted copy-meta','reward '+(r.reward===null||r.reward===undefined?'-':Number(r.reward.toPrecision(4)))+
      ' · '+(r.reason===null?'unfinished':r.reason)+' · '+r.turns+' turns · '+r.tokens+' tokens'));
    var t = DATA.trajectories[r.uuid];
    (t ? t.messages : []).forEach(function(m){ if(m.role==='system') return; var box = el('div','msg '+(m.role||''));
      box.appendChild(el('div','role',m.role||'?'));
      var content = (typeof m.content === 'string') ? m.content : JSON.stringify(m.content), pre = el('pre');
      var i = q ? content.toLowerCase().indexOf(q) : -1;
      if(i>=0){ pre.appendChild(document.createTextNode(content.slice(0,i))); pre.appendChild(el('mark',null,content.slice(i,i+q.length)));
        pre.appendChild(document.createTextNode(content.slice(i+q.length))); } else pre.textContent = content;
      box.appendChild(pre); c.appendChild(box); });
    gcopies.appendChild(c); });
  gv.hidden = false; gv.scrollIntoView({block:'nearest'});
}
window.mtflowOpenGroup = openGroup;
document.getElementById('group-close').addEventListener('click', function(){ gv.hidden = true; });
apply();
})();
'''
