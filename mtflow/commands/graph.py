"""``mtflow graph [CONFIG]``: the state graph as mermaid text, from the executor's own declaration."""
from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser('graph', help="print a scheduler's state graph as mermaid text")
    p.add_argument('config', nargs='?', help='a scheduler YAML file (default: the core graph)')
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from ..machine import StateGraph

    graph = StateGraph()
    if args.config:
        from ..declarative import load_scheduler  # noqa: the declarative package supplies the graph's extras

        scheduler = load_scheduler(args.config)
        graph = StateGraph(getattr(scheduler, 'finish_reasons', ()) and
                           tuple(graph.finish_reasons) + tuple(scheduler.finish_reasons),
                           name=type(scheduler).__name__)
    print(graph.mermaid(), end='')
    return 0
