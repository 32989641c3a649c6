"""``mtflow validate FILE...``: every problem in every file at once, ``file:line: field: message``;
exit status 1 when any file has a problem.

A file is a scheduler YAML, or a run config (it has a ``scheduler:`` key, see
``mtflow/run_config.py``): then the run config is checked, and the scheduler YAML it names too."""
from __future__ import annotations

import argparse
import sys
from typing import Any, List


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser('validate', help='check scheduler YAML files and report every problem')
    p.add_argument('files', nargs='+', metavar='FILE', help='scheduler YAML files or run configs')
    p.add_argument('-q', '--quiet', action='store_true', help='print problems only, not the OK lines')
    p.set_defaults(func=main)


def problems_of(path: str) -> List[Any]:
    """Every problem of one file: a scheduler YAML, or a run config and the scheduler it names."""
    from ..declarative import validate_file
    from ..run_config import RunConfigError, is_run_config, load_run_config

    if not is_run_config(path):
        return validate_file(path)
    try:
        cfg = load_run_config(path)
    except RunConfigError as exc:
        return [str(exc)]
    if not cfg.scheduler_is_yaml():
        return []  # a Python scheduler ('module:Class') is checked when it is imported by `mtflow run`
    scheduler = cfg.scheduler_path()
    if not scheduler.exists():
        return [f'{path}: scheduler: no such scheduler file: {cfg.scheduler}']
    return validate_file(str(scheduler))


def main(args: argparse.Namespace) -> int:
    bad = 0
    for path in args.files:
        problems = problems_of(path)
        if problems:
            bad += 1
            for problem in problems:
                print(problem, flush=True)
        elif not args.quiet:
            print(f'{path}: OK')
    if bad:
        print(f'{bad} of {len(args.files)} file(s) have problems', file=sys.stderr)
    return 1 if bad else 0
