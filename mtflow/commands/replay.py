"""``mtflow replay RUN_DIR --out NEW_DIR [CONFIG]``: the run again, with its recorded model outputs.

The model is the record (``mtflow/run/replay.py``: each request's output at each turn, exact ids,
served only while the prompt is the one it answered); the scheduler, tools, environment and
reward are CONFIG's as they are now (default: the config the run was made from, ``run.json``'s
``config_file``). A request whose prompt now differs finishes with ``replay_diverged`` at that
turn, or with ``--continue-with BACKEND`` goes on live with that model. The new directory is a
run like any other (``mtflow diff RUN_DIR NEW_DIR`` compares them). ``--tools recorded`` serves
tool and environment results from the record instead (``mtflow/run/recorded_steps.py``).

A gateway run (``mtflow gateway``; ``run.json`` says ``gateway``) is replayed as a gateway: the
recorded outputs are served by session and turn to an agent run again against the new URL
(``--port``), until SIGINT/SIGTERM (``docs/gateway.md``).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Dict, Optional

from mtflow.backends import BACKENDS, BackendError, make_backend
from mtflow.commands.run import dataset_file, parse_options, run_meta
from mtflow.core.errors import UserError
from mtflow.data.sources import count_requests
from mtflow.run.agent_config import GatewayConfig
from mtflow.run.assembly import scheduler_factory, seed_everything
from mtflow.run.config import load_run_config
from mtflow.run.driver import roll_out
from mtflow.run.files import RUN_INFO, check_out_apart, recorded_config_file
from mtflow.run.fingerprint import run_fingerprint
from mtflow.run.preflight import check_before_load
from mtflow.run.recorded_steps import RecordedSteps
from mtflow.run.replay import ReplayBackend, run_prompter
from mtflow.run.diff import trajectories_file
from mtflow.run.signals import StopSignals
from mtflow.run.store import RunStore
from mtflow.run.summary import print_summary, summarize


#: read the arguments intermixed (``mtflow/cli.py``): CONFIG may come after ``--out`` as the docs write it
INTERMIXED = True


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser('replay', help="re-run a run with its recorded model outputs against a (new) config",
                       description='Replay a run directory: recorded model outputs, the scheduler, tools, '
                       'environment and reward of CONFIG (default: the run\'s own config).')
    p.add_argument('run_dir', help='the recorded run directory')
    p.add_argument('config', nargs='?', help="a run config (default: the run's own, from run.json)")
    p.add_argument('--out', required=True, help='the new run directory')
    p.add_argument('--continue-with', metavar='BACKEND', choices=BACKENDS,
                   help='continue diverged requests live with this backend (hf, vllm, openai, scripted, swift)')
    p.add_argument('--model', help='the --continue-with backend\'s model')
    p.add_argument('-o', '--option', action='append', default=[], metavar='KEY=VALUE',
                   help='an option of the --continue-with backend; repeatable')
    p.add_argument('--tools', choices=('live', 'recorded'), default='live',
                   help='live: run the tools and environment of CONFIG (default); recorded: serve their results '
                   'from the record, calling no tool and no environment')
    p.add_argument('--overwrite', action='store_true', help='start afresh in a non-empty --out')
    p.add_argument('--host', help='a gateway run: the address the replay serves on (default: the config\'s)')
    p.add_argument('--port', type=int, help='a gateway run: the port it serves on (default 0: a free one, printed)')
    p.add_argument('-q', '--quiet', action='store_true', help='no progress bar and no summary table')
    p.set_defaults(func=main)


def _run_info(run_dir: Path) -> Dict[str, Any]:
    try:
        return json.loads((run_dir / RUN_INFO).read_text(encoding='utf-8'))
    except FileNotFoundError:
        raise UserError(f'{run_dir} is not a run directory (no {RUN_INFO})') from None
    except ValueError as exc:
        raise UserError(f'{run_dir / RUN_INFO}: not JSON: {exc}') from None


def _live_backend(args: argparse.Namespace) -> Optional[Any]:
    if args.continue_with is None:
        return None
    try:
        return make_backend(args.continue_with, model=args.model, **parse_options(args.option))
    except BackendError as exc:
        raise UserError(f'--continue-with {args.continue_with}: {exc}') from None


def _run_prompter(info: Dict[str, Any], run_dir: Path) -> Any:
    """The recorded run's tokenizer and prompt settings (``run.json``'s fingerprint), for a run
    whose backend kept an exact-id token record (``mtflow/run/replay.py``: ``run_prompter``)."""
    config = (info.get('fingerprint') or {}).get('config') or {}
    model = config.get('model')
    config_file = recorded_config_file(run_dir, info)
    base = Path(config_file).parent if config_file else None
    if model and base is not None and not Path(model).expanduser().is_absolute() and (base / model).exists():
        model = str(base / model)
    try:
        return run_prompter(str(config.get('backend')), model, dict(config.get('backend_options') or {}))
    except BackendError as exc:
        raise UserError(f'replay: the recorded run used {config.get("backend")} ({model}): {exc}') from None


def _use_recorded(scheduler: Any, run_dir: Path) -> RecordedSteps:
    """Give ``scheduler`` the record's tool and environment results (``--tools recorded``)."""
    use = getattr(scheduler, 'use_recorded', None)
    if not callable(use):
        raise UserError(f'--tools recorded: the scheduler {type(scheduler).__name__} cannot take recorded tool '
                        'results (a YAML scheduler can: YamlScheduler.use_recorded)')
    try:
        recorded = RecordedSteps(run_dir)
    except FileNotFoundError as exc:
        raise UserError(f'--tools recorded: {exc.filename}: {exc.strerror}') from None
    use(recorded)
    return recorded


