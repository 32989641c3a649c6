"""``mtflow trace show FILE`` (terminal) and ``mtflow trace html FILE -o trace.html`` (one page).

``FILE`` is a trace JSONL file (``docs/trace-format.md``); ``--trajectories`` adds the companion
file with messages and token segments for the detail views. ``docs/viewer.md`` shows both views.
``mtflow trace html RUN_A --compare RUN_B -o page.html`` is the two-run page (``mtflow/viewer/compare.py``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml
from rich.console import Console

from mtflow.commands.graph import graph_for_config
from mtflow.core.errors import UserError
from mtflow.core.machine import STATES
from mtflow.core.trace import Trace
from mtflow.run.files import TRAJECTORIES
from mtflow.run.trajectories import read_trajectories
from mtflow.viewer.compare import render_compare_html
from mtflow.viewer.episodes import episode_ids, episode_lines, episode_renderable
from mtflow.viewer.html import render_html
from mtflow.viewer.model import request_views, select_views, summarize
from mtflow.viewer.query import QueryError, rows_of, select_rows, sort_rows
from mtflow.viewer.terminal import detail_renderable, needed_width, summary_line, trace_renderable
from mtflow.viewer.tokens import load_tokenizer


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser('trace', help='view trace files in the terminal or as an HTML page')
    tsub = p.add_subparsers(dest='trace_command', metavar='{show,html}')
    tsub.required = True

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument('file', help='a trace JSONL file (plain or .gz)')
        q.add_argument('--trajectories', metavar='FILE', help='the trajectories JSONL file (messages, tokens, masks)')
        q.add_argument('--tokenizer', metavar='PATH',
                       help="decode token ids with this tokenizer (tokenizer.json, a local model directory, or 'embedded')")
        q.add_argument('--uuid', action='append', default=[], metavar='UUID',
                       help='only these requests (repeatable; shell patterns like r1*)')
        q.add_argument('--state', action='append', default=[], metavar='STATE',
                       help='only requests that went through STATE (repeatable)')
        q.add_argument('--reason', action='append', default=[], metavar='REASON',
                       help="only requests that finished with REASON (repeatable; patterns like 'stop_rule:*'; "
                       "'none' for unfinished)")
        q.add_argument('--rank', action='append', default=[], type=int, metavar='N', help='only rank N (repeatable)')
        q.add_argument('--where', action='append', default=[], metavar='COND',
                       help="only requests meeting COND: 'reward<0.5', 'reward==0', 'reason==stop_rule:*', 'turns>=3', "
                       "'tool_error==timeout', 'group==p7' (repeatable: all must hold; reward and group need "
                       '--trajectories)')
        q.add_argument('--sort', metavar='KEY', help='order by reward, turns, tokens, index, rank, tool_errors, reason, '
                       'group or uuid (KEY:desc: descending; requests without a reward last)')

    show = tsub.add_parser('show', help='per-request timeline and batch summary in the terminal')
    common(show)
    show.add_argument('--detail', metavar='UUID', help="one request in detail: events, messages, the loss mask")
    show.add_argument('--no-summary', action='store_true', help='only the timeline')
    show.add_argument('--episode', metavar='ID', help='a multi-agent episode as its roles interleaved: who acted at '
                      'each step and what it said (needs --trajectories; docs/multi-agent.md)')
    show.add_argument('--color', choices=('auto', 'always', 'never'), default='auto')
    show.add_argument('--width', type=int, help='output width (default: the terminal, wide enough for the turns)')

    html = tsub.add_parser('html', help='write one self-contained HTML page')
    common(html)
    html.add_argument('-o', '--output', required=True, metavar='FILE', help='the HTML file to write')
    html.add_argument('--config', metavar='YAML', help="draw this scheduler's declared graph (default: core + "
                      'the finish reasons in the trace)')
    html.add_argument('--title', help="page title (default: the run directory's name, else the file name)")
    html.add_argument('--compare', metavar='RUN_B', help='a two-run page: FILE is run A (a run directory, its trace '
                      'or trajectories file), RUN_B the run to compare it with; the first difference of each request '
                      'highlighted (mtflow diff\'s comparison)')
    html.add_argument('--max-shown', type=int, default=200, metavar='N',
                      help='--compare: show at most N differing requests in detail (default 200; all are counted)')
    p.set_defaults(func=main)


def _load(args: argparse.Namespace) -> tuple:
    path = Path(args.file)
    if not path.exists():
        raise UserError(f'no such trace file: {path}')
    try:
        trace = Trace.read_jsonl(path)
    except UnicodeDecodeError as exc:  # before ValueError: it is one
        raise UserError(f'{path}: not a UTF-8 text file ({exc.reason})') from exc
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    except (OSError, EOFError) as exc:  # e.g. a truncated or not-really-gzip .gz file
        raise UserError(f'{path}: cannot read: {exc}') from exc
    if not trace.events:
        raise UserError(f'{path}: no trace events')
    trajectories: Dict[str, Any] = {}
    if args.trajectories:
        tpath = Path(args.trajectories)
        if not tpath.exists():
            raise UserError(f'no such trajectories file: {tpath}')
        try:
            trajectories = read_trajectories(tpath)
        except UnicodeDecodeError as exc:
            raise UserError(f'{tpath}: not a UTF-8 text file ({exc.reason})') from exc
        except ValueError as exc:
            raise UserError(str(exc)) from exc
        except (OSError, EOFError) as exc:
            raise UserError(f'{tpath}: cannot read: {exc}') from exc
    tokenizer = None
    if args.tokenizer:
        try:
            tokenizer = load_tokenizer(args.tokenizer)
        except ValueError as exc:
            raise UserError(str(exc)) from exc
    return trace, trajectories, tokenizer


def _views(trace: Any, args: argparse.Namespace, trajectories: Optional[Dict[str, Any]] = None) -> List[Any]:
    unknown = [s for s in args.state if s not in STATES]
    if unknown:
        raise UserError(f'unknown state {unknown[0]!r}; states are: {", ".join(STATES)}')
    views = request_views(trace)
    views = select_views(views, uuids=args.uuid, states=args.state, reasons=args.reason, ranks=args.rank)
    where, sort = getattr(args, 'where', None) or [], getattr(args, 'sort', None)
    if not where and not sort:
        return views
    if not trajectories and any(c.replace(' ', '').startswith(('reward', 'group')) for c in where):
        raise UserError('--where on reward or group needs --trajectories FILE (the trace carries no rewards)')
    try:
        return [r.view for r in sort_rows(select_rows(rows_of(views, trajectories or {}), where), sort)]
    except QueryError as exc:
        raise UserError(str(exc)) from None


def _results(views: List[Any], trajectories: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """``{uuid: (reward, group)}`` for the terminal's reward and group columns (with trajectories)."""
    if not trajectories:
        return None
    return {v.uuid: (getattr(trajectories.get(v.uuid), 'reward', None), getattr(trajectories.get(v.uuid), 'group', None))
            for v in views}


