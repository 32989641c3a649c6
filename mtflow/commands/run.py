"""``mtflow run CONFIG``: roll out a scheduler over a prompt dataset with a model.

Reads the run config (``mtflow/run/config.py``), applies the command-line overrides, checks the
whole dataset, opens the output directory (``mtflow/run/store.py``: new, ``--resume`` or
``--overwrite``; a refusal comes before the slow model load), builds the backend
(``mtflow/backends``) and the scheduler, then streams the prompts (a JSONL file or generated
reasoning-gym tasks, ``num_generations`` copies each: ``mtflow/data/sources.py``) through
``mtflow.Executor`` in batches of ``batch_size`` (``on_error='return'``: a failing request is
recorded, the others go on; ``mtflow/run/driver.py``). Each request is written the moment it finishes, in the output
directory:

* ``trajectories.jsonl``: one line per finished request (``mtflow/run/trajectories.py`` format:
  messages, token id segments, loss masks, logprobs, infos, finish reason, turns);
* ``trace.jsonl``: the state transitions of those requests (``docs/trace-format.md``), indices
  and times continuous across batches and attempts, so ``mtflow trace show`` reads the whole run;
* ``summary.json``: the figures of the summary table printed at the end (requests, finish
  reasons, turns per request, tool calls and errors, the per-group reward spread of
  ``num_generations`` copies, generated tokens, tokens/s) and the status
  (``complete``/``interrupted``);
* ``run.json`` (fingerprint, attempts), ``interrupted.jsonl`` after a stop by signal.

SIGINT/SIGTERM stop cleanly (``mtflow/run/signals.py``), exit 130/143. A progress bar (on
stderr) follows requests as they finish, turn by turn. Every user error (a missing file, a bad
config, an unknown backend, a model that cannot be loaded, a non-empty output directory) is one
line.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from mtflow.cli import CLIError


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
    p.add_argument('--resume', action='store_true',
                   help='continue the interrupted run in the output directory (same config and dataset)')
    p.add_argument('--overwrite', action='store_true',
                   help='start afresh in a non-empty output directory (the old one is moved to OUT.old-<time>)')
    p.add_argument('--delete-old', action='store_true', help='with --overwrite: delete the old run files instead')
    p.add_argument('--flush-every', type=int, default=256, metavar='N',
                   help='write and fsync finished requests in groups of N (default 256) ...')
    p.add_argument('--flush-interval', type=float, default=2.0, metavar='S',
                   help='... or when the oldest one has waited S seconds (default 2)')
    p.add_argument('--ray', type=int, metavar='N',
                   help='fan the rollout out over N Ray actors, each with its own backend (docs/distributed.md)')
    p.add_argument('--ray-address', metavar='ADDR',
                   help="with --ray: join this Ray cluster ('auto', 'host:6379', 'ray://host:10001') "
                   'instead of starting a local one')
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
    from mtflow.core.safe_yaml import YamlLoadError, load_yaml  # the scalar rules of config files (yes is a string)

    opts = {}
    for item in items:
        key, sep, value = item.partition('=')
        if not sep or not key:
            raise CLIError(f'--option needs KEY=VALUE, got {item!r}')
        try:
            opts[key.strip()] = load_yaml(value)[0]
        except YamlLoadError:
            opts[key.strip()] = value
    return opts


def load_config(args: argparse.Namespace) -> Any:
    from mtflow.run.config import RunConfigError, load_run_config

    overrides = _overrides(args)
    backend = overrides.pop('backend')
    try:
        cfg = load_run_config(args.config, overrides)
    except RunConfigError as exc:
        raise CLIError(str(exc)) from None
    if backend is not None and backend != cfg.backend:
        from mtflow.backends import ALIASES, BACKENDS

        if backend not in BACKENDS and backend not in ALIASES:
            raise CLIError(f'unknown backend {backend!r}; choose one of: {", ".join(BACKENDS)}')
        # keep the config's backend_options that the new backend takes; say which are dropped
        from mtflow.backends import split_options

        kept, dropped = split_options(backend, dict(cfg.backend_options))
        if dropped:
            print(f'mtflow: --backend {backend}: ignoring backend_options {", ".join(sorted(dropped))} '
                  f'(not options of {backend})', file=sys.stderr)
        cfg = cfg.model_copy(update={'backend': backend, 'backend_options': kept})
    if args.option:
        cfg.backend_options.update(_parse_options(args.option))
    sampling = {'max_tokens': args.max_tokens, 'temperature': args.temperature}
    cfg.request_config.update({k: v for k, v in sampling.items() if v is not None})
    return cfg


def seed_everything(seed: Optional[int]) -> None:
    """Seed Python's RNG, and torch's when the backend imported torch (called once the backend is
    built: importing torch only to seed it would cost a scripted or server run ~200 MB and
    seconds)."""
    if seed is None:
        return
    random.seed(seed)
    torch = sys.modules.get('torch')
    if torch is not None and hasattr(torch, 'manual_seed'):
        torch.manual_seed(seed)


def build_backend(cfg: Any) -> Any:
    from mtflow.backends import BackendError, backend_options, make_backend

    options = cfg.resolved_backend_options()
    try:
        if cfg.seed is not None and 'seed' not in options and 'seed' in backend_options(cfg.backend)[0]:
            options['seed'] = cfg.seed  # every backend that can be seeded (docs/cli.md)
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
            from mtflow.declarative import load_scheduler
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


def _preflight(cfg: Any) -> None:
    """Raise one :class:`CLIError` listing every problem ``mtflow validate`` would report."""
    from mtflow.run.preflight import check_run_config

    if cfg.scheduler_is_yaml() and not cfg.scheduler_path().is_file():
        return  # scheduler_factory says so
    problems = check_run_config(cfg, check_dataset=False).problems  # the dataset was just read
    if problems:
        raise CLIError('\n'.join(map(str, problems)))


# ---- running ------------------------------------------------------------------------------------
def _progress(enabled: bool) -> Any:
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn)

    return Progress(SpinnerColumn(), TextColumn('[bold]rollout'), BarColumn(), MofNCompleteColumn(),
                    TextColumn('{task.description}'), TimeElapsedColumn(), console=Console(stderr=True),
                    transient=False)


def open_store(cfg: Any, args: argparse.Namespace, fingerprint: Dict[str, Any]) -> Any:
    """The run directory, opened as the flags say (``--resume``, ``--overwrite``), before the
    backend loads: a refusal costs no model load."""
    from mtflow.run.store import RunDirError, RunStore

    if args.resume and args.overwrite:
        raise CLIError('--resume and --overwrite exclude each other: continue the run, or start it afresh')
    if args.delete_old and not args.overwrite:
        raise CLIError('--delete-old goes with --overwrite')
    if args.flush_every < 1 or args.flush_interval < 0:
        raise CLIError('--flush-every must be >= 1 and --flush-interval >= 0')
    mode = 'resume' if args.resume else 'overwrite' if args.overwrite else 'new'
    try:
        return RunStore.open(cfg.out, mode, fingerprint, delete_old=args.delete_old, flush_every=args.flush_every,
                             flush_interval_s=args.flush_interval)
    except RunDirError as exc:
        raise CLIError(str(exc)) from None


def rollout(cfg: Any, scheduler: Any, backend: Any, store: Any, total: int, show: bool,
            figures: Dict[str, Any]) -> None:
    """Stream every prompt the store does not have through the executor (``mtflow/run/driver.py``);
    this attempt's figures go into ``figures``, also when a signal stops it."""
    from mtflow.data.sources import iter_requests
    from mtflow.engine.executor import Executor
    from mtflow.run.driver import StreamingRun

    request_config = cfg.make_request_config()

    from mtflow.accounting.token_record import record_accounting

    closing: List[Callable[[], None]] = []

    def make_executor(rollout_fn: Any, on_finished: Any) -> Any:
        if cfg.mode == 'async':
            # the backend's async rollout_fn (its own concurrent path, or a dynamic batcher over
            # its batch calls, docs/backends.md); there are no turns to count
            make = getattr(backend, 'async_rollout_fn', None)
            async_fn = make() if callable(make) else backend
            close = getattr(async_fn, 'close', None) if async_fn is not backend else None  # a batcher's threads
            if callable(close):
                closing.append(close)
            return Executor(scheduler, async_fn, request_config, max_turns=cfg.max_turns or None, on_error='return',
                            on_finished=on_finished, mode='async', max_concurrency=cfg.max_concurrency,
                            accounting=record_accounting(scheduler))
        return Executor(scheduler, rollout_fn, request_config, max_turns=cfg.max_turns or None, on_error='return',
                        on_finished=on_finished, accounting=record_accounting(scheduler))  # ids/masks from the exact token record

    progress = _progress(show)
    left = total - len(store.done)
    task = progress.add_task('starting', total=left) if progress is not None else None

    def on_progress(finished: int, description: str) -> None:
        progress.update(task, completed=finished, description=description)

    run = StreamingRun(make_executor, backend, store, cfg.batch_size, on_progress if progress is not None else None)
    if progress is not None:
        progress.start()
    try:
        # checked in full before the run (count_prompts); the store refuses a uuid written twice
        run.run(iter_requests(cfg.dataset, cfg.dataset_path(), cfg.limit, cfg.num_generations, check_unique=False))
    finally:
        for close in closing:
            close()
        if progress is not None:
            progress.stop()
        figures.update(run.figures())


