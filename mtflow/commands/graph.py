"""``mtflow graph [CONFIG] [--format mermaid|svg] [-o FILE]``: a scheduler's state graph, drawn from
the same declaration the executor uses (:class:`mtflow.core.machine.StateGraph`)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mtflow.core.errors import UserError
from mtflow.core.machine import StateGraph
from mtflow.core.scheduler import HookSet
from mtflow.declarative import load_scheduler
from mtflow.declarative.loader import ConfigError
from mtflow.run.config import is_run_config, load_run_config
from mtflow.viewer.svg import state_graph_svg


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser('graph', help="print a scheduler's state graph (mermaid or SVG)")
    p.add_argument('config', nargs='?', help='a scheduler YAML file or a run config (default: the core graph)')
    p.add_argument('--format', choices=('mermaid', 'svg'), default='mermaid',
                   help='mermaid stateDiagram text (default) or a standalone SVG image')
    p.add_argument('-o', '--output', metavar='FILE', help='write to FILE instead of standard output')
    p.set_defaults(func=main)


def graph_for_scheduler(scheduler: Any) -> StateGraph:
    """The graph an :class:`mtflow.Executor` builds for ``scheduler``: core reasons plus its own."""
    return HookSet(scheduler).graph()


def graph_for_config(config: str) -> StateGraph:
    """The graph of the scheduler a YAML config declares (its stop rules become finish reasons)."""
    if not Path(config).exists():
        raise UserError(f'no such config file: {config}')
    if is_run_config(config):  # a run config: draw the scheduler it runs
        cfg = load_run_config(config)
        if not cfg.scheduler_is_yaml():
            raise UserError(f'{config}: scheduler {cfg.scheduler!r} is Python; `mtflow graph` draws YAML schedulers')
        config = str(cfg.scheduler_path())
    try:
        scheduler = load_scheduler(config)
    except ConfigError as exc:
        raise UserError(str(exc)) from exc
    return graph_for_scheduler(scheduler)


def main(args: argparse.Namespace) -> int:
    graph = graph_for_config(args.config) if args.config else StateGraph()
    if args.format == 'svg':
        text = '<?xml version="1.0" encoding="UTF-8"?>\n' + state_graph_svg(graph, title=graph.name) + '\n'
    else:
        text = graph.mermaid()
    if args.output:
        Path(args.output).write_text(text, encoding='utf-8')
        print(f'wrote {args.output}')
    else:
        print(text, end='')
    return 0
