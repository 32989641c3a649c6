"""``mtflow run CONFIG``: roll out a scheduler over a prompt dataset with a model.

Reads the run config (``mtflow/run/config.py``), applies the command-line overrides, checks the
whole dataset, opens the output directory (``mtflow/run/store.py``: new, ``--resume`` or
``--overwrite``; a refusal comes before the slow model load), builds the backend and the
scheduler (``mtflow/run/assembly.py``), then streams the prompts (a JSONL file or generated
reasoning-gym tasks, ``num_generations`` copies each: ``mtflow/data/sources.py``) through
``mtflow.Executor`` in batches of ``batch_size`` (``on_error='return'``: a failing request is
recorded, the others go on; ``mtflow/run/driver.py``). Each request is written the moment it
finishes, in the output directory:

* ``trajectories.jsonl``: one line per finished request (``mtflow/run/trajectories.py`` format:
  messages, token id segments, loss masks, logprobs, infos, finish reason, turns);
* ``trace.jsonl``: the state transitions of those requests (``docs/trace-format.md``), indices
  and times continuous across batches and attempts, so ``mtflow trace show`` reads the whole run;
* ``summary.json``: the figures of the summary table printed at the end (requests, finish
  reasons, turns per request, tool calls and errors, the per-group reward spread of
  ``num_generations`` copies, generated tokens, tokens/s) and the status
  (``complete``/``interrupted``);
* ``run.json`` (fingerprint, attempts), ``interrupted.jsonl`` after a stop by signal.

SIGINT/SIGTERM stop cleanly (``mtflow/run/signals.py``), exit 130/143. Progress
(``mtflow/run/progress.py``: requests, turns against the bound, tokens/s, ETA) is a live bar on
stderr on a terminal, else one line on stdout every ``--progress-every`` seconds. Every user error (a missing file, a bad
config, an unknown backend, a model that cannot be loaded, a non-empty output directory) is a
:class:`mtflow.core.errors.UserError`, printed by ``mtflow/cli.py`` as one line.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from mtflow.backends import BackendError, check_backend_name, split_options
from mtflow.backends.base import reports_of
from mtflow.core.errors import MtflowError, RunSetupError, UserError
from mtflow.core.safe_yaml import YamlLoadError, load_yaml
from mtflow.data import bundled_dataset
from mtflow.data.sources import count_requests
from mtflow.run.assembly import SchedulerFactory, build_backend, scheduler_factory, seed_everything, tokenizer_of
from mtflow.run.config import RunConfig, load_run_config
from mtflow.run.driver import roll_out
from mtflow.run.episodes import episode_size
from mtflow.run.files import config_file_meta
from mtflow.run.fingerprint import run_fingerprint
from mtflow.run.chat_check import prepare_loaded
from mtflow.run.preflight import check_before_load, check_env_servers
from mtflow.run.progress import progress_mode
from mtflow.run.otel import make_exporter
from mtflow.run.tracking import TRACKERS, check_tracker, make_tracker
from mtflow.run.signals import StopSignals, exit_code_for
from mtflow.run.store import RunDirError, RunStore
from mtflow.run.summary import print_summary, summarize, too_many_failed
from mtflow.run.trees import short_trees
from mtflow.run.turn_log import REPLAY_FORMAT
from mtflow.run.until import parse_until

#: what ``_Attempt.run`` returns when a signal came before the backend was up: nothing to report
NOTHING_RAN = 'nothing ran'


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
    p.add_argument('--set', action='append', default=[], metavar='KEY=VALUE', dest='sets',
                   help='set a config key as the file would (dotted: request_config.max_tokens=32; VALUE is YAML, '
                   'typed by the config schema); repeatable')
    p.add_argument('-n', '--num-generations', type=int, metavar='N',
                   help='copies of each prompt (a GRPO group; config key num_generations)')
    p.add_argument('-o', '--option', action='append', default=[], metavar='KEY=VALUE',
                   help='a backend option (VALUE is YAML: 8, true, "text"); repeatable')
    p.add_argument('--resume', action='store_true',
                   help='continue the interrupted run in the output directory (same config and dataset)')
    p.add_argument('--accept-changed', action='store_true', help='with --resume: go on past changed code (recorded)')
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
    p.add_argument('--until', metavar='SPEC',
                   help='stop after groups=N complete groups (or requests=N, seconds=S, tokens=N; comma-separated: '
                   'whichever comes first), streaming; --resume continues (docs/streaming.md)')
    p.add_argument('--no-progress', action='store_true', help='no progress bar and no progress log lines')
    p.add_argument('--progress-every', type=float, default=10.0, metavar='S',
                   help='when stdout or stderr is not a terminal: one progress line (requests, turns, tokens/s, '
                   'ETA) every S seconds on stdout (default 10)')
    p.add_argument('--log', choices=TRACKERS, metavar='{tensorboard,wandb}',
                   help='also log the progress over time and the summary to TensorBoard (OUT/tensorboard, through '
                   'tensorboardX) or W&B (OUT/wandb, offline unless WANDB_MODE is set)')
    p.add_argument('--otel', metavar='TARGET',
                   help="OpenTelemetry: each request a trace, each turn, model call, env step and tool call a "
                   "span; TARGET 'otlp' ($OTEL_EXPORTER_OTLP_ENDPOINT), 'otlp=URL' or a .jsonl file "
                   '(docs/telemetry.md)')
    p.add_argument('--max-failed-share', type=float, metavar='F',
                   help='exit 1 when more than this share of the requests failed (error or timeout; config key '
                   'max_failed_share, default 0.5)')
    p.add_argument('-q', '--quiet', action='store_true', help='no progress bar and no summary table')
    p.set_defaults(func=main)


# ---- the config and the run directory ------------------------------------------------------------
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
        'num_generations': getattr(args, 'num_generations', None),
        'mode': getattr(args, 'mode', None),
        'max_concurrency': getattr(args, 'max_concurrency', None),
        'max_failed_share': getattr(args, 'max_failed_share', None),
    }


def parse_options(items: List[str]) -> Dict[str, Any]:
    """``-o KEY=VALUE`` flags as backend options; a value reads as YAML with the scalar rules of
    config files (``8``, ``true``, ``yes`` is a string), else as the text given."""
    opts = {}
    for item in items:
        key, sep, value = item.partition('=')
        if not sep or not key:
            raise UserError(f'--option needs KEY=VALUE, got {item!r}')
        try:
            opts[key.strip()] = load_yaml(value)[0]
        except YamlLoadError:
            opts[key.strip()] = value
    return opts


def _switch_backend(cfg: RunConfig, backend: str) -> RunConfig:
    """``--backend`` over the config's: keep the config's backend_options the new backend takes,
    and say which are dropped."""
    try:  # a reference on the command line is looked up in the current directory, as Python's own are
        kept, dropped = split_options(check_backend_name(backend), dict(cfg.backend_options))
    except BackendError as exc:
        raise UserError(f'--backend {backend}: {exc}') from None
    if dropped:
        print(f'mtflow: --backend {backend}: ignoring backend_options {", ".join(sorted(dropped))} '
              f'(not options of {backend})', file=sys.stderr)
    return cfg.model_copy(update={'backend': backend, 'backend_options': kept})


def load_config(args: argparse.Namespace) -> RunConfig:
    """The run config with the command line's overrides."""
    overrides = _overrides(args)
    backend = overrides.pop('backend')
    sampling = {'max_tokens': args.max_tokens, 'temperature': args.temperature}
    cfg = load_run_config(args.config, overrides, sets=getattr(args, 'sets', None), sampling=sampling)
    if backend is not None and backend != cfg.backend:
        cfg = _switch_backend(cfg, backend)
    if args.option:
        options = parse_options(args.option)
        cfg.backend_options.update(options)
        cfg.flags.update({f'backend_options.{k}': f'-o {k}={v}' for k, v in options.items()})
    return cfg


