"""``mtflow trace show FILE`` (terminal) and ``mtflow trace html FILE -o trace.html`` (one page).

``FILE`` is a trace JSONL file (``docs/trace-format.md``); ``--trajectories`` adds the companion
file with messages and token segments for the detail views. ``docs/viewer.md`` shows both views.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from rich.console import Console

from mtflow.commands.graph import graph_for_config
from mtflow.core.errors import UserError
from mtflow.core.machine import STATES
from mtflow.core.trace import Trace
from mtflow.run.trajectories import read_trajectories
from mtflow.viewer.html import render_html
from mtflow.viewer.model import request_views, select_views, summarize
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

    show = tsub.add_parser('show', help='per-request timeline and batch summary in the terminal')
    common(show)
    show.add_argument('--detail', metavar='UUID', help="one request in detail: events, messages, the loss mask")
    show.add_argument('--no-summary', action='store_true', help='only the timeline')
    show.add_argument('--color', choices=('auto', 'always', 'never'), default='auto')
    show.add_argument('--width', type=int, help='output width (default: the terminal, wide enough for the turns)')

    html = tsub.add_parser('html', help='write one self-contained HTML page')
    common(html)
    html.add_argument('-o', '--output', required=True, metavar='FILE', help='the HTML file to write')
    html.add_argument('--config', metavar='YAML', help="draw this scheduler's declared graph (default: core + "
                      'the finish reasons in the trace)')
    html.add_argument('--title', help='page title (default: the file name)')
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


def _views(trace: Any, args: argparse.Namespace) -> List[Any]:
    unknown = [s for s in args.state if s not in STATES]
    if unknown:
        raise UserError(f'unknown state {unknown[0]!r}; states are: {", ".join(STATES)}')
    views = request_views(trace)
    return select_views(views, uuids=args.uuid, states=args.state, reasons=args.reason, ranks=args.rank)


def main(args: argparse.Namespace) -> int:
    if args.trace_command == 'show':
        return show(args)
    return html(args)


def show(args: argparse.Namespace) -> int:
    trace, trajectories, tokenizer = _load(args)
    force: Optional[bool] = {'always': True, 'never': False}.get(args.color)
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
    views = _views(trace, args)
    if not views:
        raise UserError('no request matches the filters')
    summary = None if args.no_summary else summarize(views)
    width = args.width
    if width is None and not sys.stdout.isatty():  # a file or a pipe: wide enough that nothing wraps
        width = max(needed_width(views), len(summary_line(summary)) + 1 if summary else 0)
    console = Console(force_terminal=force, no_color=args.color == 'never', width=width, highlight=False)
    console.print(trace_renderable(views, summary))
    return 0


def html(args: argparse.Namespace) -> int:
    trace, trajectories, tokenizer = _load(args)
    views = _views(trace, args)
    if not views:
        raise UserError('no request matches the filters')
    graph = None
    if args.config:
        graph = graph_for_config(args.config)
    page = render_html(trace.select([v.uuid for v in views]), trajectories=trajectories, tokenizer=tokenizer,
                       graph=graph, title=args.title or Path(args.file).name)
    out = Path(args.output)
    if out.parent and not out.parent.exists():
        raise UserError(f'no such directory: {out.parent}')
    out.write_text(page, encoding='utf-8')
    print(f'wrote {out} ({len(views)} requests, {len(page) // 1024} KiB)')
    return 0