def run_files(trace_path: Path) -> tuple:
    """``(summary, run name, config text)`` of the run directory holding ``trace_path`` (its
    ``summary.json`` and ``run.json``, as ``mtflow run`` writes them), ``None`` for each missing
    or unreadable one: the page is drawn from the trace alone then."""
    folder = trace_path.resolve().parent
    summary = run_name = config_text = None
    try:
        summary = json.loads((folder / 'summary.json').read_text(encoding='utf-8'))
    except (OSError, ValueError):
        pass
    try:
        info = json.loads((folder / 'run.json').read_text(encoding='utf-8'))
        config = (info.get('fingerprint') or {}).get('config')
        run_name = folder.name
        if isinstance(config, dict):
            config_text = yaml.safe_dump(config, sort_keys=False, allow_unicode=True).strip()
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        pass
    if summary is not None and not isinstance(summary, dict):
        summary = None
    if run_name is None and summary is not None:
        run_name = folder.name
    return summary, run_name, config_text


def main(args: argparse.Namespace) -> int:
    if args.trace_command == 'show':
        return show(args)
    return html(args)


def show(args: argparse.Namespace) -> int:
    trace, trajectories, tokenizer = _load(args)
    force: Optional[bool] = {'always': True, 'never': False}.get(args.color)
    if args.episode:
        return _show_episode(args, trajectories, force)
    if args.detail:
        views = {v.uuid: v for v in request_views(trace)}
        view, traj = views.get(args.detail), trajectories.get(args.detail)
        if view is None and traj is None:
            sample = ', '.join(list(views)[:5])
            raise UserError(f'no request {args.detail!r} in {args.file} (requests: {sample}'
                           f'{", ..." if len(views) > 5 else ""})')
        width = args.width or (None if sys.stdout.isatty() else 140)
        console = Console(force_terminal=force, no_color=args.color == 'never', width=width, highlight=False)
        console.print(detail_renderable(view, traj, tokenizer))
        return 0
    views = _views(trace, args, trajectories)
    if not views:
        raise UserError('no request matches the filters')
    summary = None if args.no_summary else summarize(views)
    results = _results(views, trajectories)
    width = args.width
    if width is None and not sys.stdout.isatty():  # a file or a pipe: wide enough that nothing wraps
        width = max(needed_width(views, results), len(summary_line(summary)) + 1 if summary else 0)
    console = Console(force_terminal=force, no_color=args.color == 'never', width=width, highlight=False)
    console.print(trace_renderable(views, summary, results=results))
    return 0