def open_store(cfg: RunConfig, args: argparse.Namespace, fingerprint: Dict[str, Any],
               meta: Optional[Dict[str, Any]] = None) -> RunStore:
    """The run directory, opened as the flags say (``--resume``, ``--overwrite``), before the
    backend loads: a refusal costs no model load. ``meta``: more of ``run.json`` (``gateway``)."""
    if args.resume and args.overwrite:
        raise UserError('--resume and --overwrite exclude each other: continue the run, or start it afresh')
    if args.delete_old and not args.overwrite:
        raise UserError('--delete-old goes with --overwrite')
    accept_changed = getattr(args, 'accept_changed', False)
    if accept_changed and not args.resume:
        raise UserError('--accept-changed goes with --resume')
    if not args.progress_every > 0:
        raise UserError(f'--progress-every must be > 0 seconds, not {args.progress_every}')
    if args.flush_every < 1 or args.flush_interval < 0:
        raise UserError('--flush-every must be >= 1 and --flush-interval >= 0')
    mode = 'resume' if args.resume else 'overwrite' if args.overwrite else 'new'
    return RunStore.open(cfg.out, mode, fingerprint, delete_old=args.delete_old, flush_every=args.flush_every,
                         flush_interval_s=args.flush_interval, meta={**run_meta(cfg), **(meta or {})},
                         accept_changed=accept_changed)


