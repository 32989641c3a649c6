"""Terminal views of a trace, drawn with ``rich``: the per-request timeline, the batch summary and
one request's detail (messages and the loss mask token by token).

The same renderables give colored output on a terminal and plain text (:func:`format_trace`) for
the pytest plugin and for files; the marks are letters, so nothing depends on color.
"""
from __future__ import annotations

import io
import json
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from mtflow.core.machine import CONTEXT_FULL, CONTINUING, FINISH_REASONS, GENERATING, LENGTH_TOTAL, TOOL_STEP, reason_kind
from mtflow.core.trace import Trace
from mtflow.run.trajectories import Trajectory
from mtflow.viewer.budget import budget_per_turn, has_budget, response_text, sent_text, turn_budgets
from mtflow.viewer.images import image_refs, per_message
from mtflow.viewer.model import (COMPACTED_MARK, ERROR_MARK, OK_MARK, TOOL_ERROR_MARK, RequestView, Summary, request_views,
                                 summarize)
from mtflow.viewer.tokens import token_texts

CELL = 4  # characters per turn in the timeline (the widest cell, 'GT!✗', is 4)
SHARED_MARK = '='  # a fork's child: a turn it shares with its parent (docs/branching.md)
STYLES = {GENERATING: 'bold blue', CONTINUING: 'bold cyan', TOOL_STEP: 'yellow'}
LEGEND = (f'G generating  C continuing  T tool_step  {TOOL_ERROR_MARK} tool error  '
          f'{OK_MARK} finished  {ERROR_MARK} failed ({"/".join(r for r in FINISH_REASONS if reason_kind(r) == "error")})')


# C0 controls but newline and tab, DEL, C1 controls, and the BIDI overrides, embeddings, isolates
# and marks that reorder what a reader sees (the "Trojan Source" set)
_UNSAFE = re.compile('[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]')


def _visible(m: 're.Match[str]') -> str:
    c = m.group(0)
    return f'\\x{ord(c):02x}' if ord(c) < 0x100 else f'\\u{ord(c):04x}'


def safe_text(value: Any, style: str = '') -> Text:
    """Text from a trace or a model, shown as data: never parsed as rich markup (a ``Text``, not a
    markup string), and every terminal control or BIDI character written out visibly (``\\x1b``,
    ``\\u202e``), so that output cannot set the title, clear the screen, link, or reorder the line.
    Trajectories keep the bytes exactly; only this view escapes them."""
    return Text(_UNSAFE.sub(_visible, value if isinstance(value, str) else str(value)), style)


def fmt_s(seconds: Optional[float]) -> str:
    """A duration for people: ``0.8 ms``, ``12.3 ms``, ``1.50 s``."""
    if seconds is None:
        return ''
    return f'{seconds * 1000:.1f} ms' if seconds < 1 else f'{seconds:.2f} s'


_KIND_STYLES = {'none': 'magenta', 'error': 'bold red', 'limit': 'yellow', 'ok': 'green'}


def reason_style(reason: Optional[str]) -> str:
    """The colour of a finish reason, by its kind in :data:`mtflow.core.machine.FINISH_REASON_TABLE`."""
    return _KIND_STYLES[reason_kind(reason)]


def cell_text(view: RequestView, turn_index: int) -> Text:
    c = view.cells[turn_index]
    t = Text()
    if c.wait:
        t.append('G' if c.wait == GENERATING else 'C', STYLES[c.wait])
    else:
        t.append('.', 'dim')
    if c.stepped:
        t.append('T', STYLES[TOOL_STEP])
        if c.tool_errors:
            t.append(TOOL_ERROR_MARK, 'bold red')
    if c.compaction is not None:
        t.append(COMPACTED_MARK, 'bold magenta')
    if c.finished is not None:
        t.append(ERROR_MARK if reason_kind(c.finished) == 'error' else OK_MARK, reason_style(c.finished))
    return t