# ---- the summary ------------------------------------------------------------------------------------
def summarize(cfg: Any, backend: Any, store: Any, total: int, figures: Dict[str, Any], load_s: float) -> Dict[str, Any]:
    """The figures of ``summary.json``: the requests on disk (every attempt, from the store's
    tally) and this attempt's timings."""
    tally = store.tally
    stats = getattr(backend, 'stats', None)
    gen_s = stats.generate_s if stats is not None else None
    attempt_tokens = stats.completion_tokens if stats is not None else None
    wall_s = figures.get('wall_s') or 0.0
    tool_calls, tool_errors = tally.tool_calls()
    load_info = getattr(backend, 'load_info', {}) or {}
    done = len(store.done)
    return {
        'config': cfg.source,
        'backend': backend.describe() if hasattr(backend, 'describe') else cfg.backend,
        'scheduler': cfg.scheduler,
        'requests': total,
        'written': done,
        'interrupted': store.interrupted,
        'remaining': max(total - done, 0),
        'finish_reasons': dict(tally.reasons.most_common()),
        'errors': tally.errors,
        'turns': tally.turns_summary(),
        'rollout_fn_calls': figures.get('rollout_fn_calls', 0),
        'tool_calls': tool_calls,
        'tool_errors': tool_errors,
        'tool_error_kinds': tally.tool_error_kinds(),
        'reward_mean': tally.reward_mean(),
        'reward_groups': tally.reward_groups(),
        'generated_tokens': tally.trace_tokens,
        'generate_s': round(gen_s, 3) if gen_s is not None else None,
        'wall_s': round(wall_s, 3),
        'tokens_per_s': round((attempt_tokens if attempt_tokens is not None else tally.trace_tokens) / wall_s, 1)
        if wall_s > 0 else None,
        'model_load_s': round(load_s, 3),
        'model_cached': load_info.get('cached'),
        'attempts': len(store.info.get('attempts') or []),
        'resumed_from': store.info['attempts'][-1].get('done_at_start', 0) if store.resumed else None,
        'write_s': figures.get('write_s'),
        'failures': tally.failures,
        'finish_policy': tally.policy.summary(),
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
    status = summary.get('status', 'complete')
    table.add_row('backend', summary['backend'])
    table.add_row('scheduler', str(summary['scheduler']))
    table.add_row('status', status if status == 'complete' else f'[yellow]{status}[/yellow]')
    requests = str(summary['requests'])
    if summary['written'] != summary['requests'] or summary['resumed_from']:
        requests += f" ({summary['written']} written"
        requests += f", {summary['resumed_from']} by earlier attempts" if summary['resumed_from'] else ''
        requests += f", {summary['interrupted']} interrupted" if summary['interrupted'] else ''
        requests += ')'
    table.add_row('requests', requests)
    table.add_row('finish reasons', reasons)
    table.add_row('turns per request', f"min {t['min']}  mean {t['mean']}  max {t['max']}")
    table.add_row('turns histogram', f'(turns:requests) {hist}')
    table.add_row('multi-turn requests', f"{t['multi_turn_requests']} of {summary['written']} went past turn 1")
    table.add_row('rollout_fn calls', str(summary['rollout_fn_calls']))
    table.add_row('tool calls / errors', f"{summary['tool_calls']} / {summary['tool_errors']}")
    if summary.get('tool_error_kinds'):
        table.add_row('tool error kinds', ', '.join(f'{k} {v}' for k, v in summary['tool_error_kinds'].items()))
    if summary['reward_mean'] is not None:
        table.add_row('mean reward', str(summary['reward_mean']))
    if summary.get('finish_policy'):
        table.add_row('finish policy', ', '.join(f'{k} {v}' for k, v in summary['finish_policy'].items()))
    if summary.get('reward_groups'):
        from mtflow.run.reward_spread import spread_rows
        for label, text in spread_rows(summary['reward_groups']):
            table.add_row(label, text)
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
        console.print(f"[red]error[/red] request {failure.get('uuid')} turn {failure.get('turn')} "
                      f"({failure.get('phase')}): {failure.get('type')}: {failure.get('message')}")


def dataset_file(cfg: Any) -> Optional[Path]:
    """The JSONL file a run reads (the bundled one for ``dataset: null``), or ``None`` for a
    generated dataset (its spec is in the fingerprint instead)."""
    from mtflow.data import bundled_dataset

    if isinstance(cfg.dataset, dict):
        return None
    return cfg.dataset_path() or bundled_dataset()


def _say(message: str) -> None:
    print(f'mtflow: {message}', file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    from mtflow.data import DatasetError
    from mtflow.data.sources import count_requests
    from mtflow.run.fingerprint import run_fingerprint
    from mtflow.run.signals import StopSignals, exit_code_for
    from mtflow.run.store import RunDirError

    cfg = load_config(args)
    try:  # every line (or a generated dataset's spec) checked before anything starts
        total = count_requests(cfg.dataset, cfg.dataset_path(), cfg.limit, cfg.num_generations)
    except DatasetError as exc:
        raise CLIError(str(exc)) from None
    _preflight(cfg)  # every problem of the scheduler (and its plugins) before the slow backend load
    make_scheduler = scheduler_factory(cfg)
    fingerprint = run_fingerprint(cfg, dataset_file(cfg))
    quiet = args.quiet
    show = not (args.quiet or args.no_progress)
    signals = StopSignals(message=None)
    backend = scheduler = None
    load_s = 0.0
    figures: Dict[str, Any] = {}
    with signals:
        try:
            store = open_store(cfg, args, fingerprint)
        except KeyboardInterrupt:  # the store released what it had opened
            return exit_code_for(signals.signum) if signals.signum is not None else 130
        out_dir = store.out_dir
        if store.set_aside is not None and not quiet:
            _say(f'--overwrite: the previous run is now in {store.set_aside}')
        if store.resumed and not quiet:
            notes = '; '.join(store.recovery.notes())
            _say(f'resuming {out_dir}: {len(store.done)} of {total} requests already written'
                 + (f' ({notes})' if notes else ''))
        try:
            if args.ray is not None:  # the actors build backend and scheduler (mtflow/distributed/ray_cli.py)
                from mtflow.distributed.ray_cli import RayRollout

                fan_out = RayRollout(cfg, args, store, total, show)
                backend = fan_out.backend
                fan_out.run(figures)
                load_s = fan_out.load_s
            else:
                status = None
                if show:
                    from rich.console import Console

                    status = Console(stderr=True).status(
                        f'loading backend {cfg.backend} ({cfg.model or "default model"}) ...')
                    status.start()
                t0 = time.perf_counter()
                try:
                    backend = build_backend(cfg)
                finally:
                    if status is not None:
                        status.stop()
                load_s = time.perf_counter() - t0
                seed_everything(cfg.seed)
                scheduler = make_scheduler(getattr(backend, 'tokenizer', None))
                if not quiet:
                    signals.message = ('mtflow: stopping: the requests in flight finish as interrupted '
                                       '(press Ctrl-C again to exit at once)')
                rollout(cfg, scheduler, backend, store, total, show, figures)
            run_status, code = 'complete', 0
        except KeyboardInterrupt:
            run_status = 'interrupted'
            code = exit_code_for(signals.signum) if signals.signum is not None else 130
            if backend is None:  # stopped while the model loaded: nothing ran
                store.discard()
                return code
        except RunDirError as exc:
            store.abandon()
            raise CLIError(str(exc)) from None
        except BaseException:
            store.discard()  # nothing written (a backend that cannot start): leave no run behind
            raise
        finally:
            close_scheduler = getattr(scheduler, 'close', None)
            try:
                if callable(close_scheduler):  # e.g. stops the OpenEnv servers a scheduler launched
                    close_scheduler()
            finally:
                close = getattr(backend, 'close', None)
                if callable(close):
                    close()
        summary = summarize(cfg, backend, store, total, figures, load_s) if backend is not None else None
        try:
            store.close(run_status, summary, attempt=figures)
        except RunDirError as exc:
            raise CLIError(str(exc)) from None
    if run_status == 'interrupted':
        if not quiet:
            _say(f'interrupted: {len(store.done)} of {total} requests are written to {out_dir}, '
                 f'{store.interrupted} in flight were kept in interrupted.jsonl; '
                 f'rerun the same command with --resume to continue')
        return code
    if not quiet:
        print_summary({'status': run_status, **summary}, out_dir)
    written = summary['written']
    return 1 if written and summary['finish_reasons'].get('error', 0) == written else 0
