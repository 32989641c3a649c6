"""Fan one rollout out over Ray actors: each actor holds its own backend and executor, the driver
hands out shards of the dataset and receives every finished request as it finishes.

::

    from mtflow.distributed import ray_run, WorkerSpec

    spec = WorkerSpec(make_backend=lambda: ScriptedBackend('script.jsonl'),
                      make_scheduler=lambda tokenizer: MyScheduler(), max_turns=6)
    result = ray_run(requests, spec, num_actors=4, sink=lambda rec: print(rec.uuid))

How it keeps every trajectory exactly once:

* the dataset is cut into shards of ``batch_size`` requests (one ``Executor.run`` each); idle
  actors take the next shard, so a slow actor never holds up the others' work;
* an actor method is a Ray streaming generator: each request is yielded the moment the executor
  finishes it (``Executor(on_finished=...)``), so the driver has it (and the sink writes it) while
  the rest of the shard is still running;
* the driver keeps the set of uuids it has passed to the sink (seeded with ``skip``: what an
  earlier attempt already wrote). When an actor dies (killed, OOM, node lost), the requests of its
  shard that did not reach the driver go back to the front of the queue, a fresh actor replaces
  it (up to ``max_restarts``), and anything that arrives twice is dropped, never written twice;
* a request that was in flight on ``max_attempts`` actors that died is given up: the sink gets an
  ``error`` record for it (phase ``ray_actor``), so it is reported, not silently lost.

A branched run (``docs/branching.md``: the scheduler's ``branch``) is streamed by whole trees: the
actor holds a prompt's leaves until the executor's run of the shard ends, then yields each tree
with all its leaves (``('tree', {'tree': ..., 'records': [...]})``); the driver passes the leaves to
the sink and then the tree to ``on_tree``. A prompt is delivered when its tree is, so an actor that
dies mid-tree has the whole prompt run again on another actor, never a tree mixed from two runs.

Images (``docs/multimodal.md``): an actor stores each image a step adds in a content-addressed
folder of its own (a temporary directory, removed when it closes), as ``mtflow run`` does in the
run directory, so its requests in flight hold paths, not pixels; a finished request's record
carries its images' encoded bytes (:attr:`RayRecord.images`, placeholder order; an image the
actor shipped before goes by its file name), which the driver's sink stores (``mtflow run
--ray``: ``<run>/images``, the names a local run gives).

Ray is imported when :func:`ray_run` is called. A cluster is joined with ``address=`` (or when
Ray is already initialised); otherwise a local one is started on 127.0.0.1 and shut down at the
end. The actor side (:class:`ShardWorker`) is plain Python, usable (and tested) without Ray.
"""
from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

from mtflow.core.errors import MtflowError
from mtflow.roles.role import seat_of
from mtflow.backends.base import reports_of
from mtflow.engine.branching import branch_root
from mtflow.engine.executor import Executor
from mtflow.run.assembly import tokenizer_of
from mtflow.run.images import ImageStore, ShippedName
from mtflow.run.serving import annotate as annotate_serving, serving_figures
from mtflow.run.signals import deferred_interrupts
from mtflow.run.trajectories import finished_to_record, reference_field
from mtflow.run.turn_log import TURNS_KEY, TurnLog

__all__ = ['WorkerSpec', 'ShardWorker', 'RayRecord', 'RayRunResult', 'RayRunError', 'ray_run',
           'sweep_orphan_image_dirs']