def timeline_text(view: RequestView) -> Text:
    t = Text(no_wrap=True, overflow='ellipsis')
    first = view.cells[0].turn if view.cells else 1
    for _ in range(1, first):  # a fork's child: the turns before it are its parent's
        t.append(SHARED_MARK.ljust(CELL), 'dim')
    for k in range(len(view.cells)):
        cell = cell_text(view, k)
        t.append_text(cell)
        t.append(' ' * max(1, CELL - len(cell.plain)))
    t.rstrip()
    return t


def turn_ruler(max_turn: int) -> str:
    return ''.join(str(turn).ljust(CELL) for turn in range(1, max_turn + 1)).rstrip()


def fmt_reward(reward: Optional[float]) -> str:
    return '-' if reward is None else f'{reward:.4g}'


def timeline_table(views: Sequence[RequestView],
                   results: Optional[Dict[str, Tuple[Optional[float], Optional[str]]]] = None) -> Table:
    """One row per request: uuid, (its parent, in a branched run,) (rank,) the turn cells, turns,
    tokens, finish reason, and with ``results`` (``{uuid: (reward, group)}``, from the
    trajectories) reward and group."""
    max_turn = max((v.cells[-1].turn for v in views if v.cells), default=0)
    multi_rank = len({v.rank for v in views}) > 1
    branched = any(v.parent for v in views)
    table = Table(box=None, pad_edge=False, show_edge=False, header_style='bold', padding=(0, 2, 0, 0))
    table.add_column('request', no_wrap=True, overflow='fold')
    if branched:
        table.add_column('parent', no_wrap=True, overflow='fold')
    if multi_rank:
        table.add_column('rank', justify='right')
    table.add_column('turn ' + turn_ruler(max_turn), no_wrap=True, overflow='ellipsis')
    table.add_column('turns', justify='right')
    table.add_column('tokens', justify='right')
    table.add_column('finish', no_wrap=True)
    if results is not None:
        table.add_column('reward', justify='right')
        table.add_column('group', no_wrap=True)
    for v in views:
        row: List[Any] = [safe_text(v.uuid)]
        if branched:
            row.append(safe_text(v.parent) if v.parent else Text('-', 'dim'))
        if multi_rank:
            row.append(str(v.rank))
        row += [Text('     ') + timeline_text(v), str(v.turns), str(v.tokens),
                Text(v.reason or 'unfinished', reason_style(v.reason))]
        if results is not None:
            reward, group = results.get(v.uuid, (None, None))
            row += [fmt_reward(reward), safe_text(group) if group else '-']
        table.add_row(*row)
    return table


def _bar(n: int, top: int, width: int = 30) -> str:
    return '█' * max(1 if n else 0, round(width * n / top)) if top else ''


def summary_line(s: Summary) -> str:
    ranks = f', ranks {",".join(map(str, s.ranks))}' if len(s.ranks) > 1 else ''
    return (f'summary: {s.requests} requests, {s.events} events, {s.max_turn} turns, {s.tokens} completion tokens, '
            f'{s.tool_calls} tool calls, {len(s.tool_errors)} tool errors{_context_counts(s)}{ranks}')


def _context_counts(s: Summary) -> str:
    """``, N compactions in M requests, N context_full, N length_total`` (only the ones that
    happened: a run without a context budget prints what it always printed)."""
    parts = []
    if s.compactions:
        parts.append(f'{sum(s.compactions.values())} compactions in {len(s.compactions)} requests')
    parts += [f'{s.finish_reasons[r]} {r}' for r in (CONTEXT_FULL, LENGTH_TOTAL) if s.finish_reasons.get(r)]
    return ''.join(f', {p}' for p in parts)


