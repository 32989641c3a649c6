"""``mtflow validate FILE...``: every problem in every file at once, ``file:line: field: message``;
exit status 1 when any file has a problem."""
from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser('validate', help='check scheduler YAML files and report every problem')
    p.add_argument('files', nargs='+', metavar='FILE', help='scheduler YAML files')
    p.add_argument('-q', '--quiet', action='store_true', help='print problems only, not the OK lines')
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from ..declarative import validate_file

    bad = 0
    for path in args.files:
        problems = validate_file(path)
        if problems:
            bad += 1
            for problem in problems:
                print(problem)
        elif not args.quiet:
            print(f'{path}: OK')
    if bad:
        print(f'{bad} of {len(args.files)} file(s) have problems', file=sys.stderr)
    return 1 if bad else 0