#: an actor's image folder in the node's temp dir: ``<prefix><slot>-pid<actor pid>-<random>``
IMAGE_DIR_PREFIX = 'mtflow-ray-images-'
_IMAGE_DIR_PID = re.compile(re.escape(IMAGE_DIR_PREFIX) + r'\d+-pid(\d+)-')


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_orphan_image_dirs(root: Optional[Path] = None) -> List[Path]:
    """Remove the image folders of actors that died without cleaning up (a killed actor never
    reaches its ``close``): a folder whose actor pid no longer runs. Each new actor sweeps its
    node's temp dir once, so a crashed run's images do not pile up. Returns what it removed."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(IMAGE_DIR_PREFIX + '*'):
        match = _IMAGE_DIR_PID.match(folder.name)
        if match and folder.is_dir() and not _alive(int(match.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed

#: how long the driver waits for the live actors to close their schedulers and backends at the end
CLOSE_TIMEOUT_S = 10.0


class RayRunError(MtflowError):
    """The fan-out cannot go on (an actor cannot start, every actor is gone); what was finished
    has reached the sink."""


@dataclass
class WorkerSpec:
    """What each actor builds for itself (shipped with cloudpickle, so closures and lambdas work).

    ``make_backend()`` returns the ``rollout_fn`` (each actor loads its own model; several actors
    may point at the same OpenAI-compatible servers); ``make_scheduler(tokenizer)`` gets the
    backend's ``tokenizer`` attribute (or ``None``)."""
    make_backend: Callable[[], Any]
    make_scheduler: Callable[[Any], Any]
    request_config: Any = None
    max_turns: Optional[int] = None
    executor_options: Dict[str, Any] = field(default_factory=dict)  # e.g. step_timeout_s
    setup: Optional[Callable[[], None]] = None  # run first in the actor (seeding, logging)
    make_accounting: Optional[Callable[[Any], Any]] = None  # scheduler -> accounting (default: the executor's)
    #: ``prepare(backend, scheduler)`` once both are built, before the actor's first turn: what they must
    #: agree on and the checks of a local run (``mtflow run``'s); what it raises fails the run in one line
    prepare: Optional[Callable[[Any, Any], Any]] = None


@dataclass
class RayRecord:
    """One finished request as the driver receives it: plain data (what
    :func:`mtflow.run.trajectories.finished_to_record` makes), plus where it ran."""
    index: int  # position in the dataset
    uuid: str
    finish_reason: str
    trajectory: Dict[str, Any]  # the trajectories.jsonl line (index = dataset position, rank = actor slot)
    events: List[Dict[str, Any]]  # its trace events (trace.jsonl lines)
    actor: int  # the actor slot that ran it
    attempt: int = 1  # 1 + how many actors died with this request in flight
    failure: Optional[Dict[str, Any]] = None
    #: the request's images, encoded (PNG, or a tool's own JPEG...), in placeholder order, or the
    #: ``ShippedName`` of one the actor shipped before: the sink stores them
    #: (``ImageStore.put_shipped``) and names them in ``trajectory['images']``
    images: List[Any] = field(default_factory=list)


@dataclass
class RayRunResult:
    """What :func:`ray_run` did."""
    requests: int = 0  # requests handed to the run (after skip)
    delivered: int = 0  # records passed to the sink
    skipped: int = 0  # already done (``skip``)
    finish_reasons: Dict[str, int] = field(default_factory=dict)
    actor_deaths: int = 0
    restarts: int = 0
    retried: int = 0  # requests requeued after an actor died with them in flight
    duplicates_dropped: int = 0
    given_up: int = 0  # requests in flight on max_attempts dead actors (error records)
    shards: int = 0
    rollout_fn_calls: int = 0
    wall_s: float = 0.0
    per_actor: Dict[int, int] = field(default_factory=dict)  # slot -> records delivered
    backend: Optional[str] = None  # the first actor's backend description
    backend_stats: Dict[str, float] = field(default_factory=dict)  # summed over actors that reported
    #: each reporting actor's router figures (a backend with several servers: ``serving_summary``)
    serving: List[Dict[str, Any]] = field(default_factory=list)
    actor_load_s: List[float] = field(default_factory=list)


