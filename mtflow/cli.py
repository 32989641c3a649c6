"""The ``mtflow`` command line: ``run``, ``validate``, ``schema``, ``graph``, ``trace``, ``check-tokens``.

Each subcommand lives in ``mtflow/commands/<name>.py`` with ``add_parser(subparsers)`` and
``main(args) -> int``, and is imported only when used, so ``mtflow --help`` stays fast.
Errors a user can fix (:class:`CLIError`, a missing file, a bad config) are printed as one clear
line, never as a traceback; ``MTFLOW_DEBUG=1`` shows the traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, Optional

#: subcommand -> (module, one-line help)
COMMANDS = {
    'run': ('mtflow.commands.run', 'roll out a scheduler over a dataset with a model'),
    'validate': ('mtflow.commands.validate', 'check YAML configs and report every problem'),
    'schema': ('mtflow.commands.schema', 'print the JSON Schema of scheduler YAML files'),
    'graph': ('mtflow.commands.graph', "print a scheduler's state graph (mermaid or SVG)"),
    'trace': ('mtflow.commands.trace', 'view trace files in the terminal or as an HTML page'),
    'check-tokens': ('mtflow.commands.check_tokens', 'check that every turn is generated from the exact ids before it'),
}


class CLIError(Exception):
    """An error for the user: printed as ``mtflow: <message>``, exit status 2 (or ``code``)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _build_parser(argv: List[str]) -> argparse.ArgumentParser:
    from mtflow import __version__

    parser = argparse.ArgumentParser(prog='mtflow', description='Multi-turn LLM rollouts as explicit state machines.')
    parser.add_argument('--version', action='version', version=f'mtflow {__version__}')
    sub = parser.add_subparsers(dest='command', metavar='COMMAND')
    wanted = next((a for a in argv if not a.startswith('-')), None)
    for name, (module, help_text) in COMMANDS.items():
        if wanted == name:
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name == module:
                    raise CLIError(f"'{name}' is not available in this build") from exc
                raise
            mod.add_parser(sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = _build_parser(argv)
        args = parser.parse_args(argv)
        if not args.command:
            parser.print_help()
            return 0
        return int(args.func(args) or 0)
    except CLIError as exc:
        print(f'mtflow: {exc}', file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print('mtflow: interrupted', file=sys.stderr)
        return 130
    except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        if os.environ.get('MTFLOW_DEBUG'):
            raise
        print(f'mtflow: {exc.strerror or exc}: {exc.filename}', file=sys.stderr)
        return 2


if __name__ == '__main__':  # pragma: no cover
    # `python -m mtflow.cli`: run the imported module's main, so that commands raising
    # mtflow.cli.CLIError are caught by the same class (not this __main__ copy's).
    from mtflow.cli import main as _main

    sys.exit(_main())
