"""``mtflow run CONFIG``: roll out a scheduler over a prompt dataset with a model.

Reads the run config (``mtflow/run_config.py``), applies the command-line overrides, builds the
backend (``mtflow/backends``) and the scheduler, then runs ``mtflow.Executor`` over the prompts
in batches of ``batch_size`` (``on_error='return'``: a failing request is recorded, the others go
on). It writes, in the output directory:

* ``trajectories.jsonl``: one line per finished request (``mtflow/trajectories.py`` format:
  messages, token id segments, loss masks, logprobs, infos, finish reason, turns);
* ``trace.jsonl``: every state transition of every request (``docs/trace-format.md``), with
  indices and times continuous across batches, so ``mtflow trace show`` reads the whole run;
* ``summary.json``: the figures of the summary table printed at the end (requests, finish
  reasons, turns per request, tool calls and errors, generated tokens, tokens/s).

A progress bar (on stderr) follows requests as they finish, turn by turn. Every user error (a
missing file, a bad config, an unknown backend, a model that cannot be loaded) is one line.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..cli import CLIError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        'run',
        help='roll out a scheduler over a dataset with a model',
        description='Roll out a scheduler over a JSONL prompt dataset; write trajectories, the trace and a summary.')
    p.add_argument('config', help='a run config YAML (e.g. configs/default.yaml)')
    p.add_argument('--backend', help='hf, openai, vllm, scripted or swift (overrides the config)')
    p.add_argument('--model', help="the backend's model ('embedded', a directory, a .gguf file, a server model name)")
    p.add_argument('--dataset', help='a JSONL prompt file')
    p.add_argument('--out', help='output directory')
    p.add_argument('--max-turns', type=int, help='stop every request at this turn (0: unlimited)')
    p.add_argument('--batch-size', type=int, help='requests per executor batch')
    p.add_argument('--seed', type=int, help='random seed')
    p.add_argument('--limit', type=int, help='only the first N prompts')
    p.add_argument('--max-tokens', type=int, help='request_config.max_tokens')
    p.add_argument('--temperature', type=float, help='request_config.temperature')
    p.add_argument('-o', '--option', action='append', default=[], metavar='KEY=VALUE',
                   help='a backend option (VALUE is YAML: 8, true, "text"); repeatable')
    p.add_argument('--mode', choices=('lockstep', 'async'),
                   help="executor driver: lockstep (a turn at a time) or async (each request on its own)")
    p.add_argument('--max-concurrency', type=int, metavar='N', help='async mode: requests in flight at once')
    p.add_argument('--no-progress', action='store_true', help='no progress bar')
    p.add_argument('-q', '--quiet', action='store_true', help='no progress bar and no summary table')
    p.set_defaults(func=main)


# ---- building the pieces --------------------------------------------------------------------------
def _overrides(args: argparse.Namespace) -> Dict[str, Any]:
    return {
        'backend': args.backend,
        'model': args.model,
        'dataset': args.dataset,
        'out': args.out,
        'max_turns': args.max_turns,
        'batch_size': args.batch_size,
        'seed': args.seed,
        'limit': args.limit,
        'mode': getattr(args, 'mode', None),
        'max_concurrency': getattr(args, 'max_concurrency', None),
    }


def _parse_options(items: List[str]) -> Dict[str, Any]:
    import yaml

    opts = {}
    for item in items:
        key, sep, value = item.partition('=')
        if not sep or not key:
            raise CLIError(f'--option needs KEY=VALUE, got {item!r}')
        try:
            opts[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            opts[key.strip()] = value
    return opts


def load_config(args: argparse.Namespace) -> Any:
    from ..run_config import RunConfigError, load_run_config

    overrides = _overrides(args)
    backend = overrides.pop('backend')
    try:
        cfg = load_run_config(args.config, overrides)
    except RunConfigError as exc:
        raise CLIError(str(exc)) from None
    if backend is not None and backend != cfg.backend:
        from ..backends import ALIASES, BACKENDS

        if backend not in BACKENDS and backend not in ALIASES:
            raise CLIError(f'unknown backend {backend!r}; choose one of: {", ".join(BACKENDS)}')
        # the config's backend_options belong to the config's backend
        cfg = cfg.model_copy(update={'backend': backend, 'backend_options': {}})
    if args.option:
        cfg.backend_options.update(_parse_options(args.option))
    sampling = {'max_tokens': args.max_tokens, 'temperature': args.temperature}
    cfg.request_config.update({k: v for k, v in sampling.items() if v is not None})
    return cfg


def seed_everything(seed: Optional[int]) -> None:
    if seed is None:
        return
    random.seed(seed)
    if 'torch' in sys.modules or importlib.util.find_spec('torch') is not None:
        try:
            import torch

            torch.manual_seed(seed)
        except ImportError:  # pragma: no cover
            pass


def build_backend(cfg: Any) -> Any:
    from ..backends import BackendError, make_backend

    options = cfg.resolved_backend_options()
    if cfg.backend in ('hf', 'transformers', 'huggingface') and 'seed' not in options and cfg.seed is not None:
        options['seed'] = cfg.seed
    try:
        return make_backend(cfg.backend, model=cfg.resolved_model(), **options)
    except BackendError as exc:
        raise CLIError(str(exc)) from None
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [''])[0]
        raise CLIError(f'backend {cfg.backend!r} cannot start: {type(exc).__name__}: {first}') from None


def _import_ref(ref: str, base_dir: Optional[Path]) -> Any:
    """``'package.module:Name'`` or ``'path/to/file.py:Name'``."""
    target, sep, name = ref.rpartition(':')
    if not sep or not target or not name:
        raise CLIError(f"scheduler {ref!r}: expected a YAML file or 'module:Class'")
    if target.endswith('.py'):
        path = Path(target)
        if not path.is_absolute() and base_dir is not None and (base_dir / path).is_file():
            path = base_dir / path
        if not path.is_file():
            raise CLIError(f'scheduler file not found: {target}')
        spec = importlib.util.spec_from_file_location(f'_mtflow_user_{path.stem}', path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise CLIError(f'scheduler {ref!r}: cannot import {target!r}: {exc}') from None
    obj = getattr(module, name, None)
    if obj is None:
        raise CLIError(f'scheduler {ref!r}: {target!r} has no {name!r}')
    return obj


def scheduler_factory(cfg: Any) -> Callable[[Any], Any]:
    """Check the scheduler before the (slow) model loads; return ``make(tokenizer)``.

    A YAML file goes through ``mtflow.declarative.load_scheduler``; ``module:Class`` (or
    ``file.py:Class``) is called with ``scheduler_args`` and, when it accepts one, the backend's
    tokenizer."""
    if cfg.scheduler_is_yaml():
        path = cfg.scheduler_path()
        if not path.is_file():
            raise CLIError(f'scheduler file not found: {cfg.scheduler}')
        try:
            from ..declarative import load_scheduler
        except ImportError as exc:
            raise CLIError(f'YAML schedulers are not available in this build ({exc})') from None

        def make_yaml(tokenizer: Any) -> Any:
            try:
                return load_scheduler(str(path), tokenizer=tokenizer)
            except CLIError:
                raise
            except Exception as exc:  # the loader's errors already name file, line and field
                raise CLIError(' '.join(str(exc).split()) or f'{path}: {type(exc).__name__}') from None

        return make_yaml
    factory = _import_ref(cfg.scheduler, cfg.base_dir)
    if not callable(factory):
        raise CLIError(f'scheduler {cfg.scheduler!r} is not a class or factory')
    try:
        params = inspect.signature(factory).parameters
        accepts = 'tokenizer' in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    except (TypeError, ValueError):
        accepts = False

    def make_python(tokenizer: Any) -> Any:
        kwargs = dict(cfg.scheduler_args)
        if accepts and 'tokenizer' not in kwargs and tokenizer is not None:
            kwargs['tokenizer'] = tokenizer
        try:
            return factory(**kwargs)
        except TypeError as exc:
            raise CLIError(f'scheduler {cfg.scheduler!r}: bad scheduler_args: {exc}') from None

    return make_python


# ---- running ------------------------------------------------------------------------------------
class _Counting:
    """Wraps ``rollout_fn`` to drive the progress bar: each call is one turn of one batch, and the
    requests not in it have finished."""

    def __init__(self, rollout_fn: Any, progress: Any, task: Any) -> None:
        self.rollout_fn = rollout_fn
        self.progress, self.task = progress, task
        self.batch_size = 0
        self.done_before = 0
        self.turn = 0

    def start_batch(self, size: int, done_before: int) -> None:
        self.batch_size, self.done_before, self.turn = size, done_before, 0

    def __call__(self, requests: List[Any], request_config: Any) -> Any:
        self.turn += 1
        if self.progress is not None:
            self.progress.update(self.task, completed=self.done_before + self.batch_size - len(requests),
                                 description=f'turn {self.turn}, {len(requests)} live')
        return self.rollout_fn(requests, request_config)


def _progress(enabled: bool) -> Any:
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn)

    return Progress(SpinnerColumn(), TextColumn('[bold]rollout'), BarColumn(), MofNCompleteColumn(),
                    TextColumn('{task.description}'), TimeElapsedColumn(), console=Console(stderr=True),
                    transient=False)


def run_batches(cfg: Any, scheduler: Any, backend: Any, requests: List[Any], out_dir: Path,
                progress: Any = None) -> Dict[str, Any]:
    """Run every batch; stream trajectories and the trace to ``out_dir``; return the tallies."""
    from ..executor import Executor

    request_config = cfg.make_request_config()
    task = progress.add_task('starting', total=len(requests)) if progress is not None else None
    if cfg.mode == 'async':
        executor, counting, closing = _async_executor(cfg, scheduler, backend, request_config, progress, task)
    else:
        counting, closing = _Counting(backend, progress, task), None
        executor = Executor(scheduler, counting, request_config, max_turns=cfg.max_turns or None, on_error='return')
    try:
        return _run_batches(cfg, executor, counting, requests, out_dir, progress, task)
    finally:
        if closing is not None:
            closing()


def _async_executor(cfg: Any, scheduler: Any, backend: Any, request_config: Any, progress: Any, task: Any) -> tuple:
    """``--mode async``: the backend's async ``rollout_fn`` (its own concurrent path, or a dynamic
    batcher over its batch calls, ``docs/backends.md``); progress advances per finished request."""
    from ..executor import Executor

    make = getattr(backend, 'async_rollout_fn', None)
    rollout_fn = make() if callable(make) else backend
    counting = _AsyncProgress(progress, task)
    executor = Executor(scheduler, rollout_fn, request_config, max_turns=cfg.max_turns or None, on_error='return',
                        mode='async', max_concurrency=cfg.max_concurrency, on_finished=counting.finished)
    close = getattr(rollout_fn, 'close', None) if rollout_fn is not backend else None  # a batcher's threads
    return executor, counting, close


class _AsyncProgress:
    """The progress bar in async mode: one tick per finished request (there are no turns)."""

    def __init__(self, progress: Any, task: Any) -> None:
        self.progress, self.task = progress, task
        self.done = 0

    def start_batch(self, size: int, done_before: int) -> None:
        self.done = done_before

    def finished(self, request: Any) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress.update(self.task, completed=self.done, description=f'{request.uuid} {request.finish_reason}')


def _run_batches(cfg: Any, executor: Any, counting: Any, requests: List[Any], out_dir: Path, progress: Any,
                 task: Any) -> Dict[str, Any]:
    from ..trajectories import trajectory_from_output, write_trajectories

    tallies: Dict[str, Any] = {'reasons': Counter(), 'turns': [], 'failures': [], 'infos': [], 'rollout_fn_calls': 0,
                               'trace_tokens': 0, 'tool_calls': 0, 'tool_errors': 0}
    t_run = time.perf_counter()
    with open(out_dir / 'trajectories.jsonl', 'w', encoding='utf-8') as traj_f, \
            open(out_dir / 'trace.jsonl', 'w', encoding='utf-8') as trace_f:
        for start in range(0, len(requests), cfg.batch_size):
            batch = requests[start:start + cfg.batch_size]
            uuids = [r.uuid for r in batch]
            counting.start_batch(len(batch), start)
            offset_t = time.perf_counter() - t_run
            result = executor.run(batch)
            tallies['rollout_fn_calls'] += result.rollout_fn_calls
            trajectories = []
            for i, (output, reason) in enumerate(zip(result.outputs, result.finish_reasons)):
                traj = trajectory_from_output(output, uuids[i], index=start + i, finish_reason=reason)
                trajectories.append(traj)
                tallies['reasons'][reason] += 1
                tallies['turns'].append(traj.num_turns or 0)
                tallies['infos'].append(traj.rollout_infos)
            write_trajectories(traj_f, trajectories)
            for failure in result.failures:
                d = failure.to_dict()
                d['index'] = start + failure.index
                tallies['failures'].append(d)
            if result.trace is not None:
                for e in result.trace.events:
                    e.index += start
                    if e.t is not None:
                        e.t = round(e.t + offset_t, 6)
                    if e.tokens:
                        tallies['trace_tokens'] += e.tokens
                    calls, errors = _tool_counts(e.extra)
                    tallies['tool_calls'] += calls
                    tallies['tool_errors'] += errors
                result.trace.write_jsonl(trace_f)
            traj_f.flush()
            trace_f.flush()
            if progress is not None:
                progress.update(task, completed=start + len(batch), description='')
    tallies['wall_s'] = time.perf_counter() - t_run
    return tallies


def _count(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, (list, tuple)):
        return len(value)
    return 0


def _tool_counts(extra: Any) -> Tuple[int, int]:
    """Tool calls and tool errors of one step, from its ``trace_info`` (``docs/trace-format.md``):
    a ``calls`` list (one entry per call of this step, what the declarative scheduler writes; its
    ``tool_calls``/``tool_errors`` are then running totals and are not counted again), else
    ``tool_calls`` and ``tool_errors`` as counts or lists."""
    if not isinstance(extra, dict):
        return 0, 0
    calls = extra.get('calls')
    if isinstance(calls, list):
        errors = sum(1 for c in calls if isinstance(c, dict) and (c.get('ok') is False or c.get('error')))
        return len(calls), errors
    return _count(extra.get('tool_calls')), _count(extra.get('tool_errors'))


# ---- the summary ------------------------------------------------------------------------------------
def summarize(cfg: Any, backend: Any, requests: List[Any], tallies: Dict[str, Any], load_s: float) -> Dict[str, Any]:
    turns = tallies['turns']
    stats = getattr(backend, 'stats', None)
    generated = stats.completion_tokens if stats is not None else tallies['trace_tokens']
    gen_s = stats.generate_s if stats is not None else None
    tool_calls, tool_errors = tallies['tool_calls'], tallies['tool_errors']
    if not tool_calls:  # schedulers that count tools in rollout_infos instead of the trace
        tool_calls = sum(_count(i.get('tool_calls', i.get('num_tool_calls'))) for i in tallies['infos'])
        tool_errors = sum(_count(i.get('tool_errors', i.get('num_tool_errors'))) for i in tallies['infos'])
    rewards = [i['reward'] for i in tallies['infos'] if isinstance(i.get('reward'), (int, float))]
    load_info = getattr(backend, 'load_info', {}) or {}
    return {
        'config': cfg.source,
        'backend': backend.describe() if hasattr(backend, 'describe') else cfg.backend,
        'scheduler': cfg.scheduler,
        'requests': len(requests),
        'finish_reasons': dict(tallies['reasons'].most_common()),
        'errors': len(tallies['failures']),
        'turns': {
            'min': min(turns) if turns else 0,
            'mean': round(sum(turns) / len(turns), 2) if turns else 0,
            'max': max(turns) if turns else 0,
            'histogram': {str(k): v for k, v in sorted(Counter(turns).items())},
            'multi_turn_requests': sum(1 for t in turns if t > 1),
        },
        'rollout_fn_calls': tallies['rollout_fn_calls'],
        'tool_calls': tool_calls,
        'tool_errors': tool_errors,
        'reward_mean': round(sum(rewards) / len(rewards), 4) if rewards else None,
        'generated_tokens': generated,
        'generate_s': round(gen_s, 3) if gen_s is not None else None,
        'wall_s': round(tallies['wall_s'], 3),
        'tokens_per_s': round(generated / tallies['wall_s'], 1) if tallies['wall_s'] > 0 else None,
        'model_load_s': round(load_s, 3),
        'model_cached': load_info.get('cached'),
        'failures': tallies['failures'][:20],
    }


def print_summary(summary: Dict[str, Any], out_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title='mtflow run', show_header=False, title_justify='left')
    table.add_column('', style='bold')
    table.add_column('')
    reasons = ', '.join(f'{k} {v}' for k, v in summary['finish_reasons'].items())
    t = summary['turns']
    hist = '  '.join(f'{k}:{v}' for k, v in t['histogram'].items())
    table.add_row('backend', summary['backend'])
    table.add_row('scheduler', str(summary['scheduler']))
    table.add_row('requests', str(summary['requests']))
    table.add_row('finish reasons', reasons)
    table.add_row('turns per request', f"min {t['min']}  mean {t['mean']}  max {t['max']}")
    table.add_row('turns histogram', f'(turns:requests) {hist}')
    table.add_row('multi-turn requests', f"{t['multi_turn_requests']} of {summary['requests']} went past turn 1")
    table.add_row('rollout_fn calls', str(summary['rollout_fn_calls']))
    table.add_row('tool calls / errors', f"{summary['tool_calls']} / {summary['tool_errors']}")
    if summary['reward_mean'] is not None:
        table.add_row('mean reward', str(summary['reward_mean']))
    errors = summary['errors']
    table.add_row('request errors', f'[red]{errors}[/red]' if errors else '0')
    table.add_row('generated tokens', str(summary['generated_tokens']))
    tps = summary['tokens_per_s']
    table.add_row('tokens/s', f"{tps} (wall {summary['wall_s']} s"
                  + (f", generating {summary['generate_s']} s)" if summary['generate_s'] is not None else ')'))
    cached = summary['model_cached']
    table.add_row('model load', f"{summary['model_load_s']} s" +
                  ('' if cached is None else ' (cached copy)' if cached else ' (converted, now cached)'))
    table.add_row('output', f'{out_dir}/trajectories.jsonl, trace.jsonl, summary.json')
    console = Console()
    console.print(table)
    for failure in summary['failures'][:3]:
        console.print(f"[red]error[/red] request {failure['uuid']} turn {failure['turn']} ({failure['phase']}): "
                      f"{failure['type']}: {failure['message']}")


def main(args: argparse.Namespace) -> int:
    from ..data import DatasetError, read_prompts

    cfg = load_config(args)
    try:
        requests = read_prompts(cfg.dataset_path(), limit=cfg.limit)
    except DatasetError as exc:
        raise CLIError(str(exc)) from None
    make_scheduler = scheduler_factory(cfg)
    seed_everything(cfg.seed)
    show = not (args.quiet or args.no_progress)
    status = None
    if show:
        from rich.console import Console

        status = Console(stderr=True).status(f'loading backend {cfg.backend} ({cfg.model or "default model"}) ...')
        status.start()
    t0 = time.perf_counter()
    try:
        backend = build_backend(cfg)
    finally:
        if status is not None:
            status.stop()
    load_s = time.perf_counter() - t0
    try:
        scheduler = make_scheduler(getattr(backend, 'tokenizer', None))
        out_dir = Path(cfg.out)
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CLIError(f'cannot create output directory {out_dir}: {exc.strerror or exc}') from None
        progress = _progress(show)
        if progress is not None:
            progress.start()
        try:
            tallies = run_batches(cfg, scheduler, backend, requests, out_dir, progress)
        finally:
            if progress is not None:
                progress.stop()
    finally:
        close = getattr(backend, 'close', None)
        if callable(close):
            close()
    summary = summarize(cfg, backend, requests, tallies, load_s)
    (out_dir / 'summary.json').write_text(json.dumps(summary, indent=2, default=str) + '\n', encoding='utf-8')
    if not args.quiet:
        print_summary(summary, out_dir)
    return 1 if summary['requests'] and summary['finish_reasons'].get('error', 0) == summary['requests'] else 0
