"""``mtflow validate FILE...``: every problem in every file at once, ``file:line: field: message``;
exit status 1 when any file has a problem. For each ``python`` tool it also reports the isolation
its calls get on this machine (``docs/sandbox.md``); one that is unavailable is a warning (the
config is valid; the machine lacks bubblewrap/unshare), not a problem.

A file is a scheduler YAML, or a run config (it has a ``scheduler:`` key, see
``mtflow/run/config.py``): then the run config is checked, and what it names too (the scheduler
YAML or Python class, the dataset; see :mod:`mtflow.run.preflight`). For each file the
Python code it makes mtflow import is listed (``imports:``): it runs with your rights."""
from __future__ import annotations

import argparse
import sys
from typing import Any, List, Tuple

from mtflow.declarative import inspect_file
from mtflow.declarative.loader import read_yaml
from mtflow.roles.config import episode_file_problems, episode_imports, is_episode_file
from mtflow.run.config import RunConfigError, is_run_config, load_run_config
from mtflow.run.preflight import check_run_config
from mtflow.tools.isolation import ISOLATION_CHOICES, resolve_isolation


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser('validate', help='check scheduler YAML files and run configs; report every problem')
    p.add_argument('files', nargs='+', metavar='FILE', help='scheduler YAML files or run configs')
    p.add_argument('-q', '--quiet', action='store_true', help='print problems only, not the OK lines and imports')
    p.set_defaults(func=main)


def report_of(path: str) -> Tuple[List[Any], List[Tuple[str, str]], List[str]]:
    """``(problems, imports, warnings)`` of one file: a scheduler YAML, or a run config and what
    it names (a warning: a backend server that does not answer now)."""
    if not is_run_config(path):
        if is_episode_file(path):  # a scheduler file with roles: (docs/multi-agent.md)
            return episode_file_problems(path), episode_imports(path), []
        report = inspect_file(path)
        return report.problems, report.imports, []
    try:
        cfg = load_run_config(path)
    except RunConfigError as exc:
        return [str(exc)], [], []
    pre = check_run_config(cfg)
    return pre.problems, pre.imports, [f'warning: {w}' for w in pre.warnings] + [f'{path}: {n}' for n in pre.notes]


def print_imports(path: str, imports: List[Tuple[str, str]]) -> None:
    """The safety note: every Python module or callable the file makes mtflow import."""
    if imports:
        print(f'{path}: imports (this Python code runs with your rights):')
        for where, ref in imports:
            print(f'  {ref}  ({where})')


def isolation_report(path: str) -> List[str]:
    """One line per ``python`` tool of a valid scheduler YAML (or the one a run config names):
    the isolation its calls get here; unavailable ones start with ``warning:``."""
    if is_run_config(path):
        try:
            cfg = load_run_config(path)
        except RunConfigError:
            return []
        if not cfg.scheduler_is_yaml():
            return []
        path = str(cfg.scheduler_path())
    data = read_yaml(path)[0]
    tools = data.get('tools') if isinstance(data, dict) else None
    lines = []
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if not isinstance(tool, dict):
            continue
        builtin = tool.get('builtin') or (None if tool.get('impl') else tool.get('name'))  # builtin defaults to name
        if builtin != 'python':
            continue
        options = tool.get('options') if isinstance(tool.get('options'), dict) else {}
        requested = options.get('isolation', 'auto')
        if requested not in ISOLATION_CHOICES:
            continue
        iso = resolve_isolation(requested)
        warn = 'warning: ' if not iso.available or iso.kind == 'none' else ''
        lines.append(f'{warn}{path}: tools[{i}] ({tool.get("name")}): isolation {iso.describe()}')
    return lines


def main(args: argparse.Namespace) -> int:
    bad = 0
    for path in args.files:
        problems, imports, warnings = report_of(path)
        if problems:
            bad += 1
            for problem in problems:
                print(problem, flush=True)
            continue
        if not args.quiet:
            print(f'{path}: OK')
            print_imports(path, imports)
        for line in warnings + isolation_report(path):
            if not args.quiet or line.startswith('warning:'):
                print(line, flush=True)
    if bad:
        print(f'{bad} of {len(args.files)} file(s) have problems', file=sys.stderr)
    return 1 if bad else 0
