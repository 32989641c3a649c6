"""The ``mtflow`` command line: ``run``, ``validate``, ``schema``, ``graph``, ``trace``, ``check-tokens``,
``replay``, ``rescore``, ``diff``, ``gateway``, ``init``.

Each subcommand lives in ``mtflow/commands/<name>.py`` with ``add_parser(subparsers)`` and
``main(args) -> int``, and is imported only when used, so ``mtflow --help`` stays fast.
Errors a user can fix (:class:`mtflow.core.errors.UserError` and its subclasses: a bad config or
flag, a refused run directory; a missing file) are printed as one clear line, never as a
traceback; ``MTFLOW_DEBUG=1`` prints the traceback before the line (any of these errors).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import traceback
from typing import List, Optional, Tuple

from mtflow import __version__
from mtflow.core.errors import UserError
from mtflow.run.signals import leave_if_calls_hang

#: subcommand -> (module, one-line help)
COMMANDS = {
    'run': ('mtflow.commands.run', 'roll out a scheduler over a dataset with a model'),
    'validate': ('mtflow.commands.validate', 'check YAML configs and report every problem'),
    'schema': ('mtflow.commands.schema', 'print the JSON Schema of scheduler YAML files'),
    'graph': ('mtflow.commands.graph', "print a scheduler's state graph (mermaid or SVG)"),
    'trace': ('mtflow.commands.trace', 'view trace files in the terminal or as an HTML page'),
    'check-tokens': ('mtflow.commands.check_tokens', 'check that every turn is generated from the exact ids before it'),
    'replay': ('mtflow.commands.replay', "re-run a run with its recorded model outputs against a (new) config"),
    'rescore': ('mtflow.commands.rescore', 'recompute the rewards and finish policy of a run, no model or tool call'),
    'diff': ('mtflow.commands.diff', 'compare two runs request by request, turn by turn (exit 1 when they differ)'),
    'gateway': ('mtflow.commands.gateway', 'serve a model to external agents (OpenAI/Anthropic API), recording sessions'),
    'init': ('mtflow.commands.init', 'scaffold an environment package (scheduler, tool, reward, dataset, test)'),
}


#: an error for the user, printed as ``mtflow: <message>``, exit status 2 (or ``code``); the
#: commands raise :class:`UserError` itself, and this name keeps code that catches it working
CLIError = UserError


def _build_parser(argv: List[str]) -> Tuple[argparse.ArgumentParser, Optional[argparse.ArgumentParser]]:
    """The ``mtflow`` parser, and the subcommand's own when that command reads its arguments
    intermixed (its module sets ``INTERMIXED = True``: ``replay RUN_DIR --out NEW_DIR CONFIG``, an
    optional positional after an option, which ``parse_args`` refuses)."""
    parser = argparse.ArgumentParser(prog='mtflow', description='Multi-turn LLM rollouts as explicit state machines.')
    parser.add_argument('--version', action='version', version=f'mtflow {__version__}')
    sub = parser.add_subparsers(dest='command', metavar='COMMAND')
    wanted = next((a for a in argv if not a.startswith('-')), None)
    intermixed = None
    for name, (module, help_text) in COMMANDS.items():
        if wanted == name:
            try:
                command = importlib.import_module(module)  # only the command asked for: --help stays fast
            except ModuleNotFoundError as exc:
                if exc.name == module:
                    raise UserError(f"'{name}' is not available in this build") from exc
                raise
            command.add_parser(sub)
            if getattr(command, 'INTERMIXED', False) and argv and argv[0] == name:
                intermixed = sub.choices[name]
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser, intermixed


def _parse(argv: List[str]) -> argparse.Namespace:
    parser, intermixed = _build_parser(argv)
    if intermixed is None:
        return parser.parse_args(argv)
    args = intermixed.parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command ``argv`` asks for (default: the process's own arguments). As the process's
    command (no ``argv``), the objects its imports made are frozen out of the garbage collector
    (``gc.freeze``): they live as long as the process, and every collection would scan them again
    (about a tenth of a replay's time); a caller passing ``argv`` keeps its collector as it is."""
    whole_process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parse(argv)
        if whole_process:
            gc.freeze()
        if not args.command:
            _build_parser([])[0].print_help()
            return 0
        code = int(args.func(args) or 0)
        if whole_process:  # the process's own command: a call that hangs after a stop must not hold it
            leave_if_calls_hang(code)
        return code
    except UserError as exc:
        if os.environ.get('MTFLOW_DEBUG'):  # where it was raised, and what caused it
            traceback.print_exc(file=sys.stderr)
        print(f'mtflow: {exc}', file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print('mtflow: interrupted', file=sys.stderr)
        if whole_process:
            leave_if_calls_hang(130)
        return 130
    except BrokenPipeError:  # `mtflow diff ... | head`: the reader has what it wanted
        # nothing more reaches the closed pipe, not even the flush at exit (Python's own advice)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a process that the pipe ended
    except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        if os.environ.get('MTFLOW_DEBUG'):
            raise
        print(f'mtflow: {exc.strerror or exc}: {exc.filename}', file=sys.stderr)
        return 2


if __name__ == '__main__':  # pragma: no cover - `python -m mtflow.cli`
    sys.exit(main())
