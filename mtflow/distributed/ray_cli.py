"""``mtflow run CONFIG --ray N``: the run of ``mtflow/commands/run.py`` with the rollout fanned out
over N Ray actors (:func:`mtflow.distributed.ray_run`).

Everything around the rollout is the local run's: the config and its overrides, the run
directory (``mtflow/run/store.py``: ``--resume``, ``--overwrite``, whole lines, grouped fsync),
the progress bar, the summary. What changes: the backend and the scheduler are built inside
each actor from the same config, by the same code (``mtflow/run/assembly.py``; each actor loads
its own model), and the driver writes every
trajectory the moment an actor streams it back (a branched run's leaves tree by tree, each tree's
line after them: ``mtflow/run/trees.py``), with its images (each stored once in
``<run>/images``, before the line that names it, as a local run stores them). The uuids already in the directory are never
sent to an actor, and a uuid that arrives twice (an actor died after sending it) is written once.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import time
from types import SimpleNamespace
from typing import Any, Dict, Optional

from mtflow.accounting.token_record import record_accounting
from mtflow.core.errors import RunSetupError, UserError
from mtflow.core.machine import INTERRUPTED
from mtflow.data.sources import iter_requests
from mtflow.distributed.ray_fanout import RayRecord, RayRunError, RayRunResult, WorkerSpec, ray_run
from mtflow.backends.base import Reports
from mtflow.run.assembly import actor_setup, backend_from_config, leaf_budget, scheduler_from_config
from mtflow.run.progress import ProgressBar
from mtflow.run.config import RunConfig
from mtflow.run.serving import merged_serving
from mtflow.run.store import RunDirError, RunStore

__all__ = ['RayRollout', 'actor_setup', 'backend_from_config', 'scheduler_from_config']


class _FanOutBackend(Reports):
    """Stands in for the backend in the summary: the actors hold the real ones, this reports
    their figures summed."""

    def __init__(self, cfg: RunConfig, actors: int) -> None:
        self.cfg, self.actors = cfg, actors
        self.name: Optional[str] = None
        self.stats: Optional[SimpleNamespace] = None  # type: ignore[assignment]
        self.load_info: Dict[str, Any] = {}
        self.merged_serving: Optional[Dict[str, Any]] = None  # the actors' router figures, merged

    def describe(self) -> str:
        return f'{self.name or self.cfg.backend} on {self.actors} Ray actor(s)'

    def serving_summary(self) -> Optional[Dict[str, Any]]:
        return self.merged_serving


class RayRollout:
    """One attempt of a run directory on Ray. ``backend`` is the summary's stand-in from the start
    (so an interrupted run still gets a summary); :meth:`run` fills in the attempt's figures."""

    def __init__(self, cfg: RunConfig, args: argparse.Namespace, store: RunStore, total: int, show: Any) -> None:
        if args.ray < 1:
            raise RunSetupError(f'--ray needs a number of actors >= 1, not {args.ray}')
        if importlib.util.find_spec('ray') is None:
            raise RunSetupError("--ray needs the 'ray' package: pip install 'mtflow[ray]'")
        self.cfg, self.args, self.store, self.total, self.show = cfg, args, store, total, show
        self.backend = _FanOutBackend(cfg, args.ray)
        self.load_s = 0.0
        self.result: Optional[RayRunResult] = None

    def spec(self) -> WorkerSpec:
        cfg = self.cfg
        return WorkerSpec(make_backend=functools.partial(backend_from_config, cfg),
                          make_scheduler=functools.partial(scheduler_from_config, cfg),
                          request_config=cfg.make_request_config(), max_turns=cfg.max_turns or None,
                          setup=functools.partial(actor_setup, os.getcwd(), cfg.seed),
                          make_accounting=record_accounting)  # as a local mtflow run: ids from the token record

    def run(self, figures: Dict[str, Any]) -> None:
        """Roll out what the store does not have; ``figures`` gets this attempt's figures, also
        when a signal stops it."""
        store, cfg = self.store, self.cfg
        leaves = leaf_budget(cfg)  # a branched run's progress counts leaves, as its lines do
        progress = ProgressBar(self.show, self.total * (leaves or 1) - len(store.done), 'starting Ray')
        write_error: Dict[str, RunDirError] = {}

        def sink(rec: RayRecord) -> None:
            try:
                if rec.images:  # stored (fsynced) before the line that names them, as a local run does
                    rec.trajectory['images'] = store.images.put_shipped(rec.images, f'ray actor {rec.actor}')
                if rec.finish_reason == INTERRUPTED:
                    store.write_interrupted(rec.trajectory, rec.events)
                    return
                store.write(rec.trajectory, rec.events)
            except RunDirError as exc:  # a full disk: stop the fan-out, keep what is on disk
                write_error['error'] = exc
                raise
            store.tick()

        def on_duplicate(rec: RayRecord) -> None:  # no line, but its actor counts its images shipped
            store.images.put_shipped(rec.images, f'ray actor {rec.actor}')

        def on_progress(delivered: int, description: str) -> None:
            progress.update(store.written, description)  # what is written, not what came back interrupted
            store.tick()

        started = time.perf_counter()
        self.result = RayRunResult()
        progress.start()
        try:
            prompts = iter_requests(cfg.dataset, cfg.dataset_path(), cfg.limit, cfg.num_generations,
                                    check_unique=False)  # checked in full by count_requests
            ray_run(prompts, self.spec(), num_actors=self.args.ray, sink=sink, on_duplicate=on_duplicate,
                    on_tree=lambda tree: store.write_trees([tree]),  # a branched prompt's, after its leaves
                    batch_size=cfg.batch_size, skip=store.done | store.started_prompts, address=self.args.ray_address,
                    on_progress=on_progress,
                    result=self.result, init_options={'logging_level': 'error'} if self.args.quiet else None)
            progress.update(self.result.delivered, '')
        except RayRunError as exc:
            raise UserError(str(exc)) from None
        finally:
            progress.stop()
            figures.update(self.figures(time.perf_counter() - started))
        if write_error:
            raise write_error['error']

    def figures(self, wall_s: float) -> Dict[str, Any]:
        """This attempt's figures for ``run.json``; the summary's stand-in backend gets the
        actors' description and generation figures."""
        result = self.result
        store = self.store
        figures: Dict[str, Any] = {'wall_s': round(wall_s, 3), 'flushes': store.flushes,
                                   'write_s': round(store.fsync_s, 4)}
        if result is None:
            return figures
        self.backend.name = result.backend
        stats = result.backend_stats
        if stats:
            self.backend.stats = SimpleNamespace(completion_tokens=int(stats.get('completion_tokens', 0)),
                                                 generate_s=stats.get('generate_s'))
        self.backend.merged_serving = merged_serving(result.serving)
        self.load_s = max(result.actor_load_s, default=0.0)
        figures.update({'rollout_fn_calls': result.rollout_fn_calls, 'batches': result.shards,
                        'skipped': result.skipped, 'finished': result.delivered,
                        'ray': {'actors': self.args.ray, 'address': self.args.ray_address,
                                'deaths': result.actor_deaths, 'restarts': result.restarts, 'retried': result.retried,
                                'duplicates_dropped': result.duplicates_dropped, 'given_up': result.given_up,
                                'per_actor': {str(k): v for k, v in sorted(result.per_actor.items())},
                                'actor_load_s': result.actor_load_s}})
        return figures