def summary_renderable(s: Summary, views: Sequence[RequestView] = ()) -> RenderableType:
    """The batch summary: counts, live requests per turn, turns per request, finish reasons,
    tool errors, request errors and the slowest steps; with ``views`` of a run that had a context
    budget, also each turn's tokens against it (:func:`budget_table`)."""
    parts: List[RenderableType] = [Text.assemble(('summary: ', 'bold'), summary_line(s)[len('summary: '):])]
    if s.unfinished:
        parts.append(Text(f'unfinished (the trace ends before they finish): {", ".join(s.unfinished)}', 'magenta'))

    def histogram(title: str, label: str, data: Dict[Any, int], styles: Optional[Dict[Any, str]] = None) -> Table:
        table = Table(title=title, title_justify='left', title_style='bold', box=None, padding=(0, 2, 0, 0),
                      pad_edge=False, show_header=False)
        table.add_column(label, no_wrap=True)
        table.add_column('n', justify='right')
        table.add_column('bar', no_wrap=True)
        top = max(data.values(), default=0)
        for key, n in data.items():
            style = (styles or {}).get(key, '')
            table.add_row(Text(str(key), style), str(n), Text(_bar(n, top), style or 'blue'))
        return table

    parts.append(histogram('live requests per turn', 'turn', {f'turn {t}': n for t, n in s.live_per_turn.items()}))
    parts.append(histogram('turns per request', 'turns', {f'{t} turn{"s" if t != 1 else ""}': n for t, n in s.turns_per_request.items()}))
    parts.append(histogram('finish reasons', 'reason', s.finish_reasons, {r: reason_style(r) for r in s.finish_reasons}))
    if s.tool_error_kinds:
        parts.append(histogram('tool error kinds', 'kind', s.tool_error_kinds, {k: 'red' for k in s.tool_error_kinds}))
    if s.time_per_state:
        parts.append(time_per_state_table(s))
    budget = budget_table(views)
    if budget is not None:
        parts.append(budget)
    if s.errors:
        table = Table(title='errors', title_justify='left', title_style='bold red', box=None, padding=(0, 2, 0, 0))
        for col in ('request', 'turn', 'phase', 'error'):
            table.add_column(col, overflow='fold')
        for e in s.errors:
            message = f'{e.get("type", "")}: {e.get("message", "")}'.lstrip(': ')
            table.add_row(safe_text(e['uuid']), str(e['turn']), safe_text(e.get('phase', '')), safe_text(message))
        parts.append(table)
    if s.tool_errors:
        table = Table(title='tool errors', title_justify='left', title_style='bold red', box=None,
                      padding=(0, 2, 0, 0))
        for col in ('request', 'turn', 'error'):
            table.add_column(col, overflow='fold')
        for te in s.tool_errors[:20]:
            table.add_row(safe_text(te.uuid), str(te.turn), safe_text(te.message))
        if len(s.tool_errors) > 20:
            table.add_row('…', '', f'{len(s.tool_errors) - 20} more')
        parts.append(table)
    if s.slowest_steps:
        table = Table(title='slowest steps', title_justify='left', title_style='bold', box=None, padding=(0, 2, 0, 0))
        for col in ('request', 'turn', 'time', 'tools'):
            table.add_column(col, justify='right' if col == 'time' else 'left')
        for st in s.slowest_steps:
            table.add_row(safe_text(st.uuid), str(st.turn), fmt_s(st.duration_s), safe_text(', '.join(st.tools)))
        parts.append(table)
    return Group(*[p for part in parts for p in (part, Text(''))][:-1])


