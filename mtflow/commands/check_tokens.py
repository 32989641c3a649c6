"""``mtflow check-tokens``: does this model and template generate every turn from the exact ids
of the turns before it?

::

    mtflow check-tokens --model embedded
    mtflow check-tokens --model ./my-model --template qwen3_think --template my_template.jinja
    mtflow check-tokens --model ./my-model --policy both
    mtflow check-tokens --model ./my-model --scheduler schedulers/guess_number.yaml --limit 4

Runs the conformance scenarios (tool calls, thinking blocks, unicode, whitespace edges,
truncated replies, continuation turns; ``mtflow.backends.conformance``), or a scheduler of yours
over a dataset, through the backend (``hf`` by default; ``vllm`` too), once per template and
policy, and prints a table of checks per template. Exit status 0 only if every check passed for
every template (it fails closed: a run that checks nothing, a backend that cannot load, a
template that fails, are failures).
"""
from __future__ import annotations

import argparse
import copy
from typing import Any, Dict, List, Optional, Tuple

from pydantic import ValidationError
from rich.console import Console

from mtflow.backends import BackendError, make_backend
from mtflow.backends.conformance import BUNDLED, SCENARIOS, check_tokens, format_report, resolve_template
from mtflow.commands.run import parse_options
from mtflow.core.errors import UserError
from mtflow.declarative.context import ContextConfig
from mtflow.data import read_prompts
from mtflow.run.assembly import SchedulerFactory, scheduler_factory, seed_everything
from mtflow.run.config import RunConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser('check-tokens', help='check that every turn is generated from the exact ids of the turns before',
                       description='Run multi-turn conversations through a backend and check, per chat template, that '
                       'each prompt extends the previous prompt + the sampled ids; exit 1 if any check fails.')
    p.add_argument('--model', default='embedded', help="the model ('embedded', a directory, a .gguf file)")
    p.add_argument('--backend', default='hf', choices=('hf', 'vllm'), help='the backend (default hf)')
    p.add_argument('--template', action='append', default=[], metavar='NAME|FILE',
                   help="a chat template: 'model' (the tokenizer's own, default), a bundled one (chatml, "
                   "qwen3_think, llama3), 'bundled' (all of them) or a Jinja file; repeatable")
    p.add_argument('--policy', default='exact', choices=('exact', 'rerender', 'both'),
                   help='prefix policy for templates that rewrite earlier turns (default exact)')
    p.add_argument('--scenario', action='append', default=[], metavar='NAME',
                   help='run only these built-in scenarios (tool call, thinking, unicode, whitespace, truncated, '
                   'continuation); repeatable')
    p.add_argument('--scheduler', help="your scheduler instead of the built-in scenarios: a YAML file or "
                   "'module:Class' / 'file.py:Class'")
    p.add_argument('--dataset', help='JSONL prompts for --scheduler (default: the bundled set)')
    p.add_argument('--limit', type=int, default=4, help='prompts for --scheduler (default 4)')
    p.add_argument('--max-turns', type=int, default=4, help='turns per request for --scheduler (default 4)')
    p.add_argument('--temperature', type=float, default=1.0, help='sampling temperature (default 1.0)')
    p.add_argument('--seed', type=int, default=0, help='seed (default 0)')
    p.add_argument('--context', action='append', default=[], metavar='KEY=VALUE',
                   help="with --scheduler: a context budget key (VALUE is YAML; e.g. context_length=512, "
                   "policy=drop_observations): conversations compact and every training segment is checked; "
                   'repeatable (docs/context.md)')
    p.add_argument('-o', '--option', action='append', default=[], metavar='KEY=VALUE',
                   help='a backend option (VALUE is YAML); repeatable')
    p.set_defaults(func=main)


def _context(args: argparse.Namespace, backend: Any) -> Any:
    """``--context KEY=VALUE`` as a :class:`mtflow.ContextBudget` for ``backend`` (``None``: none)."""
    if not args.context:
        return None
    if not args.scheduler:
        raise UserError('--context needs --scheduler (the built-in scenarios are too short to compact)')
    try:
        block = ContextConfig(**parse_options(args.context))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise UserError(f'--context {".".join(map(str, first["loc"]))}: {first["msg"]}') from None
    return block.budget(backend, where='--context')


def _templates(specs: List[str]) -> List[tuple]:
    names: List[str] = []
    for spec in specs or ['model']:
        names.extend(BUNDLED if spec == 'bundled' else [spec])
    try:
        return [resolve_template(n) for n in names]
    except FileNotFoundError as exc:
        raise UserError(f'--template: {exc.strerror}: {exc.filename}') from None


def _scenarios(wanted: List[str]) -> List[Any]:
    unknown = sorted(set(wanted) - {s.name for s in SCENARIOS})
    if unknown:
        raise UserError(f'--scenario: no scenario {", ".join(map(repr, unknown))}; '
                        f'scenarios: {", ".join(s.name for s in SCENARIOS)}')
    return [s for s in SCENARIOS if not wanted or s.name in wanted]


def _your_scheduler(args: argparse.Namespace) -> Tuple[Optional[List[Any]], Optional[SchedulerFactory]]:
    """``--scheduler`` (and its prompts) instead of the built-in scenarios, checked before the
    model loads."""
    if not args.scheduler:
        return None, None
    cfg = RunConfig(scheduler=args.scheduler, dataset=args.dataset, limit=args.limit)
    make_scheduler = scheduler_factory(cfg)
    return read_prompts(cfg.dataset_path(), limit=cfg.limit), make_scheduler


def _check_template(console: Console, backend: Any, name: str, text: str, args: argparse.Namespace,
                    checks: Dict[str, Any]) -> bool:
    """One template/policy run; prints its table and problems; whether every check passed."""
    try:
        report = check_tokens(backend, template=text, template_name=name, temperature=args.temperature,
                              seed=args.seed, **checks)
    except BackendError as exc:
        console.print(f'[red]template {name}: {exc}[/red]')
        return False
    console.print(format_report(report))
    for problem in report.problems[:10]:
        console.print(f'  [red]FAIL[/red] {problem}')
    if len(report.problems) > 10:
        console.print(f'  ... and {len(report.problems) - 10} more')
    return report.ok


def main(args: argparse.Namespace) -> int:
    templates = _templates(args.template)
    scenarios = _scenarios(args.scenario)
    policies = ['exact', 'rerender'] if args.policy == 'both' else [args.policy]
    seed_everything(args.seed)
    options = parse_options(args.option)
    requests, make_scheduler = _your_scheduler(args)
    console = Console()
    failed = 0
    backends: Dict[str, Any] = {}
    try:
        for policy in policies:
            try:
                backend = make_backend(args.backend, model=args.model, seed=args.seed, prefix_policy=policy, **options)
            except BackendError as exc:
                raise UserError(str(exc)) from None
            backends[policy] = backend
            for name, text in templates:
                checks: Dict[str, Any] = {'scenarios': scenarios}
                if make_scheduler is not None:
                    checks = dict(scheduler=make_scheduler(backend.tokenizer), requests=copy.deepcopy(requests),
                                  max_turns=args.max_turns, context=_context(args, backend))
                failed += not _check_template(console, backend, name, text, args, checks)
    finally:
        for backend in backends.values():
            getattr(backend, 'close', lambda: None)()
    total = len(templates) * len(policies)
    console.print(f'{total - failed} of {total} template/policy runs passed every check')
    return 1 if failed else 0