def run_meta(cfg: RunConfig) -> Dict[str, Any]:
    """What ``run.json`` says beyond the fingerprint, for ``mtflow replay`` / ``rescore``: the
    config file (the default config of a replay; absolute, and relative to the run directory:
    ``mtflow/run/files.py`` ``config_file_meta``) and the version of the lines' ``turns``."""
    return {**config_file_meta(cfg.source, cfg.out), 'replay_format': REPLAY_FORMAT}


def dataset_file(cfg: RunConfig) -> Optional[Path]:
    """The JSONL file a run reads (the bundled one for ``dataset: null``), or ``None`` for a
    generated dataset (its spec is in the fingerprint instead)."""
    if isinstance(cfg.dataset, dict):
        return None
    return cfg.dataset_path() or bundled_dataset()


def _say(message: str) -> None:
    print(f'mtflow: {message}', file=sys.stderr)


def _stop_code(signals: StopSignals) -> int:
    return exit_code_for(signals.signum) if signals.signum is not None else 130


# ---- one attempt ----------------------------------------------------------------------------------
class _Attempt:
    """One attempt of ``mtflow run`` on an open run directory: build the backend and the
    scheduler (here, or in each Ray actor with ``--ray``), roll out, and close what was built
    whatever happens. ``figures`` and ``load_s`` feed the summary."""

    def __init__(self, cfg: RunConfig, args: argparse.Namespace, store: RunStore, signals: StopSignals,
                 total: int) -> None:
        self.cfg, self.args, self.store, self.signals, self.total = cfg, args, store, signals, total
        self.quiet = args.quiet
        self.show = not (args.quiet or args.no_progress)
        self.progress_mode = progress_mode(self.show)  # a live bar on a terminal, log lines elsewhere
        self.backend: Any = None
        self.scheduler: Any = None
        self.load_s = 0.0
        self.figures: Dict[str, Any] = {}
        self.tracker: Any = None

    def run(self, make_scheduler: SchedulerFactory) -> Tuple[str, int]:
        """``(status, exit code)``: ``complete``, ``interrupted`` or :data:`NOTHING_RAN` (a signal
        during the model load: the fresh directory is removed again). Anything else that stops
        the rollout propagates, the directory closed as ``failed`` or removed."""
        try:
            if getattr(self.args, 'log', None):  # a fan-out logs its summary only (docs/cli.md)
                self.tracker = make_tracker(self.args.log, self.store.out_dir, Path(self.store.out_dir).name,
                                            self.cfg.model_dump(mode='json'))
            if self.args.ray is not None:
                self._roll_out_on_ray()
            else:
                self._roll_out_here(make_scheduler)
            return ('partial' if self.figures.get('until_met') else 'complete'), 0
        except KeyboardInterrupt:
            if self.backend is None:
                self.store.discard()
                return NOTHING_RAN, _stop_code(self.signals)
            return 'interrupted', _stop_code(self.signals)
        except RunDirError:
            self.store.abandon()
            raise
        except BaseException:
            self.store.discard()  # nothing written (a backend that cannot start): leave no run behind
            if self.tracker is not None:
                self.tracker.close()
            raise
        finally:
            self._close_pieces()

    def _roll_out_on_ray(self) -> None:
        """The actors build backend and scheduler (``mtflow/distributed/ray_cli.py``)."""
        if getattr(self.args, 'otel', None):
            raise RunSetupError("--otel is not available with --ray: the actors' trace events do not pass "
                                'through this process')
        from mtflow.distributed.ray_cli import RayRollout  # lazy: only --ray needs the fan-out (every start paid it)
        fan_out = RayRollout(self.cfg, self.args, self.store, self.total, self.progress_mode)
        self.backend = fan_out.backend
        fan_out.run(self.figures)
        self.load_s = fan_out.load_s

    def _roll_out_here(self, make_scheduler: SchedulerFactory) -> None:
        otel = make_exporter(self.args.otel) if getattr(self.args, 'otel', None) else None
        if otel is not None:
            otel.start_unix = self.store.started_unix  # the events' clock
        try:
            self._roll_out_with(make_scheduler, otel)
        finally:
            if otel is not None:
                otel.close()

    def _roll_out_with(self, make_scheduler: SchedulerFactory, otel: Any) -> None:
        self._load_backend()
        seed_everything(self.cfg.seed)
        self.scheduler = make_scheduler(tokenizer_of(self.backend))
        # special tokens kept, calls carried as the template takes them, the chat template and the context
        for note in prepare_loaded(self.cfg, self.backend, self.scheduler):
            if not self.quiet:
                _say(note)
        if getattr(self.scheduler, 'answers_each_call', False):  # how a replay carries them (mtflow replay)
            self.figures['tool_calls_as'] = self.scheduler.call_form
        preflight = getattr(getattr(self.scheduler, 'env_factory', None), 'preflight', None)
        if callable(preflight):  # launched OpenEnv servers: up, and one session each, before turn 1
            try:
                preflight()
            except MtflowError as exc:
                raise RunSetupError(f'{self.cfg.scheduler}: env.openenv: {exc}') from None
        if not self.quiet:
            self.signals.message = ('mtflow: stopping: the requests in flight finish as interrupted '
                                    '(press Ctrl-C again to exit at once)')
        roll_out(self.cfg, self.scheduler, self.backend, self.store, self.total, self.progress_mode, self.figures,
                 progress_interval_s=self.args.progress_every, tracker=self.tracker,
                 on_request=otel.export_record if otel is not None else None,
                 until=parse_until(getattr(self.args, 'until', None)))

    def _load_backend(self) -> None:
        cfg = self.cfg
        status = None
        if self.progress_mode == 'bar':
            from rich.console import Console  # rich only for the shown status (``-q`` shows none)
            status = Console(stderr=True).status(f'loading backend {cfg.backend} ({cfg.model or "default model"}) ...')
            status.start()
        started = time.perf_counter()
        try:
            self.backend = build_backend(cfg)
        finally:
            if status is not None:
                status.stop()
        self.load_s = time.perf_counter() - started

    def _close_pieces(self) -> None:
        close_scheduler = getattr(self.scheduler, 'close', None)
        try:
            if callable(close_scheduler):  # e.g. stops the OpenEnv servers a scheduler launched
                close_scheduler()
        finally:
            if self.backend is not None:
                reports_of(self.backend).close()

    def close_store(self, status: str) -> Optional[Dict[str, Any]]:
        """Record the attempt in the run directory; the summary's figures (``None`` when no
        backend came up)."""
        summary = (summarize(self.cfg, self.backend, self.store, self.total, self.figures, self.load_s)
                   if self.backend is not None else None)
        self.store.close(status, summary, attempt=self.figures)
        if self.tracker is not None:
            self.tracker.finish({'status': status, **summary} if summary is not None else None)
        return summary