# ---- the actor side (plain Python) ------------------------------------------------------------
class ShardWorker:
    """One actor's state: its backend, scheduler and executor; :meth:`run_shard` yields the
    requests of a shard as they finish, then ``('done', figures)``."""

    def __init__(self, spec: WorkerSpec, slot: int) -> None:
        t0 = time.perf_counter()
        if spec.setup is not None:
            spec.setup()
        self.slot = slot
        self.spec = spec
        self.backend = spec.make_backend()
        self.scheduler = spec.make_scheduler(tokenizer_of(self.backend))
        if spec.prepare is not None:
            spec.prepare(self.backend, self.scheduler)
        #: each model call's output per request: the lines' ``turns``, what ``mtflow replay`` serves
        self.turn_log = TurnLog()
        #: the images the steps add, stored as they return (made on the first image; removed on close)
        self._images: Optional[ImageStore] = None
        self._shipped: Set[str] = set()  # the images this actor has sent the driver (their file names)
        self.load_s = time.perf_counter() - t0
        self.pid = os.getpid()

    def info(self) -> Dict[str, Any]:
        return {'slot': self.slot, 'pid': self.pid, 'load_s': self.load_s,
                'backend': reports_of(self.backend).describe() or type(self.backend).__name__}

    def close(self) -> None:
        """Close the scheduler, then the backend, as a local ``mtflow run`` does at its end: a
        scheduler may hold processes of its own (an ``env: {openenv: {launch: ...}}`` pool's
        servers run in their own session and would outlive the actor's ``ray.kill``)."""
        try:
            close = getattr(self.scheduler, 'close', None)
            if callable(close):
                close()
        finally:
            try:
                reports_of(self.backend).close()
            finally:
                if self._images is not None:
                    shutil.rmtree(self._images.dir.parent, ignore_errors=True)

    def store_image(self, image: Any) -> Any:
        """The executor's ``image_store``: ``image`` stored in this actor's own folder, as an
        :class:`~mtflow.core.images.ImageRef`."""
        if self._images is None:
            sweep_orphan_image_dirs()
            folder = tempfile.mkdtemp(prefix=f'{IMAGE_DIR_PREFIX}{self.slot}-pid{os.getpid()}-')
            self._images = ImageStore(Path(folder), fsync=False)
        return self._images.put_ref(image)

    def encoded_images(self, request: Any) -> List[Any]:
        """``request``'s images, in order, for the driver to store: the encoded bytes of each the
        first time this actor ships it, its :class:`~mtflow.run.images.ShippedName` after that
        (the driver stored it before the line of the record that carried it; a group's copies
        of one prompt, or an environment's recurring frame, cross once)."""
        items: List[Any] = []
        for image in getattr(request, 'images', None) or ():
            ref = self.store_image(image)
            name = self._images.name_of(ref)
            if name in self._shipped:
                items.append(ShippedName(name))
            else:
                items.append(Path(ref).read_bytes())
                self._shipped.add(name)
        return items

    def serving_summary(self) -> Optional[Dict[str, Any]]:
        """This actor's router figures (``None`` for a backend without a router); the driver
        merges the actors'."""
        return serving_figures(self.backend)

    def stats(self) -> Dict[str, float]:
        stats = reports_of(self.backend).stats
        if stats is None:
            return {}
        return {k: float(v) for k, v in vars(stats).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def run_shard(self, shard: Sequence[Tuple[int, Any]], t_offset_from: float = 0.0) -> Iterator[Tuple[str, Any]]:
        """Run one shard (``(dataset index, request)`` pairs) through a fresh executor run.

        The executor runs in a helper thread and hands each finished request over a queue; this
        generator yields ``('finished', [records])`` with every request finished so far (Ray
        streams each yield to the driver), then ``('done', figures)``. Event times
        are shifted to count from ``t_offset_from`` (a ``time.time()`` of the driver)."""
        indices = [i for i, _ in shard]
        requests = [r for _, r in shard]
        t_offset = time.time() - t_offset_from if t_offset_from else 0.0
        out: 'queue.Queue[Tuple[str, Any]]' = queue.Queue()
        held: Dict[str, Dict[str, Any]] = {}  # a branched run's leaves, by uuid, until their trees are known

        def on_finished(finished: Any) -> None:  # requests[k]: the live request (a fork's child appended), its images
            root = finished.root_index if finished.root_index is not None else finished.index
            record = self._plain_record(finished, indices[root], t_offset, requests[finished.index])
            if branched:
                held[record['uuid']] = record
            else:
                out.put(('finished', record))

        executor = self._executor(on_finished)
        branched = executor.options.branch is not None

        def body() -> None:
            try:
                result = executor.run(requests)
                for tree in result.trees:  # each tree with every leaf: delivered whole or not at all
                    out.put(('tree', {'tree': tree, 'records': [held.pop(u) for u in tree['leaves'] if u in held]}))
                if held:  # records that are no tree's (a duplicate uuid failed before it was planted)
                    out.put(('finished', list(held.values())))
                out.put(('done', {'rollout_fn_calls': result.rollout_fn_calls, 'turns': result.turns}))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the generator's thread
                out.put(('raised', exc))

        thread = threading.Thread(target=body, name=f'mtflow-shard-{self.slot}', daemon=True)
        thread.start()
        try:
            yield from _stream_of(out)
        finally:
            thread.join(timeout=5)

    def _executor(self, on_finished: Callable[[Any], None]) -> Executor:
        spec = self.spec
        options = {'image_store': self.store_image, **spec.executor_options}
        return Executor(self.scheduler, self.turn_log.wrap(self.backend), spec.request_config,
                        max_turns=spec.max_turns,
                        on_error='return', rank=self.slot, on_finished=on_finished,
                        accounting=spec.make_accounting(self.scheduler) if spec.make_accounting else None,
                        **options)

    def _plain_record(self, finished: Any, index: int, t_offset: float, request: Any = None) -> Dict[str, Any]:
        """One finished request as plain data for the driver (a :class:`RayRecord`'s fields)."""
        record, events = finished_to_record(finished, index=index, rank=self.slot, t_offset=t_offset, request=request,
                                            reference_key=reference_field(self.scheduler))
        record[TURNS_KEY] = self.turn_log.finish(record['uuid'], record)
        annotate_serving(self.backend, record['uuid'], events)  # which server each turn went to, as a local run
        for e in events:
            e['rank'] = self.slot
        failure = finished.failure.to_dict() if finished.failure is not None else None
        if failure is not None:
            failure['index'] = index
        return {'index': index, 'uuid': str(finished.uuid), 'finish_reason': finished.finish_reason,
                'trajectory': record, 'events': events, 'failure': failure,
                'images': self.encoded_images(request) if request is not None else []}


def _stream_of(out: 'queue.Queue[Tuple[str, Any]]') -> Iterator[Tuple[str, Any]]:
    """What a shard's generator yields from the executor thread's queue: every request finished
    by now in one ``('finished', [...])`` (one Ray object, and one round trip at the driver, per
    group of requests a turn finishes, not per request), a branched run's trees each as it was put
    (``('tree', {...})``), then ``('done', figures)``; an exception of the executor thread is
    raised here."""
    pending: Optional[Tuple[str, Any]] = None
    while True:
        kind, payload = pending if pending is not None else out.get()
        pending = None
        if kind == 'raised':
            raise payload
        if kind != 'finished' or isinstance(payload, list):  # done, a tree, records put together
            yield kind, payload
            if kind == 'done':
                return
            continue
        batch = [payload]
        while True:
            try:
                item = out.get_nowait()
            except queue.Empty:
                break
            if item[0] == 'finished' and not isinstance(item[1], list):
                batch.append(item[1])
            else:
                pending = item
                break
        yield 'finished', batch


def _actor_class() -> Any:
    import ray

    @ray.remote(max_restarts=0, max_task_retries=0)
    class RolloutActor:
        """A Ray actor around :class:`ShardWorker`."""

        def __init__(self, spec: WorkerSpec, slot: int) -> None:
            self.worker = ShardWorker(spec, slot)

        def info(self) -> Dict[str, Any]:
            return self.worker.info()

        def stats(self) -> Dict[str, float]:
            return self.worker.stats()

        def serving_summary(self) -> Optional[Dict[str, Any]]:
            return self.worker.serving_summary()

        def close(self) -> None:
            self.worker.close()

        def run_shard(self, shard: Sequence[Tuple[int, Any]], t0: float) -> Iterator[Tuple[str, Any]]:
            yield from self.worker.run_shard(shard, t0)

    return RolloutActor


# ---- the driver -------------------------------------------------------------------------------
@dataclass
class _Slot:
    index: int
    actor: Any = None
    name: str = ''
    state: str = 'starting'  # starting | idle | busy | dead
    ready_ref: Any = None
    gen: Any = None
    shard: List[Tuple[int, Any]] = field(default_factory=list)
    info: Dict[str, Any] = field(default_factory=dict)
    replacement: bool = False


def _error_record(index: int, request: Any, slot: int, attempts: int, why: str) -> RayRecord:
    """The record of a request given up after ``attempts`` actors died with it in flight."""
    messages = [dict(m) for m in getattr(request, 'messages', None) or []]
    uuid = _uuid_of(index, request)
    failure = {'index': index, 'uuid': uuid, 'turn': 0, 'phase': 'ray_actor', 'type': 'ActorDiedError',
               'message': f'{attempts} actor(s) died with this request in flight; last: {why}'}
    trajectory = {'uuid': uuid, 'index': index, 'rank': slot, 'finish_reason': 'error', 'num_turns': 0,
                  'messages': messages, 'response_token_ids': [], 'response_loss_mask': [], 'rollout_logprobs': [],
                  'rollout_infos': {'num_turns': 0, 'mtflow_error': failure}}
    return RayRecord(index, uuid, 'error', trajectory, [], slot, attempts, failure)


def ray_run(requests: Iterable[Any],
            spec: WorkerSpec,
            *,
            num_actors: int = 2,
            sink: Optional[Callable[[RayRecord], None]] = None,
            on_duplicate: Optional[Callable[[RayRecord], None]] = None,
            on_tree: Optional[Callable[[Dict[str, Any]], None]] = None,
            batch_size: int = 8,
            skip: Iterable[str] = (),
            address: Optional[str] = None,
            init_options: Optional[Dict[str, Any]] = None,
            actor_options: Optional[Dict[str, Any]] = None,
            max_restarts: Optional[int] = None,
            max_attempts: int = 3,
            on_progress: Optional[Callable[[int, str], None]] = None,
            on_requeue: Optional[Callable[[List[str]], None]] = None,
            name_prefix: Optional[str] = None,
            poll_s: float = 0.5,
            result: Optional[RayRunResult] = None) -> RayRunResult:
    """Roll ``requests`` out on ``num_actors`` Ray actors built from ``spec``; call ``sink`` in
    this thread once per finished request (uuid), in the order they finish.

    Args:
        on_duplicate: gets a record dropped as a duplicate (store its ``images``: its actor counts them shipped).
        on_tree: a branched run's tree (``docs/branching.md``), once its leaves went to ``sink``.
        skip: uuids already done (e.g. a run store's ``done`` set on ``--resume``): not run.
        address: a Ray cluster to join (``'auto'``, ``'ray://host:10001'``, ``'host:6379'``);
            default: the running Ray if initialised, else a new local cluster on 127.0.0.1 with
            ``init_options`` (e.g. ``{'num_cpus': 2}``), shut down on return.
        actor_options: Ray options of each actor (default ``{'num_cpus': 1}``; ``num_gpus`` for a GPU model).
        max_restarts: replacement actors started in all (default ``num_actors``).
        max_attempts: actors a request may see die before it is given up.
        on_progress: ``on_progress(delivered, description)`` after each record and state change.
        on_requeue: ``on_requeue(uuids)``: requests given to ``sink`` that run again (an episode cut).
        name_prefix: actors are named ``<prefix>-<slot>`` (``ray.get_actor`` finds them).
        result: a :class:`RayRunResult` to fill in (an interrupted caller keeps the figures so far).
    """
    for name, value in (('num_actors', num_actors), ('batch_size', batch_size)):
        if value < 1:
            raise ValueError(f'{name} must be >= 1, not {value}')
    result = result if result is not None else RayRunResult()
    done: Set[str] = {str(u) for u in skip}
    pending, attempts = _shards(requests, batch_size, done, result)
    if not pending:
        return result
    started_ray = _start_ray(address, init_options)
    t_start, t0_unix = time.perf_counter(), time.time()
    fan_out = _FanOut(spec, result, pending, attempts, done, num_actors=num_actors, sink=sink,
                      on_duplicate=on_duplicate, on_tree=on_tree, max_restarts=max_restarts, max_attempts=max_attempts,
                      on_progress=on_progress, on_requeue=on_requeue,
                      prefix=name_prefix or f'mtflow-{os.getpid()}-{int(t0_unix)}',
                      actor_options={'num_cpus': 1, **(actor_options or {})})
    try:
        fan_out.run(t0_unix, poll_s)
        fan_out.collect_stats()
    finally:
        result.wall_s = round(time.perf_counter() - t_start, 3)
        fan_out.shut_down()
        if started_ray:
            fan_out.ray.shutdown()
    return result


def _uuid_of(index: int, request: Any) -> str:
    return str(getattr(request, 'uuid', None) or f'#{index}')


def _shards(requests: Iterable[Any], batch_size: int, done: Set[str],
            result: RayRunResult) -> Tuple[Deque[List[Tuple[int, Any]]], Dict[str, int]]:
    """The queue of shards (``(dataset index, request)`` lists of ``batch_size``) of the requests
    not in ``done``, and each one's attempt count (1). A list among ``requests`` is the roles of one
    multi-agent episode (``docs/multi-agent.md``): kept in one shard, so an episode runs on one
    rank (a shard may grow past ``batch_size`` by an episode), and skipped whole."""
    pending: Deque[List[Tuple[int, Any]]] = deque()
    attempts: Dict[str, int] = {}
    shard: List[Tuple[int, Any]] = []
    for index, item in enumerate(requests):
        members = item if isinstance(item, list) else [item]
        if _uuid_of(index, members[0]) in done:  # an episode's roles are written together
            result.skipped += len(members)
            continue
        for request in members:
            attempts[_uuid_of(index, request)] = 1
            shard.append((index, request))
        if len(shard) >= batch_size:
            pending.append(shard)
            shard = []
    if shard:
        pending.append(shard)
    result.requests = sum(len(s) for s in pending)
    return pending, attempts


def _episode_id(request: Any) -> Optional[str]:
    """The multi-agent episode a request is a role of (``data_dict['episode']['id']``), or ``None``."""
    seat = seat_of(request)
    return seat.episode if seat is not None else None


def _start_ray(address: Optional[str], init_options: Optional[Dict[str, Any]]) -> bool:
    """Join ``address``, or start a local cluster, unless Ray is up already; whether we started it."""
    import ray

    if ray.is_initialized():
        return False
    own = signal.getsignal(signal.SIGTERM)
    if address is not None:
        ray.init(address=address, **(init_options or {}))
    else:
        ray.init(**{'include_dashboard': False, '_node_ip_address': '127.0.0.1', 'log_to_driver': True,
                    **_default_runtime_env(), **(init_options or {})})
    if callable(own) and threading.current_thread() is threading.main_thread():
        # ray.init replaces a driver's SIGTERM handler with sys.exit: a caller's own (mtflow run's
        # StopSignals: the requests in flight kept as interrupted, exit 143) comes back
        signal.signal(signal.SIGTERM, own)
    return True


class _FanOut:
    """The driver's side of one :func:`ray_run`: the actor slots, the queue of shards, and the
    uuids passed to the sink (``done``), which make every request reach the sink once."""

    def __init__(self, spec: WorkerSpec, result: RayRunResult, pending: Deque[List[Tuple[int, Any]]],
                 attempts: Dict[str, int], done: Set[str], *, num_actors: int,
                 sink: Optional[Callable[[RayRecord], None]], on_duplicate: Optional[Callable[[RayRecord], None]],
                 on_tree: Optional[Callable[[Dict[str, Any]], None]], max_restarts: Optional[int], max_attempts: int,
                 on_progress: Optional[Callable[[int, str], None]], prefix: str, actor_options: Dict[str, Any],
                 on_requeue: Optional[Callable[[List[str]], None]] = None) -> None:
        import ray

        self.ray = ray
        self.spec, self.result, self.pending, self.attempts, self.done = spec, result, pending, attempts, done
        self.sink, self.on_duplicate, self.on_tree, self.on_progress = sink, on_duplicate, on_tree, on_progress
        #: told the uuids delivered already that run again (an episode cut by an actor's death)
        self.on_requeue = on_requeue
        self.max_attempts = max_attempts
        self.prefix, self.actor_options = prefix, actor_options
        self.max_restarts = num_actors if max_restarts is None else max_restarts
        self.restarts_left = self.max_restarts
        self.actor_class = _actor_class()
        self.slots = [_Slot(i) for i in range(num_actors)]
        self.generation = [0] * num_actors  # actors started per slot (names the replacements)

    # ---- the loop -----------------------------------------------------------------------------
    def run(self, t0_unix: float, poll_s: float) -> None:
        """Hand out shards and take in what the actors stream back until every shard is done."""
        for slot in self.slots:
            self.start(slot, replacement=False)
        self.progress(f'starting {len(self.slots)} actor(s)')
        while True:
            self.hand_out(t0_unix)
            busy = [s for s in self.slots if s.state == 'busy']
            starting = [s for s in self.slots if s.state == 'starting']
            if not busy and not self.pending:
                return
            if not busy and not starting:
                raise RayRunError(f'every Ray actor is gone and {sum(len(s) for s in self.pending)} request(s) are '
                                  f'not run (max_restarts={self.max_restarts}); what finished has been written: run '
                                  'again with --resume')
            ready, _ = self.ray.wait([s.ready_ref for s in starting] + [s.gen for s in busy], num_returns=1,
                                     timeout=poll_s)
            for slot in starting:
                if _among(slot.ready_ref, ready):
                    self.on_ready(slot)
            for slot in busy:
                if _among(slot.gen, ready):
                    self.on_streamed(slot)

    def start(self, slot: _Slot, replacement: bool) -> None:
        self.generation[slot.index] += 1
        count = self.generation[slot.index]
        slot.name = f'{self.prefix}-{slot.index}' + (f'.{count}' if count > 1 else '')
        slot.actor = self.actor_class.options(name=slot.name, **self.actor_options).remote(self.spec, slot.index)
        slot.ready_ref = slot.actor.info.remote()
        slot.state, slot.gen, slot.shard, slot.replacement = 'starting', None, [], replacement

    def hand_out(self, t0_unix: float) -> None:
        """The next shard to every idle actor."""
        for slot in self.slots:
            if slot.state == 'idle' and self.pending:
                slot.shard = self.pending.popleft()
                slot.gen = slot.actor.run_shard.remote(slot.shard, t0_unix)
                slot.state = 'busy'
                self.result.shards += 1

    def on_ready(self, slot: _Slot) -> None:
        """A starting actor answered: ready (it built its backend), or it failed to start."""
        from ray.exceptions import RayActorError, RayTaskError

        try:
            slot.info = self.ray.get(slot.ready_ref)
        except (RayActorError, RayTaskError) as exc:
            if not slot.replacement:
                raise RayRunError(f'Ray actor {slot.index} could not start: {_cause(exc)}') from None
            slot.state = 'dead'
            self.progress(f'replacement actor {slot.index} could not start: {_cause(exc)}')
            return
        slot.state = 'idle'
        self.result.actor_load_s.append(round(float(slot.info.get('load_s', 0.0)), 3))
        if self.result.backend is None:
            self.result.backend = slot.info.get('backend')
        self.progress(f'actor {slot.index} ready')

    def on_streamed(self, slot: _Slot) -> None:
        """The next item of a busy actor's stream: finished requests, the shard's figures, its
        end, or the actor's death."""
        from ray.exceptions import RayActorError, RayTaskError

        try:
            kind, payload = self.ray.get(next(slot.gen))
        except StopIteration:
            slot.state, slot.gen, slot.shard = 'idle', None, []
            return
        except (RayActorError, RayTaskError) as exc:  # a task error: the shard raised past the executor
            self.lost(slot, _cause(exc))
            return
        if kind == 'finished':
            for item in payload:
                self.deliver(self.record_of(item, slot))
            self.progress(f'{sum(1 for s in self.slots if s.state == "busy")} actor(s) busy')
        elif kind == 'tree':
            self.deliver_tree(payload, slot)
            self.progress(f'{sum(1 for s in self.slots if s.state == "busy")} actor(s) busy')
        elif kind == 'done':
            self.result.rollout_fn_calls += int(payload.get('rollout_fn_calls', 0))

    # ---- records and deaths -------------------------------------------------------------------
    def progress(self, description: str) -> None:
        if self.on_progress is not None:
            self.on_progress(self.result.delivered, description)

    def record_of(self, item: Dict[str, Any], slot: _Slot) -> RayRecord:
        uuid = item['uuid']
        return RayRecord(item['index'], uuid, item['finish_reason'], item['trajectory'], item['events'], slot.index,
                         self.attempts.get(uuid) or self.attempts.get(branch_root(uuid), 1), item['failure'],
                         item.get('images') or [])

    def deliver_tree(self, payload: Dict[str, Any], slot: _Slot) -> None:
        """A branched prompt's whole tree: its leaves to the sink, then the tree (a tree whose
        root was delivered before came twice: its leaves are dropped as duplicates, no tree). A
        first signal meanwhile waits until the tree is taken: its leaves on disk without its line
        would leave it short for good."""
        tree = payload['tree']
        fresh = str(tree['root']) not in self.done
        with deferred_interrupts():
            for item in payload['records']:
                self.deliver(self.record_of(item, slot))
            if fresh and self.on_tree is not None:
                self.on_tree(tree)

    def deliver(self, rec: RayRecord) -> None:
        result = self.result
        if rec.uuid in self.done:
            result.duplicates_dropped += 1
            if self.on_duplicate is not None and rec.images:
                self.on_duplicate(rec)
            return
        self.done.add(rec.uuid)
        result.delivered += 1
        result.finish_reasons[rec.finish_reason] = result.finish_reasons.get(rec.finish_reason, 0) + 1
        result.per_actor[rec.actor] = result.per_actor.get(rec.actor, 0) + 1
        if self.sink is not None:
            self.sink(rec)

    def lost(self, slot: _Slot, why: str) -> None:
        """The actor of ``slot`` died: requeue what it had not delivered, replace it."""
        self.result.actor_deaths += 1
        undelivered = [(index, request) for index, request in slot.shard if _uuid_of(index, request) not in self.done]
        cut = {_episode_id(r) for _, r in undelivered} - {None}
        if cut:  # an episode runs whole or not at all: its roles already delivered run again with it
            again = [(i, r) for i, r in slot.shard if _episode_id(r) in cut and _uuid_of(i, r) in self.done]
            self.done.difference_update(_uuid_of(i, r) for i, r in again)
            self.result.delivered -= len(again)
            if self.on_requeue is not None:
                self.on_requeue([_uuid_of(i, r) for i, r in again])
            undelivered = [(i, r) for i, r in slot.shard if _uuid_of(i, r) not in self.done]
        retry = []
        for index, request in undelivered:
            uuid = _uuid_of(index, request)
            self.attempts[uuid] += 1
            if self.attempts[uuid] > self.max_attempts:
                self.result.given_up += 1
                self.deliver(_error_record(index, request, slot.index, self.attempts[uuid] - 1, why))
            else:
                retry.append((index, request))
        if retry:
            self.result.retried += len(retry)
            self.pending.appendleft(retry)
        try:
            self.ray.kill(slot.actor)
        except Exception:  # already gone
            pass
        slot.state, slot.gen, slot.shard = 'dead', None, []
        if self.restarts_left > 0 and (self.pending or any(s.state == 'busy' for s in self.slots)):
            self.restarts_left -= 1
            self.result.restarts += 1
            self.start(slot, replacement=True)
        self.progress(f'actor {slot.index} died ({why}); {len(retry)} request(s) requeued')

    # ---- the end ------------------------------------------------------------------------------
    def collect_stats(self) -> None:
        """Backend figures of the actors still alive: generation figures summed, router figures
        kept per actor (the driver merges them)."""
        stats = self.result.backend_stats
        for slot in self.slots:
            if slot.state == 'idle':
                try:
                    figures, serving = self.ray.get([slot.actor.stats.remote(), slot.actor.serving_summary.remote()],
                                                    timeout=60)
                except Exception:  # an actor that died at the very end: its figures are lost, not its work
                    continue
                for k, v in figures.items():
                    stats[k] = stats.get(k, 0.0) + v
                if serving:
                    self.result.serving.append(serving)

    def shut_down(self) -> None:
        """The live actors close their schedulers and backends first (bounded: a wedged actor is
        killed all the same); then every actor is killed."""
        ray = self.ray
        closing = [s.actor.close.remote() for s in self.slots if s.actor is not None and s.state != 'dead']
        if closing:
            try:
                ray.wait(closing, num_returns=len(closing), timeout=CLOSE_TIMEOUT_S)
            except Exception:  # an actor gone meanwhile
                pass
        for slot in self.slots:
            if slot.actor is not None:
                try:
                    ray.kill(slot.actor)
                except Exception:
                    pass


def _among(item: Any, ready: List[Any]) -> bool:
    return any(item is r or item == r for r in ready)


def _default_runtime_env() -> Dict[str, Any]:
    """Workers of a local cluster see the driver's own import path entries (a repository
    checkout, a notebook's directory; not the interpreter's), so specs that refer to its modules
    unpickle there."""
    prefixes = tuple({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    paths = [p for p in sys.path if p and os.path.isdir(p) and not os.path.realpath(p).startswith(prefixes)]
    if os.getcwd() not in paths:
        paths.insert(0, os.getcwd())
    return {'runtime_env': {'env_vars': {'PYTHONPATH': os.pathsep.join(paths)}}}


_ANSI = re.compile(r'\x1b\[[0-9;]*m')
#: the line Python ends a traceback with: ``package.module.SomeError: message``
_RAISED = re.compile(r'^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception)): (.+)$')


def _cause(exc: BaseException) -> str:
    """One line about why an actor or its task failed: the user's exception when there is one
    (the last line of the remote traceback), else the first and last lines of Ray's message."""
    cause = getattr(exc, 'cause', None)
    if isinstance(cause, BaseException) and not isinstance(cause, type(exc)):
        return f'{type(cause).__name__}: {_first_line(cause)}'
    lines = [ln.strip() for ln in _ANSI.sub('', str(exc)).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    if any(ln.startswith('Traceback') for ln in lines):
        return lines[-1][:300]
    raised = _RAISED.match(lines[-1])
    if raised and len(lines) > 1:  # an actor that died of the user's exception (ActorDiedError): that one, whole
        return f'{raised.group(1)}: {raised.group(2)}'[:1000]
    head = f'{type(exc).__name__}: {lines[0]}'
    return (head if len(lines) == 1 else f'{head} ... {lines[-1]}')[:400]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [''])[0][:300]
