"""The rollout loop of ``mtflow run``: batches of prompts through the executor, every finished
request streamed into a :class:`mtflow.run.store.RunStore` the moment it finishes.

The prompts come from an iterator and each batch is dropped once it is done, so the run holds
only the batch in flight (and the store's counters), whatever the dataset's size. Requests the
store already has (an earlier attempt wrote them) are skipped, so ``--resume`` never runs or
writes a uuid twice. A ``KeyboardInterrupt`` (Ctrl-C, or SIGTERM through
:class:`mtflow.run.signals.StopSignals`) reaches the executor, which finishes the requests in
flight with reason ``interrupted``; they go to ``interrupted.jsonl`` and the interrupt goes on
to the caller, which closes the store. A branched batch's leaves are written tree by tree, each
tree whole with its line of ``trees.jsonl``, when the batch ends (``mtflow/run/trees.py``).

A write never fails silently: a request whose line the store could not take (its uuid is
written already, a value JSON cannot hold) fails the run naming it, after its batch (or its
stream group) and what finished beside it are written; a group that could not be written for want
of room keeps its lines and is tried once more there, and the run fails if that fails too
(:meth:`StreamingRun.check_writes`).
"""
from __future__ import annotations

import inspect
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from mtflow.accounting.token_record import record_accounting
from mtflow.backends.base import reports_of
from mtflow.core.calls import wrapped_methods
from mtflow.core.errors import RolloutInterrupted
from mtflow.core.machine import INTERRUPTED
from mtflow.data.sources import iter_requests
from mtflow.run.images import store_request_images
from mtflow.engine.admission import sessions_per_prompt
from mtflow.engine.branching import Branching
from mtflow.engine.context import is_summary_request
from mtflow.engine.executor import Executor
from mtflow.run.progress import RunProgress
from mtflow.run.config import RunConfig
from mtflow.run.store import RunDirError, RunStore, WriteRefused, finished_to_record
from mtflow.run.streamed import run_streaming
from mtflow.run.trajectories import reference_field
from mtflow.run.trees import whole_trees
from mtflow.run.turn_log import TURNS_KEY, TurnLog
from mtflow.roles.role import seat_of
from mtflow.run.episodes import as_episodes, episode_file, episode_run_roles
from mtflow.run.signals import deferred_interrupts
from mtflow.run.serving import annotate as annotate_serving, begin_server_metrics, end_server_metrics

__all__ = ['StreamingRun', 'roll_out']


class _TurnCounter:
    """Wraps ``rollout_fn``: each lockstep call over live requests is one turn of a batch (the
    executor's empty call that keeps ranks in step is not, nor a compaction's summary call).
    Between turns it lets the store flush a group that has waited too long; before and after each
    it moves the progress."""

    def __init__(self, rollout_fn: Any, tick: Callable[[], None], on_turn: Optional[Callable[[int, int], None]],
                 on_call: Optional[Callable[[], None]] = None) -> None:
        self.rollout_fn = rollout_fn
        self.tick = tick  # the store's flush of a group that waited long enough (never raising here)
        self.on_turn = on_turn
        self.on_call = on_call
        self.turn = 0

    def fork(self, parent: str, children: List[str]) -> None:
        """A request was forked (``docs/branching.md``): the backend is told (the replay backend
        goes on with the children from the parent's turn)."""
        for tell in wrapped_methods(self.rollout_fn, 'fork'):
            tell(parent, children)

    def __call__(self, requests: List[Any], request_config: Any) -> Any:
        self.tick()
        live = sum(1 for r in requests if not is_summary_request(r))
        if live and self.on_call is not None:
            self.on_call()
        outputs = self.rollout_fn(requests, request_config)
        if live:
            self.turn += 1
            if self.on_turn is not None:
                self.on_turn(self.turn, live)
        return outputs