def time_per_state_table(s: Summary) -> Table:
    """Wall time per state, summed over requests (``docs/viewer.md``): where the run's time went,
    and the request that spent the most in each state."""
    wall = f' (run wall time {fmt_s(s.wall_s)})' if s.wall_s is not None else ''
    table = Table(title=f'time per state{wall}', title_justify='left', title_style='bold', box=None,
                  padding=(0, 2, 0, 0), pad_edge=False)
    for col in ('state', 'total', 'share', 'requests', 'mean', 'max', 'slowest request'):
        table.add_column(col, justify='left' if col in ('state', 'slowest request') else 'right', no_wrap=True)
    grand = sum(st.total_s for st in s.time_per_state.values()) or 1.0
    for st in s.time_per_state.values():
        table.add_row(Text(st.state, STYLES.get(st.state, '')), fmt_s(st.total_s), f'{100 * st.total_s / grand:.0f}%',
                      str(st.requests), fmt_s(st.mean_s), fmt_s(st.max_s), safe_text(st.max_uuid))
    return table


def budget_table(views: Sequence[RequestView]) -> Optional[Table]:
    """Per turn, the batch against the context budget (``docs/context.md``): the fullest
    request's prompt tokens plus the ``max_tokens`` sent, against the context length; how many
    requests had their ``max_tokens`` cut; the least left of the total response budget.
    ``None`` when the run had no budget (its summary is unchanged)."""
    rows = budget_per_turn(views)
    if not rows:
        return None
    totals = any(r.total is not None for r in rows)
    table = Table(title='tokens against the context budget per turn', title_justify='left', title_style='bold',
                  box=None, padding=(0, 2, 0, 0), pad_edge=False)
    sent_col = 'prompt + max_tokens / context (the fullest request)'
    for col in ('turn', 'requests', sent_col, 'request', 'cut') + (('response budget left (least)',) if totals else ()):
        table.add_column(col, justify='left' if col in ('request', sent_col) else 'right', no_wrap=True)
    for r in rows:
        share = r.fullest.share
        style = 'bold red' if share is not None and share > 0.9 else 'yellow' if share is not None and share > 0.75 else ''
        row: List[Any] = [str(r.turn), str(r.requests), Text(sent_text(r.fullest), style), safe_text(r.fullest_uuid),
                          str(r.cut)]
        if totals:
            row.append('' if r.least_left is None else f'{r.least_left} / {r.total}')
        table.add_row(*row)
    return table


def request_budget_table(view: RequestView) -> Optional[Table]:
    """One request's turns against the context budget: prompt tokens, the ``max_tokens`` sent
    (and what it was cut from), their sum against the context, and the total response budget
    used and left before the turn. ``None`` when the run had no budget."""
    turns = turn_budgets(view)
    if not turns:
        return None
    totals = any(b.total is not None for b in turns)
    table = Table(title='tokens against the context budget', title_justify='left', title_style='bold', box=None,
                  padding=(0, 2, 0, 0), pad_edge=False)
    for col in ('turn', 'prompt + max_tokens / context') + (('response budget before the turn',) if totals else ()):
        table.add_column(col, justify='right' if col == 'turn' else 'left', no_wrap=True)
    for b in turns:
        table.add_row(str(b.turn), sent_text(b), *((response_text(b.used, b.total),) if totals else ()))
    return table


def trace_renderable(views: Sequence[RequestView], summary: Optional[Summary] = None, legend: bool = True,
                     results: Optional[Dict[str, Tuple[Optional[float], Optional[str]]]] = None) -> RenderableType:
    parts: List[RenderableType] = [timeline_table(views, results)]
    if legend:
        compacted = any(v.compactions for v in views)
        forked = any(v.parent for v in views)
        parts.append(Text(LEGEND + (f'  {COMPACTED_MARK} compacted' if compacted else '')
                          + (f"  {SHARED_MARK} the parent's turn (a fork's child)" if forked else ''), 'dim'))
    if summary is not None:
        parts += [Text(''), summary_renderable(summary, views)]
    return Group(*parts)


