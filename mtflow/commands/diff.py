"""``mtflow diff RUN_A RUN_B``: which requests two runs disagree on, and where first.

Requests are matched by uuid (``mtflow/run/diff.py``); those that started from another prompt or
reference are printed first (they are not the same requests), then for each other that differs
the first turn and what differs there, then the totals (different prompt or reference /
identical / different / only in A / only in B) and the change of the mean reward of each group. ``--json`` prints JSON Lines instead: one object
per differing request, then ``{"totals": ...}`` last. Streams both files: constant memory.

Exit status: 0 when the runs are identical (on ``--fields``), 1 when not (usable in CI), 2 on a
usage error.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List

from mtflow.core.errors import UserError
from mtflow.run.diff import FIELDS, LOGPROB_TOL, DiffRun, RequestDiff


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser('diff', help='compare two runs request by request, turn by turn',
                       description='Compare two runs (directories or trajectories.jsonl files) by request uuid; '
                       'exit 0 when identical, 1 when not.')
    p.add_argument('run_a', help='a run directory (or its trajectories.jsonl)')
    p.add_argument('run_b', help='the run to compare it with')
    p.add_argument('--json', action='store_true', help='JSON Lines: one object per differing request, totals last')
    p.add_argument('--fields', nargs='+', metavar='FIELD', default=list(FIELDS),
                   help=f'compare only these ({", ".join(FIELDS)})')
    p.add_argument('--logprob-tol', type=float, default=LOGPROB_TOL, metavar='T',
                   help=f'logprobs closer than T are the same (default {LOGPROB_TOL:g}: the rounding of another '
                   'batch shape; 0: exactly)')
    p.add_argument('--max-shown', type=int, default=50, metavar='N',
                   help='text output: show the first N differing requests (default 50; all are counted)')
    p.set_defaults(func=main)


def _line(d: RequestDiff) -> str:
    """``q2: turn 3: text: "a" vs "b"``; a request that started from another input says so first."""
    line = f'{d.uuid}: {"started from another input" if d.is_input else f"turn {d.turn}"}: {_what(d)}'
    return line + (f'; then turn {d.then.turn}: {_what(d.then)}' if d.then is not None else '')


def _what(d: RequestDiff) -> str:
    parts = []
    for f in d.fields:
        if f == 'prompt':
            k = d.detail.get('prompt_message', 0)
            parts.append(f'prompt message {k}: {json.dumps(d.a.get(f), ensure_ascii=False)[:120]} vs '
                         f'{json.dumps(d.b.get(f), ensure_ascii=False)[:120]}')
            continue
        if f in ('token_ids', 'trained') and 'first_token' in d.detail:
            ft = d.detail['first_token']
            where = 'token_ids' if f == 'token_ids' else 'trained ids (response_token_ids)'
            parts.append(f'{where} differ at position {ft["position"]} ({ft["a"]} vs {ft["b"]})')
        else:
            parts.append(f'{f}: {json.dumps(d.a.get(f), ensure_ascii=False)[:120]} vs '
                         f'{json.dumps(d.b.get(f), ensure_ascii=False)[:120]}')
    return '; '.join(parts)


def main(args: argparse.Namespace) -> int:
    try:
        run = DiffRun(args.run_a, args.run_b, args.fields, args.logprob_tol)
    except ValueError as exc:
        raise UserError(f'--fields: {exc}') from None
    shown: Dict[bool, List[str]] = {True: [], False: []}  # by RequestDiff.is_input, at most --max-shown each
    only: List[Any] = []
    out = sys.stdout
    try:
        for item in run:
            if isinstance(item, RequestDiff):
                if args.json:
                    out.write(json.dumps(item.to_dict(), ensure_ascii=False, default=str) + '\n')
                elif len(shown[item.is_input]) < args.max_shown:
                    shown[item.is_input].append(_line(item))
            else:
                kind, uuid = item
                if args.json:
                    out.write(json.dumps({'uuid': uuid, kind: True}) + '\n')
                elif len(only) < args.max_shown:
                    only.append(f'{uuid}: only in {"A" if kind == "only_in_a" else "B"}')
    except ValueError as exc:  # a damaged line names its file and line
        raise UserError(str(exc)) from None
    totals = run.totals
    if args.json:
        out.write(json.dumps({'totals': totals.to_dict()}) + '\n')
    else:
        for inputs, count in ((True, totals.different_input), (False, totals.different)):
            for text in shown[inputs]:
                out.write(text + '\n')
            if count > len(shown[inputs]):
                out.write(f'... and {count - len(shown[inputs])} more request(s) '
                          f'{"that started from another input" if inputs else "that differ"} (--max-shown)\n')
        for text in only:
            out.write(text + '\n')
        out.write((f'different prompt or reference {totals.different_input} (not the same requests: their turns are '
                   'not compared), ' if totals.different_input else '')
                  + f'identical {totals.identical}, different {totals.different}, only in A {totals.only_in_a}, '
                  f'only in B {totals.only_in_b}\n')
        for group, change in totals.reward_changes().items():
            out.write(f'group {group}: mean reward {change["a"]:g} -> {change["b"]:g} ({change["change"]:+g})\n')
    return 0 if totals.same else 1