class StreamingRun:
    """Runs prompts in batches of ``batch_size`` and streams each finished request to ``store``.

    Args:
        make_executor: ``make_executor(rollout_fn, on_finished) -> Executor`` (the caller owns the
            executor's settings; this class owns the streaming).
        rollout_fn: the backend.
        store: an open run store.
        batch_size: requests per ``Executor.run``.
        on_progress: ``on_progress(finished_this_attempt, description)``, or ``None``.
        reference_key: the ``data_dict`` key of the reference answer (the scheduler's answer
            field), for the trajectory lines' ``reference``.
        progress: a :class:`~mtflow.run.progress.RunProgress` fed every turn and finished request.
    """

    def __init__(self, make_executor: Callable[[Any, Callable[[Any], None]], Any], rollout_fn: Any, store: RunStore,
                 batch_size: int, on_progress: Optional[Callable[[int, str], None]] = None,
                 reference_key: Optional[str] = None, progress: Optional[RunProgress] = None,
                 on_request: Optional[Callable[[Dict[str, Any], List[Dict[str, Any]]], None]] = None,
                 episode_size: Optional[int] = None) -> None:
        self.store = store
        #: an episode run's roles per episode: each episode's lines are written together
        self.episode_size = episode_size
        self._episodes: Dict[str, List[Tuple[Any, int, Any, float, Any, bool]]] = {}
        self.on_request = on_request  # e.g. the OpenTelemetry exporter (mtflow/run/otel.py)
        self.reference_key = reference_key
        self.progress = progress
        self.batch_size = batch_size
        self.on_progress = on_progress
        self.counter = _TurnCounter(rollout_fn, self.tick, self._on_turn, progress.on_call if progress else None)
        self.executor = make_executor(self.counter, self.on_finished)
        #: the model calls' outputs per request (the ``turns`` of each line, what replay serves)
        self.turn_log: Optional[TurnLog] = getattr(make_executor, 'turn_log', None)
        self.rollout_fn_calls = 0
        self.finished = 0  # requests finished in this attempt (written or interrupted)
        self.skipped = 0  # prompts already written by an earlier attempt
        self.batches = 0
        self.wall_s = 0.0
        #: the first group write that failed for want of room (its lines are kept): tried again
        #: by :meth:`check_writes`
        self.write_error: Optional[RunDirError] = None
        #: ``(uuid, error)`` of each finished request whose line could not be written at all
        self.lost: List[Tuple[str, BaseException]] = []
        #: a streamed run (``mtflow/run/streamed.py``) stopped by its ``until`` before the dataset's end
        self.until_met = False
        self._indices: List[int] = []
        self._requests: List[Any] = []
        self._live: List[Any] = []
        self._t_offset = 0.0
        #: a branched run's finished leaves, held until their trees are known (the batch's end)
        self.branched = getattr(getattr(self.executor, 'options', None), 'branch', None) is not None
        self._held: List[Any] = []

    # ---- the executor's callbacks ------------------------------------------------------------
    def on_finished(self, finished: Any) -> None:
        if self.branched:  # written with its tree (write_trees)
            self._held.append(finished)
            return
        self._write_own(finished)

    def _write_own(self, finished: Any, whole: bool = True) -> None:
        root = finished.root_index if finished.root_index is not None else finished.index  # a fork's child: its root's
        self.write_finished(finished, self._indices[root], self._requests[root], self._t_offset, whole=whole)

    def write_trees(self, trees: List[Dict[str, Any]]) -> None:
        """The held leaves of a branched batch, tree by tree: a whole tree's leaves, then its line;
        a tree some leaf of which did not finish (an interrupt) to ``interrupted.jsonl``, whole. A
        first signal meanwhile waits until all of it is taken."""
        with deferred_interrupts():
            self._write_trees(trees)

    def _write_trees(self, trees: List[Dict[str, Any]]) -> None:
        held: Dict[str, Any] = {}
        twice = []  # a second request under a uuid already held: written too, so the store refuses it loudly
        for f in self._held:
            if str(f.uuid) in held:
                twice.append(f)
            else:
                held[str(f.uuid)] = f
        self._held = []
        whole, cut = whole_trees(trees, {u for u, f in held.items() if f.finish_reason != INTERRUPTED})
        for tree in trees:
            for leaf in tree['leaves']:
                finished = held.pop(str(leaf), None)
                if finished is not None:
                    self._write_own(finished, whole=str(leaf) not in cut)
        for finished in list(held.values()) + twice:  # no tree's (a duplicate uuid, failed before it was planted)
            self._write_own(finished)
        self.store.write_trees(self.written_trees(whole))

    def written_trees(self, trees: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """``trees`` less those with a leaf whose line could not be written (:attr:`lost`): a tree
        line names only leaves on disk."""
        lost = {uuid for uuid, _ in self.lost}
        return [tree for tree in trees if not lost.intersection(str(u) for u in tree['leaves'])]

    def write_finished(self, finished: Any, index: int, request: Any, t_offset: float, live: Any = None,
                       whole: bool = True) -> None:
        """Write one finished request (its dataset position ``index``, its input ``request``;
        ``live``: the request as it finished, with the images its steps added; default: this
        batch's copy, which the executor wrote back). ``whole=False``: a leaf of a tree an
        interrupt cut, kept in ``interrupted.jsonl`` (not done: its prompt runs again). A role of
        an episode waits for the other roles of its episode: their lines are written together
        (``docs/multi-agent.md``), or, when an interrupt cut one of them, all to ``interrupted.jsonl``."""
        live = live if live is not None else self._live[finished.index]
        seat = seat_of(request) if self.episode_size else None
        if seat is None:
            self._write([(finished, index, request, t_offset, live, whole)])
            return
        held = self._episodes.setdefault(seat.episode, [])
        held.append((finished, index, request, t_offset, live, whole))
        if len(held) >= self.episode_size:
            del self._episodes[seat.episode]
            if any(item[0].finish_reason == INTERRUPTED or not item[5] for item in held):
                held = [item[:5] + (False, ) for item in held]  # cut: the episode runs again whole on resume
            self._write(held)

    def _write(self, items: List[Tuple[Any, int, Any, float, Any, bool]]) -> None:
        """Write finished requests in one group of the run directory (an episode's roles are never
        split by a crash), the interrupted ones (and a cut tree's leaves) to ``interrupted.jsonl``."""
        written = []
        for finished, index, request, t_offset, live, whole in items:
            record, events = finished_to_record(finished, index=index, t_offset=t_offset, request=request,
                                                reference_key=self.reference_key)
            if self.turn_log is not None:
                record[TURNS_KEY] = self.turn_log.finish(record['uuid'], record)
            annotate_serving(self.counter.rollout_fn, record['uuid'], events)  # the backend's replicas
            self.finished += 1
            written.append((finished, record, events, live, finished.finish_reason != INTERRUPTED and whole))
        try:
            together = []
            for finished, record, events, live, done in written:
                store_request_images(self.store, live, record)
                if done:
                    together.append((record, events))
                else:
                    self.store.write_interrupted(record, events)
            self.store.write_together(together)
        except RunDirError as exc:
            if isinstance(exc, WriteRefused):  # the lines are nowhere: the run fails naming them (check_writes)
                self.lost.extend((str(record['uuid']), exc) for _, record, *_ in written)
            else:  # e.g. a full disk: its lines are kept, tried again after the batch
                self.write_error = self.write_error or exc
        except Exception as exc:  # a value JSON cannot hold, an image that cannot be stored: lost too
            self.lost.extend((str(record['uuid']), exc) for _, record, *_ in written)
        for finished, record, events, _, done in written:
            if self.on_request is not None:
                self.on_request(record, events)
            if self.progress is not None:
                self.progress.on_finished(record.get('num_turns'), sum(int(e.get('tokens') or 0) for e in events),
                                          written=done, uuid=record['uuid'])
            if self.on_progress is not None:
                self.on_progress(self.finished, '')

    def tick(self) -> None:
        """Write the pending group if it waited long enough; a failure is kept for
        :meth:`check_writes` (raised here, between turns, it would fail the requests of the
        model call in flight instead)."""
        try:
            self.store.tick()
        except RunDirError as exc:  # its lines are kept
            self.write_error = self.write_error or exc

    def check_lost(self) -> None:
        """Fail the run when a finished request could not be written, naming the first."""
        if not self.lost:
            return
        uuid, exc = self.lost[0]
        detail = str(exc) if isinstance(exc, RunDirError) else f'{type(exc).__name__}: {exc}'
        more = f' ({len(self.lost)} requests could not be)' if len(self.lost) > 1 else ''
        raise RunDirError(f'request {uuid} could not be written{more}: {detail}; the requests written before are whole')

    def check_writes(self) -> None:
        """After a batch or a stream group: :meth:`check_lost`, then one more try of a group a full
        disk held back (raises when it fails again: the run stops, ``--resume`` continues)."""
        self.check_lost()
        if self.write_error is not None:
            self.store.flush()
            self.write_error = None

    def _on_turn(self, turn: int, live: int) -> None:
        if self.progress is not None:
            self.progress.on_turn(live)
        if self.on_progress is not None:
            self.on_progress(self.finished, f'turn {turn}, {live} live')

    # ---- the loop ------------------------------------------------------------------------------
    def run(self, prompts: Iterable[Any], stream: Optional[Tuple[Any, Any, int]] = None) -> Dict[str, Any]:
        """Roll out every prompt the store does not have yet; return this attempt's figures.
        A ``KeyboardInterrupt`` propagates (after the batch in flight was finished as
        interrupted); so does a :class:`RunDirError` from writing. ``stream``:
        ``(executor, until, max_concurrency)``: through the streaming producer instead of batches."""
        t0 = time.perf_counter()
        try:
            if stream is not None:
                run_streaming(self, stream[0], prompts, stream[1], stream[2])
                return self.figures()
            batch: List[Tuple[int, Any]] = []
            for index, item in enumerate(prompts):
                members = item if isinstance(item, list) else [item]  # an episode's roles: one batch
                if self.store.prompt_done(members[0].uuid):  # an episode's roles are written together
                    self.skipped += len(members)
                    continue
                batch += [(index, request) for request in members]
                if len(batch) >= self.batch_size:
                    self._run_batch(batch)
                    batch = []
            if batch:
                self._run_batch(batch)
        finally:
            self.wall_s += time.perf_counter() - t0
        return self.figures()

    def _run_batch(self, batch: List[Tuple[int, Any]]) -> None:
        self._indices = [i for i, _ in batch]
        self._requests = [r for _, r in batch]
        #: the list the executor runs: its entries become each request's latest (its images included)
        self._live = list(self._requests)
        self.counter.turn = 0
        self.batches += 1
        if self.progress is not None:
            self.progress.on_batch(len(batch))
        self._t_offset = time.time() - self.store.started_unix  # trace times count from the run's start
        try:
            result = self.executor.run(self._live)
        except RolloutInterrupted as exc:
            if exc.result is not None:
                self.rollout_fn_calls += exc.result.rollout_fn_calls
                if self.branched:
                    self.write_trees(exc.result.trees)
            self.check_lost()  # a line lost is said even when a signal stopped the run
            raise
        self.rollout_fn_calls += result.rollout_fn_calls
        self.write_trees(result.trees)
        self.check_writes()
        failed = [f for f in result.failures if f.phase == 'on_finished']
        if failed:  # the executor kept going; a request that could not be stored must not pass silently
            raise RunDirError(f'request {failed[0].uuid} could not be written ({len(failed)} in this batch): '
                              f'{type(failed[0].error).__name__}: {failed[0].error}')

    def figures(self) -> Dict[str, Any]:
        extra = {'until_met': True} if self.until_met else {}
        return {**extra, 'rollout_fn_calls': self.rollout_fn_calls, 'wall_s': round(self.wall_s, 3),
                'batches': self.batches,
                'skipped': self.skipped, 'finished': self.finished, 'flushes': self.store.flushes,
                'write_s': round(self.store.fsync_s, 4)}


class _ExecutorFactory:
    """``make_executor`` of :class:`StreamingRun` for a run config: lockstep, or async with the
    backend's async ``rollout_fn`` (its own concurrent path, or a dynamic batcher over its batch
    calls, ``docs/backends.md``). Either way the ids and masks come from the exact token record,
    and a failing request is recorded while the others go on (``on_error='return'``)."""

    def __init__(self, cfg: RunConfig, scheduler: Any, backend: Any, image_store: Any = None) -> None:
        self.cfg, self.scheduler, self.backend = cfg, scheduler, backend
        #: each image a step adds goes to the run directory as the step returns (mtflow.run.images)
        self.image_store = image_store
        self.request_config = cfg.make_request_config()
        self.closing: List[Callable[[], None]] = []  # a batcher's threads, stopped when the run ends
        #: the run's admission control (``admission:``), one for every batch and the stream
        self.admission = cfg.admission.make() if cfg.admission is not None else None
        self.turn_log = TurnLog()

    def __call__(self, rollout_fn: Any, on_finished: Callable[[Any], None]) -> Executor:
        options = dict(self._options(), on_finished=on_finished)
        if self.cfg.mode != 'async':  # one process: the contract's last empty rollout_fn call is waste
            return Executor(self.scheduler, self.turn_log.wrap(rollout_fn), self.request_config, skip_empty_calls=True,
                            **options)
        # the async driver has no turns to count, so it gets the backend itself, not the counter
        return Executor(self.scheduler, self.turn_log.wrap(self.async_rollout_fn()), self.request_config,
                        mode='async', max_concurrency=self.cfg.max_concurrency, **options)

    def _options(self) -> Dict[str, Any]:
        """The Executor options every executor of the run shares (batches and the stream)."""
        return dict(max_turns=self.cfg.max_turns or None, on_error='return',
                    accounting=record_accounting(self.scheduler), image_store=self.image_store,
                    **self._context(), **self._admission())

    def async_rollout_fn(self) -> Any:
        """The backend's async ``rollout_fn`` (``async_rollout_fn()``: its own concurrent path, or
        a dynamic batcher over its batch calls), else the backend itself; one with a ``close``
        (a batcher's threads) is closed when the run ends (:meth:`close`)."""
        make = getattr(self.backend, 'async_rollout_fn', None)  # a Backend's, or a user's own class's
        fn = make() if callable(make) else self.backend
        close = getattr(fn, 'close', None) if fn is not self.backend else None  # a batcher's threads
        if callable(close):
            self.closing.append(close)
        return fn

    def _context(self) -> Dict[str, Any]:
        """The run config's context budget as an Executor option (the backend counts the prompt
        tokens and knows its context length), for batches and streams alike."""
        budget = self.cfg.context_budget(self.backend)
        return {} if budget is None else {'context': budget}

    def _admission(self) -> Dict[str, Any]:
        return {} if self.admission is None else {'admission': self.admission}

    def batch_size(self) -> int:
        """``batch_size``, or fewer in lockstep when ``admission.env_sessions`` is smaller (the
        batch holds its sessions together, a branched prompt its tree's; the next batch waits for
        it)."""
        size = self.cfg.batch_size
        bound = self.admission.session_bound(self.scheduler) if self.admission is not None else None
        if bound is None or self.cfg.mode == 'async':
            return size
        branch = getattr(self.scheduler, 'branch', None)  # the executor forks only with a Branching
        return max(1, min(size, bound // sessions_per_prompt(bound, branch if isinstance(branch, Branching) else None)))

    def stream_executor(self) -> Executor:
        """The executor of a streamed run (``mtflow/run/streamed.py``): the backend's async
        ``rollout_fn`` when it has one, the requests written from the delivered groups."""
        return Executor(self.scheduler, self.turn_log.wrap(self.async_rollout_fn()), self.request_config,
                        **self._options())

    def close(self, wait: bool = True) -> None:
        """Close what the run opened (a batcher's threads); ``wait=False`` after an interrupt: a
        batch call that hangs is left to its daemon thread."""
        for close in self.closing:
            if 'wait' in _parameters(close):
                close(wait=wait)
            else:
                close()


def _parameters(fn: Callable[..., Any]) -> Dict[str, Any]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def _tokens_counter(backend: Any) -> Optional[Callable[[], Optional[int]]]:
    """Tokens this attempt's backend generated so far (its ``stats``), or ``None`` (then the
    progress counts the finished requests' tokens)."""
    stats = reports_of(backend).stats
    if stats is None or not isinstance(stats.completion_tokens, int):
        return None
    start = stats.completion_tokens
    return lambda: stats.completion_tokens - start


def roll_out(cfg: RunConfig, scheduler: Any, backend: Any, store: RunStore, total: int, show: Any,
             figures: Dict[str, Any], progress_interval_s: float = 10.0, tracker: Any = None,
             on_request: Optional[Callable[[Dict[str, Any], List[Dict[str, Any]]], None]] = None,
             until: Any = None) -> None:
    """Stream every prompt of ``cfg`` that ``store`` does not have through the executor, in this
    process; this attempt's figures go into ``figures``, also when a signal stops it. ``show``
    is a progress mode (``bar``, ``log``, ``off``) or a bool (``mtflow/run/progress.py``);
    ``tracker`` (``mtflow/run/tracking.py``) gets the progress figures as they change. A backend
    with ``forget(uuid)`` (the replay backend) is told when each request is finished."""
    make_executor = _ExecutorFactory(cfg, scheduler, backend, image_store=store.images.put_ref)
    reports = reports_of(backend)
    make_executor.turn_log.on_finish = reports.forget
    make_executor.turn_log.known_digest = reports.known_digest
    roles = episode_run_roles(cfg) if episode_file(cfg) is not None else None  # docs/multi-agent.md
    mode = show if isinstance(show, str) else ('bar' if show else 'off')
    lockstep = cfg.mode != 'async' and until is None
    leaves = getattr(getattr(scheduler, 'branch', None), 'leaves', None)  # every tree ends with exactly these
    total = total * leaves if isinstance(leaves, int) and leaves > 1 else total
    progress = RunProgress(mode, total - len(store.done), max_turns=cfg.max_turns or None,
                           interval_s=progress_interval_s, tokens=_tokens_counter(backend),
                           listener=tracker.log if tracker is not None else None, lockstep=lockstep,
                           batch_size=make_executor.batch_size())
    progress.leaves_counted = isinstance(leaves, int) and leaves > 1
    if progress.enabled:
        make_executor.turn_log.on_fork = progress.on_fork
    if not lockstep and progress.enabled:  # no batches: each request's model call is its turn
        make_executor.turn_log.on_turn = lambda r: is_summary_request(r) or progress.on_request_turn(str(r.uuid))
    run = StreamingRun(make_executor, backend, store, make_executor.batch_size(), reference_key=reference_field(scheduler),
                       progress=progress if progress.enabled else None, on_request=on_request,
                       episode_size=len(roles) if roles else None)
    begin_server_metrics(backend)  # the servers' /metrics counters, read again for the summary
    progress.start()
    interrupted = False
    try:
        # checked in full before the run (count_requests); the store refuses a uuid written twice
        prompts = iter_requests(cfg.dataset, cfg.dataset_path(), cfg.limit, cfg.num_generations, check_unique=False)
        if roles:
            prompts = as_episodes(prompts, roles)
        streamed = None
        if cfg.mode == 'async' or until is not None:  # the streaming producer: no batch boundaries
            streamed = (make_executor.stream_executor(), until, cfg.max_concurrency or cfg.batch_size)
        run.run(prompts, streamed)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        make_executor.close(wait=not interrupted)
        progress.stop()
        end_server_metrics(backend)
        figures.update(run.figures())
        if make_executor.admission is not None:
            figures['admission'] = make_executor.admission.summary()