def needed_width(views: Sequence[RequestView], results: Optional[Dict[str, Any]] = None) -> int:
    turns = max((len(v.cells) for v in views), default=0)
    uuid = max((len(v.uuid) for v in views), default=7) * (2 if any(v.parent for v in views) else 1)
    extra = 10 + max((len(str(g[1])) for g in results.values()), default=5) + 2 if results else 0
    # the budget table (runs with a context budget only): turn, requests, the figure, uuid, cut, left
    budget = 16 + 58 + uuid + 7 + 31 if has_budget(views) else 0
    return max(100, uuid + 5 + 6 + CELL * turns + 40 + extra, budget)


def format_trace(trace: Trace, uuids: Optional[Sequence[str]] = None, *, summary: bool = True,
                 color: bool = False, width: Optional[int] = None) -> str:
    """The timeline (and summary) as a string: plain text unless ``color``."""
    views = request_views(trace)
    all_views = views
    if uuids is not None:
        wanted = set(uuids)
        views = [v for v in views if v.uuid in wanted]
    summary_ = summarize(all_views if uuids is None else views) if summary else None
    if width is None:
        width = max(needed_width(views), len(summary_line(summary_)) + 1 if summary_ else 0)
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=color, no_color=not color,
                      color_system='standard' if color else None, highlight=False, emoji=False)
    console.print(trace_renderable(views, summary_))
    return buf.getvalue()


# ---- one request in detail ------------------------------------------------------------------
def events_table(view: RequestView) -> Table:
    table = Table(box=None, padding=(0, 2, 0, 0), header_style='bold')
    for col in ('turn', 'from', 'to', 'trigger', 'reason', 'tokens', 'time', 'extra'):
        table.add_column(col, overflow='fold', no_wrap=col != 'extra',
                         justify='right' if col in ('turn', 'tokens', 'time') else 'left')
    for e in view.events:
        extra = '' if not e.extra else json.dumps(e.extra, ensure_ascii=False, default=str)
        table.add_row(str(e.turn), safe_text(e.src), safe_text(e.dst, STYLES.get(e.dst, reason_style(e.reason))),
                      safe_text(e.trigger), safe_text(e.reason or ''), '' if e.tokens is None else str(e.tokens),
                      fmt_s(e.duration_s), safe_text(extra))
    return table


def mask_text(ids: Sequence[int], mask: Sequence[int], tokenizer: Any) -> Text:
    """Tokens with the loss mask visible: trained tokens (mask 1) plain/green, masked runs (mask 0)
    inside ``«…»`` and dim. With a tokenizer, token boundaries are ``|``; without, ids are
    space-separated."""
    pieces = token_texts(ids, tokenizer)
    sep = '|' if tokenizer is not None else ' '
    t = Text()
    runs: List[tuple] = []  # (mask value, [pieces]) of equal-mask runs
    for piece, m in zip(pieces, mask):
        if runs and runs[-1][0] == bool(m):
            runs[-1][1].append(piece)
        else:
            runs.append((bool(m), [piece]))
    for k, (trained, run) in enumerate(runs):
        if k and tokenizer is None:
            t.append(' ')
        if not trained:
            t.append('«', 'bold magenta')
        for j, piece in enumerate(run):
            if j:
                t.append(sep, 'dim')
            t.append_text(safe_text(piece.replace('\n', '⏎'), 'green' if trained else 'dim strike'))
        if not trained:
            t.append('»', 'bold magenta')
    if len(mask) != len(pieces):
        t.append(f'  (mask has {len(mask)} entries for {len(pieces)} tokens)', 'bold red')
    return t


