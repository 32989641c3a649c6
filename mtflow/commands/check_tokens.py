"""``mtflow check-tokens``: does this model and template generate every turn from the exact ids
of the turns before it?

::

    mtflow check-tokens --model embedded
    mtflow check-tokens --model ./my-model --template qwen3_think --template my_template.jinja
    mtflow check-tokens --model ./my-model --policy both
    mtflow check-tokens --model ./my-model --scheduler schedulers/guess_number.yaml --limit 4
    mtflow check-tokens --model ./my-vlm --processor my_pkg.vision:make_processor --scheduler my_pkg:Frames

Runs the conformance scenarios (tool calls, thinking blocks, unicode, whitespace edges,
truncated replies, continuation turns; ``mtflow.backends.conformance``), or a scheduler of yours
over a dataset, through the backend (``hf`` by default; ``vllm`` too), once per template and
policy, and prints a table of checks per template. Exit status 0 only if every check passed for
every template (it fails closed: a run that checks nothing, a backend that cannot load, a
template that fails, are failures).

A vision-language model needs its processor (``--processor module:attr``: a processor, or a
factory returning one or ``(model, processor)``, built in Python, so no processor files need
saving or loading, which transformers 5.19 does through torchvision for Qwen2-VL); with it the
checks cover conversations with images: the ids with every image's pads, and that each turn
shows the model the images of the turn before, unchanged, in order (``images``).
"""
from __future__ import annotations

import argparse
import copy
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from mtflow.backends import BackendError, make_backend
from mtflow.backends.base import reports_of
from mtflow.backends.conformance import BUNDLED, SCENARIOS, check_tokens, format_report, resolve_template
from mtflow.commands.run import parse_options
from mtflow.core.errors import UserError
from mtflow.core.registry import resolve_reference
from mtflow.declarative.context import ContextConfig
from mtflow.data import read_prompts
from mtflow.run.assembly import SchedulerFactory, scheduler_factory, seed_everything
from mtflow.run.config import RunConfig
from mtflow.run.diff import trajectories_file
from mtflow.run.token_check import RUN_CHECKS, check_run_tokens


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser('check-tokens', help='check that every turn is generated from the exact ids of the turns before',
                       description='Run multi-turn conversations through a backend and check, per chat template, that '
                       'each prompt extends the previous prompt + the sampled ids; exit 1 if any check fails.')
    p.add_argument('run_dir', nargs='?', help='a run directory (mtflow run, mtflow gateway): check every training '
                   'segment of its trajectories.jsonl offline, no model, instead of running conversations')
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
    p.add_argument('--processor', metavar='MODULE:ATTR',
                   help="a vision-language model's processor (an AutoProcessor object, or a factory returning one "
                   'or (model, processor)); --model is then a directory of that model (or comes from the factory)')
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


def _processor(args: argparse.Namespace) -> Tuple[Any, Any]:
    """``(model, processor)`` of ``--processor`` (``(None, None)`` without it): the model is the
    factory's, else loaded from the ``--model`` directory as an image-text-to-text model."""
    if not args.processor:
        return None, None
    try:
        value = resolve_reference(args.processor, os.getcwd())
    except (ImportError, AttributeError) as exc:
        raise UserError(f'--processor {args.processor!r}: {exc}') from None
    try:
        if callable(value) and not hasattr(value, 'tokenizer'):
            value = value()
    except Exception as exc:
        raise UserError(f'--processor {args.processor!r} raised {type(exc).__name__}: {exc}') from None
    model, processor = value if isinstance(value, tuple) else (None, value)
    if getattr(processor, 'tokenizer', None) is None or not callable(processor):
        raise UserError(f'--processor {args.processor!r} gave a {type(processor).__name__}, not a processor (an object '
                        'with a tokenizer, called as processor(text=..., images=...))')
    if model is None and args.backend == 'hf':
        model = _vision_model(args.model)
    return model, processor


def _vision_model(name: str) -> Any:
    """A vision-language model from a directory (``save_pretrained``'s), as the processor's model."""
    if not os.path.isfile(os.path.join(name, 'config.json')):
        raise UserError(f'--processor needs --model to be the directory of a vision-language model (with its '
                        f'config.json), or a factory that returns (model, processor); got --model {name!r}')
    from transformers import AutoModelForImageTextToText

    try:
        return AutoModelForImageTextToText.from_pretrained(name, local_files_only=True).eval()
    except Exception as exc:
        raise UserError(f'cannot load {name!r} as a vision-language model: {type(exc).__name__}: '
                        f'{" ".join(str(exc).split())[:300]}') from None


def _templates(specs: List[str]) -> List[tuple]:
    names: List[str] = []
    for spec in specs or ['model']:
        names.extend(BUNDLED if spec == 'bundled' else [spec])
    try:
        return [resolve_template(n) for n in names]
    except BackendError as exc:
        raise UserError(str(exc)) from None


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
    for problem in report.problems[:10]:  # a problem's text is not markup; one line, whatever the width
        console.print(f'  [red]FAIL[/red] {escape(problem)}', soft_wrap=True)
    if len(report.problems) > 10:
        console.print(f'  ... and {len(report.problems) - 10} more')
    return report.ok


def _check_run_dir(console: Console, run_dir: str) -> int:
    """``check-tokens RUN_DIR``: every segment of the run's trajectories (``mtflow/run/token_check.py``)."""
    from rich.table import Table  # a table for this report only

    try:
        path = trajectories_file(Path(run_dir))
        report = check_run_tokens(path)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    table = Table(title=f'{path}: {report.lines} trajectories, {report.segments} segments'
                  + (f', {report.skipped} failed ones skipped' if report.skipped else '')
                  + (f', {report.untrained} untrained episode roles not checked' if report.untrained else ''))
    for column in ('check', 'passed', 'failed', 'result'):
        table.add_column(column, justify='right' if column in ('passed', 'failed') else 'left')
    for check in RUN_CHECKS:
        p, f = report.passed[check], report.failed[check]
        table.add_row(check, str(p), str(f), 'FAIL' if f else ('n/a' if not p else 'ok'))
    console.print(table)
    for problem in report.problems[:10]:
        console.print(f'  [red]FAIL[/red] {escape(problem)}')
    if len(report.problems) > 10:
        console.print(f'  ... and {len(report.problems) - 10} more')
    if not report.segments:
        console.print('[red]nothing was checked[/red]')
    return 0 if report.ok else 1


def main(args: argparse.Namespace) -> int:
    if args.run_dir:
        return _check_run_dir(Console(), args.run_dir)
    templates = _templates(args.template)
    scenarios = _scenarios(args.scenario)
    policies = ['exact', 'rerender'] if args.policy == 'both' else [args.policy]
    seed_everything(args.seed)
    options = parse_options(args.option)
    requests, make_scheduler = _your_scheduler(args)
    model, processor = _processor(args)
    if processor is not None:
        options['processor'] = processor
    console = Console()
    failed = 0
    backends: Dict[str, Any] = {}
    try:
        for policy in policies:
            try:
                backend = make_backend(args.backend, model=args.model if model is None else model, seed=args.seed,
                                       prefix_policy=policy, **options)
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
            reports_of(backend).close()
    total = len(templates) * len(policies)
    console.print(f'{total - failed} of {total} template/policy runs passed every check')
    return 1 if failed else 0