def _show_episode(args: argparse.Namespace, trajectories: Dict[str, Any], force: Optional[bool]) -> int:
    if not trajectories:
        raise UserError('--episode needs --trajectories FILE (the episode record is in the role trajectories)')
    lines = episode_lines(trajectories, args.episode)
    if not lines:
        known = episode_ids(trajectories)
        raise UserError(f'no episode {args.episode!r} in {args.trajectories} (episodes: {", ".join(known[:5]) or "none"}'
                        f'{", ..." if len(known) > 5 else ""})')
    width = args.width or (None if sys.stdout.isatty() else 140)
    console = Console(force_terminal=force, no_color=args.color == 'never', width=width, highlight=False)
    console.print(episode_renderable(args.episode, lines, width=width or console.width))
    return 0


def _run_of(path: str) -> Path:
    """A run directory from a directory, its ``trace.jsonl`` or its ``trajectories.jsonl``."""
    p = Path(path)
    if p.is_file() and p.name != TRAJECTORIES and (p.parent / TRAJECTORIES).is_file():
        return p.parent
    return p


def _write_page(output: str, page: str, what: str) -> int:
    """Write an HTML page where ``-o`` says (its folder must exist) and say what was written."""
    out = Path(output)
    if out.parent and not out.parent.exists():
        raise UserError(f'no such directory: {out.parent}')
    out.write_text(page, encoding='utf-8')
    print(f'wrote {out} ({what}{len(page) // 1024} KiB)')
    return 0


def compare_html(args: argparse.Namespace) -> int:
    try:
        page = render_compare_html(_run_of(args.file), _run_of(args.compare), max_shown=args.max_shown,
                                   title=args.title)
    except ValueError as exc:  # a damaged line names its file and line
        raise UserError(str(exc)) from None
    return _write_page(args.output, page, '')


def html(args: argparse.Namespace) -> int:
    if args.compare:
        return compare_html(args)
    trace, trajectories, tokenizer = _load(args)
    views = _views(trace, args, trajectories)
    if not views:
        raise UserError('no request matches the filters')
    graph = None
    if args.config:
        graph = graph_for_config(args.config)
    summary, run_name, config_text = run_files(Path(args.file))
    page = render_html(trace.select([v.uuid for v in views]), trajectories=trajectories, tokenizer=tokenizer,
                       graph=graph, title=args.title or run_name or Path(args.file).name, summary=summary,
                       run_name=run_name, config_text=config_text,
                       images_dir=Path(args.trajectories).parent if args.trajectories else None,
                       page_dir=Path(args.output).parent)
    return _write_page(args.output, page, f'{len(views)} requests, ')