def _replay_gateway(args: argparse.Namespace, run_dir: Path, info: Dict[str, Any], cfg: Any,
                    trajectories: Path) -> int:
    """A gateway run (``mtflow gateway``): serve its recorded outputs as a gateway, by session and
    turn, to a re-run agent (a session whose prompt now differs ends ``replay_diverged``, its call
    answered 409, or goes on live with ``--continue-with``); until SIGINT/SIGTERM."""
    from mtflow.commands import gateway as served  # lazy: the gateway's HTTP server only for gateway runs

    if args.tools == 'recorded':
        raise UserError('--tools recorded: a gateway run\'s tools are the agent\'s own, not mtflow\'s')
    settings = (cfg.gateway or GatewayConfig()).model_copy(
        update={k: v for k, v in (('host', args.host), ('port', 0 if args.port is None else args.port)) if v is not None})
    fingerprint = {**run_fingerprint(cfg, None), 'replay_of': str(run_dir.resolve())}
    meta = {**run_meta(cfg), 'replay_of': str(run_dir.resolve()), 'gateway': True}
    store = RunStore.open(cfg.out, 'overwrite' if args.overwrite else 'new', fingerprint, meta=meta)
    backends: list = []

    def start() -> Any:
        live = _live_backend(args)
        prompter = _run_prompter(info, run_dir) if live is None else None
        backend = ReplayBackend(trajectories, live=live, tokenizer=getattr(prompter, 'tokenizer', None),
                                prompter=prompter)
        backends.append(backend)
        return served.Gateway.from_config(cfg, backend, store, settings=settings).start()

    def figures(gateway: Any) -> Dict[str, Any]:
        backend = backends[0]
        return {'replay': {'of': str(run_dir), 'replayed_outputs': backend.served,
                           'diverged': len(set(backend.diverged)), 'live_outputs': backend.live_calls}}

    try:
        return served.serve(store, start, args.quiet, figures)
    finally:
        for backend in backends:
            backend.close()


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    info = _run_info(run_dir)
    trajectories = trajectories_file(run_dir)
    check_out_apart(args.out, run_dir, 'replay', overwrite=True)  # before anything is opened or moved
    config = args.config or recorded_config_file(run_dir, info)
    if not config:
        raise UserError(f'{run_dir / RUN_INFO} names no config_file: give the CONFIG to replay against')
    cfg = load_run_config(config, {'out': args.out})
    if info.get('gateway'):
        return _replay_gateway(args, run_dir, info, cfg, trajectories)
    total = count_requests(cfg.dataset, cfg.dataset_path(), cfg.limit, cfg.num_generations)
    check_before_load(cfg, with_backend=False)  # the recorded outputs are the model: its backend is not built
    make_scheduler = scheduler_factory(cfg)
    fingerprint = {**run_fingerprint(cfg, dataset_file(cfg)), 'replay_of': str(run_dir.resolve())}
    meta = {**run_meta(cfg), 'replay_of': str(run_dir.resolve())}
    show = not args.quiet
    with StopSignals(message=None):
        store = RunStore.open(cfg.out, 'overwrite' if args.overwrite else 'new', fingerprint, meta=meta)
        backend = scheduler = recorded = None
        figures: Dict[str, Any] = {}
        status = 'failed'
        started = time.perf_counter()
        try:
            live = _live_backend(args)
            prompter = _run_prompter(info, run_dir) if live is None else None
            backend = ReplayBackend(trajectories, live=live, tokenizer=getattr(prompter, 'tokenizer', None),
                                    prompter=prompter)
            load_s = time.perf_counter() - started
            seed_everything(cfg.seed)
            scheduler = make_scheduler(backend.tokenizer)
            if args.tools == 'recorded':
                recorded = _use_recorded(scheduler, run_dir)
            try:
                roll_out(cfg, scheduler, backend, store, total, show, figures)
                status = 'complete'
            except KeyboardInterrupt:
                status = 'interrupted'
            figures.update({'replayed_outputs': backend.served, 'diverged': len(set(backend.diverged)),
                            'live_outputs': backend.live_calls})
            if recorded is not None:
                figures.update({'recorded_tool_calls': recorded.tool_calls, 'recorded_env_steps': recorded.env_steps})
            summary = summarize(cfg, backend, store, total, figures, load_s)
            store.close(status, summary, attempt=figures)
        except BaseException:
            store.abandon()
            raise
        finally:
            close = getattr(scheduler, 'close', None)
            if callable(close):
                close()
            if backend is not None:
                backend.close()
            if recorded is not None:
                recorded.close()
    if show:
        print_summary({'status': status, **summary}, store.out_dir)
    return 0 if status == 'complete' else 130