def _announce(store: RunStore, total: int, quiet: bool = False) -> None:
    """What opening the run directory did: the old run set aside, the resume's counts and repairs;
    under ``quiet`` only what changes what the run means (the code ``--accept-changed`` went past)."""
    if quiet:
        if store.recovery.accepted_changes:
            _say(store.recovery.accepted_note())
        return
    if store.set_aside is not None:
        _say(f'--overwrite: the previous run is now in {store.set_aside}')
    if not store.resumed:
        return
    notes = '; '.join(store.recovery.notes())
    written = (f'{len(store.started_prompts)} of {total} prompts already written ({len(store.done)} leaves)'
               if store.branched else f'{len(store.done)} of {total} requests already written')
    _say(f'resuming {store.out_dir}: {written}' + (f' ({notes})' if notes else ''))
    short = short_trees(store.out_dir, store.done) if store.branched else []
    if short:
        _say(f'{len(short)} tree(s) on disk are short of their leaves and cannot be completed (their prompts are not '
             f'run again): ' + '; '.join(t.line() for t in short[:5]) + (' ...' if len(short) > 5 else ''))


def _agent_main(cfg: RunConfig, args: argparse.Namespace) -> int:
    """``mtflow run`` of a config with ``agent:``: an agent process per request against its own
    gateway session (``mtflow/gateway/agents.py``, ``docs/gateway.md``)."""
    from mtflow.gateway.agents import check_command, run_agents  # lazy: the HTTP server only for agent: runs

    for flag, given in (('--ray', args.ray is not None), ('--until', getattr(args, 'until', None) is not None),
                        ('--mode', getattr(args, 'mode', None) is not None), ('--otel', getattr(args, 'otel', None)),
                        ('--log', getattr(args, 'log', None))):
        if given:
            raise UserError(f'{flag} does not go with an agent: run (the agents drive the sessions)')
    total = count_requests(cfg.dataset, cfg.dataset_path(), cfg.limit, cfg.num_generations)
    check_command(cfg)  # a command that cannot start: one line, before the run directory and the model
    with StopSignals(message=None) as signals:
        try:
            store = open_store(cfg, args, run_fingerprint(cfg, dataset_file(cfg)))
        except KeyboardInterrupt:
            return _stop_code(signals)
        _announce(store, total, args.quiet)
        status, summary = run_agents(cfg, store, total, say=_say)
    if status == 'interrupted':
        if not args.quiet:
            _say(f'interrupted: {len(store.done)} of {total} episodes are written to {store.out_dir}; the agents '
                 'running were killed (their sessions in interrupted.jsonl); rerun with --resume to run them again')
        return _stop_code(signals)
    if not args.quiet and summary is not None:
        print_summary({'status': status, **summary}, store.out_dir)
    return _exit_code(summary or {}, cfg, store)


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    cfg.require_scheduler()
    if cfg.agent is not None:
        return _agent_main(cfg, args)
    if getattr(args, 'until', None) is not None:
        parse_until(args.until)  # a mistake is one line, before anything loads
        if args.ray is not None:
            raise UserError('--until streams in this process; it does not go with --ray')
    # every line (or a generated dataset's spec), then every problem of the scheduler (and its
    # plugins), checked before anything starts and before the slow backend load
    total = count_requests(cfg.dataset, cfg.dataset_path(), cfg.limit, cfg.num_generations)
    for warning in check_before_load(cfg):
        _say(f'warning: {warning}')
    total *= episode_size(cfg)  # an episode file: one request per role of each episode
    check_tracker(getattr(args, 'log', None))
    check_env_servers(cfg)  # one session on each OpenEnv url server, before the model loads
    make_scheduler = scheduler_factory(cfg)
    fingerprint = run_fingerprint(cfg, dataset_file(cfg))
    signals = StopSignals(message=None)
    with signals:
        try:
            store = open_store(cfg, args, fingerprint)
        except KeyboardInterrupt:  # the store released what it had opened
            return _stop_code(signals)
        _announce(store, total, args.quiet)
        attempt = _Attempt(cfg, args, store, signals, total)
        status, code = attempt.run(make_scheduler)
        if status == NOTHING_RAN:
            return code
        summary = attempt.close_store(status)
    if status == 'interrupted':
        if not args.quiet:
            _say(f'interrupted: {len(store.done)} of {total} requests are written to {store.out_dir}, '
                 f'{store.interrupted} in flight were kept in interrupted.jsonl; '
                 f'rerun the same command with --resume to continue')
        return code
    if not args.quiet:
        print_summary({'status': status, **summary}, store.out_dir)
        if status == 'partial':
            _say(f'--until {args.until}: stopped with {len(store.done)} of {total} requests written to '
                 f'{store.out_dir}; rerun with --resume to continue')
    return _exit_code(summary, cfg, store)


def _exit_code(summary: Dict[str, Any], cfg: RunConfig, store: Any) -> int:
    """1 when more requests failed than ``max_failed_share``, or (a branched run) a tree on disk is
    short of its leaves (said on the last line: what the exit status means), else 0; for a run
    and an agent: run alike."""
    short = summary.get('trees_short') or []
    if short:
        _say(f'{len(short)} tree(s) short of their leaves in {Path(store.out_dir) / "trees.jsonl"} '
             f'({", ".join(t["root"] for t in short[:5])}{" ..." if len(short) > 5 else ""}): exit status 1 (see '
             f'trees_short in {Path(store.out_dir) / "summary.json"}; --overwrite runs them again from their prompts)')
        return 1
    failed = too_many_failed(summary, cfg.max_failed_share)
    if failed is None:
        return 0
    _say(f'{failed}: exit status 1 (see {Path(store.out_dir) / "summary.json"}; --max-failed-share sets the share)')
    return 1
