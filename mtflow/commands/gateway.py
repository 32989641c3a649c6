"""``mtflow gateway CONFIG``: serve the config's model to external agents and record every session.

::

    mtflow gateway configs/gateway.yaml --port 0 --out runs/gw
    # mtflow gateway: serving http://127.0.0.1:41237 (OpenAI base URL http://127.0.0.1:41237/s/<session>/v1,
    #   Anthropic http://127.0.0.1:41237/s/<session>) with hf (SmolLM2-135M-Instruct on cpu); writing runs/gw

The config is a run config (``mtflow/run/config.py``: backend, model, request_config, max_turns,
context; its ``gateway:`` section: tool parser, idle timeout, limits; no scheduler is needed).
The output directory is a run directory like ``mtflow run``'s (``--resume`` after a restart keeps
every finished session and says which open ones were cut; ``--overwrite``). The gateway serves
until SIGINT or SIGTERM; the sessions in flight then finish ``interrupted``, the others are
written, and the summary is printed. ``docs/gateway.md``.
"""
from __future__ import annotations

import argparse
import gc
import sys
import threading
from typing import Any, Callable, Dict, Optional

from mtflow.commands.run import open_store
from mtflow.core.errors import UserError
from mtflow.gateway import Gateway
from mtflow.gateway.gateway import close_failed
from mtflow.run.agent_config import GatewayConfig
from mtflow.run.assembly import build_backend, seed_everything
from mtflow.run.config import RunConfig, load_run_config
from mtflow.run.fingerprint import run_fingerprint
from mtflow.run.signals import StopSignals
from mtflow.run.store import RunStore
from mtflow.run.summary import print_summary


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser('gateway', help='serve a model to external agents (OpenAI/Anthropic API), recording sessions',
                       description='Serve the config\'s model on an OpenAI- and Anthropic-compatible endpoint whose '
                       'sessions (http://HOST:PORT/s/<session>/v1) are recorded as exact-token trajectories in a run '
                       'directory; stop with Ctrl-C.')
    p.add_argument('config', help='a run config (backend, model, limits; its gateway: section)')
    p.add_argument('--host', help='the address to listen on (default 127.0.0.1)')
    p.add_argument('--port', type=int, help='the port (0: a free one, printed)')
    p.add_argument('--out', help='the run directory')
    p.add_argument('--backend', help='the backend (overrides the config)')
    p.add_argument('--model', help="the backend's model")
    p.add_argument('--resume', action='store_true', help='continue the run in --out after a restart')
    p.add_argument('--accept-changed', action='store_true',
                   help='with --resume: go on although files the config names changed (recorded in run.json)')
    p.add_argument('--overwrite', action='store_true', help='start afresh in a non-empty --out')
    p.add_argument('--delete-old', action='store_true', help='with --overwrite: delete the old run files instead')
    p.add_argument('--flush-every', type=int, default=256, metavar='N', help='write finished sessions in groups of N')
    p.add_argument('--flush-interval', type=float, default=2.0, metavar='S', help='... or every S seconds')
    p.add_argument('-q', '--quiet', action='store_true', help='no summary table at the end')
    p.set_defaults(func=main, progress_every=10.0)


def _config(args: argparse.Namespace) -> RunConfig:
    overrides = {'out': args.out, 'backend': args.backend, 'model': args.model}
    cfg = load_run_config(args.config, overrides)
    settings = cfg.gateway or GatewayConfig()
    changes: Dict[str, Any] = {k: v for k, v in (('host', args.host), ('port', args.port)) if v is not None}
    if args.port is not None and not 0 <= args.port <= 65535:
        raise UserError(f'--port must be 0 to 65535, not {args.port}')
    return cfg.model_copy(update={'gateway': settings.model_copy(update=changes)})


def _say(message: str) -> None:
    print(f'mtflow: {message}', file=sys.stderr, flush=True)


def serve(store: RunStore, start: Callable[[], Gateway], quiet: bool,
          extra: Optional[Callable[[Gateway], Dict[str, Any]]] = None, note: str = '') -> int:
    """Start the gateway ``start()`` builds (on ``store``), say where it serves, and serve until
    SIGINT or SIGTERM; then close it (the sessions in flight finish ``interrupted``), print the
    summary unless ``quiet`` (``extra(gateway)``: more figures for it), and return the exit code.
    The first stdout line names the URL, then the backend and model that answer (``note``: more
    about them: the default backend a config that names none gets)
    A signal before it serves leaves no run behind (130)."""
    gateway = None
    with StopSignals(message=None) as signals:
        try:
            gateway = start()
            gc.freeze()  # what the start made (a model) lives as long as the process: no collection rescans it
            for note in gateway.notes:  # what the backend was set to do for the tool parser
                _say(note)
            if store.resumed:
                _say(f'resuming {store.out_dir}: {len(store.done)} sessions already written'
                     + (f'; {len(gateway.cut)} open session(s) were cut by the restart (refused from now on): '
                        f'{", ".join(gateway.cut[:20])}' + (' ...' if len(gateway.cut) > 20 else '')
                        if gateway.cut else ''))
                if store.recovery.accepted_changes:
                    _say(store.recovery.accepted_note())
            print(f'mtflow gateway: serving {gateway.url} (OpenAI base URL {gateway.url}/s/<session>/v1, Anthropic '
                  f'{gateway.url}/s/<session>) with {gateway.serves}{note}; writing {store.out_dir}', flush=True)
            threading.Event().wait()
        except KeyboardInterrupt:
            _say(f'stopping ({"SIGTERM" if signals.signum == 15 else "SIGINT"}): the sessions in flight finish as '
                 'interrupted')
        except BaseException:
            close_failed(gateway, store)
            raise
        if gateway is None:  # stopped while the model loaded: leave no run behind
            store.discard()
            return 130
        figures = gateway.close(extra=extra(gateway) if extra is not None else None)
    summary = figures.get('summary')
    if summary is not None and not quiet:
        print_summary({'status': figures['status'], **summary}, store.out_dir)
    return 0


#: keys of a run over a dataset that the gateway never reads: its clients bring the prompts and run the tools
NOT_SERVED = ('scheduler', 'scheduler_args', 'dataset', 'num_generations', 'policies', 'roles')


def main(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if cfg.agent is not None:
        raise UserError(f'{cfg.where("agent")}: an agent: section is run by mtflow run, not served by mtflow gateway')
    given = [key for key in NOT_SERVED if key in cfg.lines]
    if given:  # a scheduler's parser, reasoning and rewards would be ignored without a word
        raise UserError(f'{cfg.where(given[0])}: mtflow gateway does not read {", ".join(given)} (its clients bring '
                        'the prompts and run the tools; the gateway: section sets tool_parser and reasoning); remove '
                        f'{"it" if len(given) == 1 else "them"}, or run this config with mtflow run')
    store = open_store(cfg, args, run_fingerprint(cfg, None), meta={'gateway': True})

    def start() -> Gateway:
        seed_everything(cfg.seed)
        backend = build_backend(cfg)
        return Gateway.from_config(cfg, backend, store).start()

    named = 'backend' in cfg.lines or 'backend' in cfg.overridden
    note = '' if named else f', the default backend ({cfg.source or "the config"} names none)'
    return serve(store, start, args.quiet, note=note)