def detail_renderable(view: Optional[RequestView], traj: Optional[Trajectory], tokenizer: Any = None) -> RenderableType:
    """One request: its path, its events, its messages, and its token segments with the loss mask."""
    parts: List[RenderableType] = []
    uuid = view.uuid if view is not None else traj.uuid if traj is not None else '?'
    parts.append(Text.assemble(('request ', 'bold'), safe_text(uuid, 'bold'),
                               f'  (index {view.index}, rank {view.rank})' if view is not None else ''))
    if view is not None:
        if view.parent or view.children:  # a branched run (docs/branching.md)
            born = next((e for e in view.events if e.trigger == 'fork' and (e.extra or {}).get('parent')), None)
            where = f' (forked at turn {born.turn}, in {born.src})' if born is not None and born.turn else \
                ' (a copy of its prompt)' if born is not None else ''
            parts.append(Text.assemble(('parent: ', 'bold'), safe_text(f'{view.parent or "-"}{where}'),
                                       ('  children: ', 'bold'), safe_text(', '.join(view.children) or '-')))
        parts.append(Text.assemble(('path: ', 'bold'), safe_text(view.path)))
        parts.append(Text.assemble(('timeline: ', 'bold'), timeline_text(view)))
        parts.append(events_table(view))
        budget = request_budget_table(view)
        if budget is not None:
            parts += [Text(''), budget]
    else:
        parts.append(Text('(no trace events for this request)', 'magenta'))
    if traj is None:
        parts.append(Text('(no trajectory: pass --trajectories FILE to see messages and the loss mask)', 'dim'))
        return Group(*parts)
    parts.append(Text(''))
    parts.append(Text(f'messages ({len(traj.messages)})', 'bold'))
    role_styles = {'system': 'magenta', 'user': 'cyan', 'assistant': 'green', 'tool': 'yellow'}
    refs, shown = image_refs(traj), per_message(traj)
    for k, msg in enumerate(traj.messages):
        role = str(msg.get('role', '?'))
        content = msg.get('content')
        body = content if isinstance(content, str) else ('' if content is None else repr(content))
        line = Text.assemble(safe_text(f'[{k}] {role}: ', f'bold {role_styles.get(role, "")}'.strip()), safe_text(body))
        if isinstance(msg.get('reasoning_content'), str):  # split from the content (docs/declarative.md, "Reasoning")
            parts.append(safe_text(f'[{k}] {role} reasoning: {msg["reasoning_content"]}', 'dim'))
        if msg.get('tool_calls'):
            line.append_text(safe_text(f'  tool_calls={msg["tool_calls"]}', 'yellow'))
        parts.append(line)
        for i in (shown[k] if refs else ()):  # the images this message's <image> placeholders show
            parts.append(safe_text(f'    image {i}: {refs[i] if i < len(refs) else "(not named in the line)"}', 'blue'))
    parts.append(Text(''))
    masks = traj.masks()
    n_ids = sum(map(len, traj.response_token_ids))
    n_trained = sum(map(sum, masks))
    n_lp = sum(map(len, traj.rollout_logprobs))
    if not n_ids:
        parts.append(Text.assemble(('tokens: ', 'bold'), 'none recorded (the outputs carried no token ids)'))
    else:
        parts += _segments(traj, masks, n_ids, n_trained, n_lp, tokenizer)
    if traj.rollout_infos:
        parts.append(Text(''))
        parts.append(Text.assemble(('rollout_infos: ', 'bold'), safe_text(traj.rollout_infos)))
    return Group(*parts)


def _segments(traj: Trajectory, masks: List[List[int]], n_ids: int, n_trained: int, n_lp: int,
              tokenizer: Any) -> List[RenderableType]:
    parts: List[RenderableType] = []
    parts.append(Text.assemble(
        ('tokens: ', 'bold'), f'{len(traj.response_token_ids)} segment(s), {n_ids} tokens, {n_trained} trained, '
        f'{n_ids - n_trained} masked, {n_lp} logprobs',
        ('' if traj.response_loss_mask else '  (no loss mask: every token is trained)', 'dim')))
    parts.append(Text('«…» loss mask 0 (not trained); the rest is trained', 'dim'))
    for k, (ids, mask) in enumerate(zip(traj.response_token_ids, masks)):
        parts.append(Text(f'segment {k + 1}: {len(ids)} tokens, {sum(mask)} trained', 'bold'))
        parts.append(mask_text(ids, mask, tokenizer))
    return parts
