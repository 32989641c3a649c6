"""``mtflow schema``: the JSON Schema of scheduler YAML files, for editors (e.g. the YAML
language server: ``# yaml-language-server: $schema=mtflow-scheduler.schema.json``)."""
from __future__ import annotations

import argparse
import json

from mtflow.declarative import json_schema


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser('schema', help='print the JSON Schema of scheduler YAML files')
    p.add_argument('-o', '--output', help='write to this file instead of stdout')
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    text = json.dumps(json_schema(), indent=2, ensure_ascii=False) + '\n'
    if args.output:
        with open(args.output, 'w', encoding='utf-8') as f:
            f.write(text)
    else:
        print(text, end='')
    return 0
