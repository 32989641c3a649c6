"""``mtflow run`` through the streaming producer (``--mode async``, or any run with ``--until``).

The batch loop of :mod:`mtflow.run.driver` waits at every batch's end for its slowest request;
here the prompts go to :meth:`mtflow.Executor.stream` instead: ``max_concurrency`` requests in
flight all the time, a GRPO group (the ``num_generations`` copies of one prompt, next to each
other in the source) written together the moment its last copy finishes, and only the groups in
flight held in memory, whatever the dataset's size. Prompts the store already has are skipped
(``--resume``); the budget ``--until`` (:mod:`mtflow.run.until`) stops after that many written
groups, requests, seconds or tokens, and what was in flight is not written, so ``--resume`` runs
it again from its prompts. A ``KeyboardInterrupt`` (Ctrl-C, SIGTERM) finishes the requests in
flight as ``interrupted`` (``interrupted.jsonl``) and goes on to the caller. A line that could not
be written fails the run after its group (:meth:`mtflow.run.driver.StreamingRun.check_writes`):
the stream stops, and what was in flight runs again on ``--resume``.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from mtflow.core.machine import INTERRUPTED
from mtflow.core.records import FinishedRequest
from mtflow.engine.stream import StreamGroup, StreamUntil
from mtflow.run.signals import deferred_interrupts
from mtflow.run.trees import whole_trees

__all__ = ['group_source', 'run_streaming']


def _group_key(request: Any) -> str:
    data = getattr(request, 'data_dict', None) or {}
    return str(data.get('group') or request.uuid)


def group_source(prompts: Iterable[Any], store: Any, positions: Dict[str, Tuple[int, Any]],
                 skipped: List[int]) -> Iterator[List[Any]]:
    """The prompts as groups (consecutive requests of one ``group``), without the ones ``store``
    has; each request's dataset position and input go into ``positions`` until it is written. A
    list among the prompts is an episode's roles (``docs/multi-agent.md``): written together, so
    skipped together."""
    group: List[Any] = []
    key: Optional[str] = None
    for index, item in enumerate(prompts):
        members = item if isinstance(item, list) else [item]
        if store.prompt_done(members[0].uuid):
            skipped[0] += len(members)
            continue
        for request in members:
            k = _group_key(request)
            if group and k != key:
                yield group
                group = []
            key = k
            positions[str(request.uuid)] = (index, request)
            group.append(request)
    if group:
        yield group


def run_streaming(run: Any, executor: Any, prompts: Iterable[Any], until: Optional[StreamUntil],
                  max_concurrency: int) -> None:
    """Stream ``prompts`` through ``executor`` into ``run``'s store (``run``: the
    :class:`mtflow.run.driver.StreamingRun` whose writer and figures are used)."""
    positions: Dict[str, Tuple[int, Any]] = {}
    skipped = [0]
    t_offset = time.time() - run.store.started_unix
    stream = executor.stream(group_source(prompts, run.store, positions, skipped), max_concurrency=max_concurrency,
                             until=until)
    run.batches += 1
    try:
        for group in stream:
            _write(run, group, positions, t_offset)
            run.check_writes()  # a line that could not be written fails the run, naming it
    except KeyboardInterrupt:
        for group in stream.interrupt():
            _write(run, group, positions, t_offset)
        run.check_lost()
        raise
    except BaseException:  # the run fails: the driver stops, what is in flight goes back (run again on --resume)
        for group in _stop(stream):  # the groups that had finished are written all the same
            _write(run, group, positions, t_offset)
        raise
    finally:
        run.skipped += skipped[0]
        run.rollout_fn_calls += stream.stats['rollout_fn_calls']
    run.until_met = bool(stream.unfinished) or (until is not None and not _source_done(stream))


def _stop(stream: Any) -> List[StreamGroup]:
    """Stop the stream's driver after the consumer failed; the groups that finished and were not
    taken. An error of the driver's own is not the one to report then."""
    try:
        stream.close()
    except BaseException:  # noqa: BLE001 - the consumer's error is on its way up
        pass
    return list(stream.untaken)


def _source_done(stream: Any) -> bool:
    return bool(stream.driver.source_done)


def _write(run: Any, group: StreamGroup, positions: Dict[str, Tuple[int, Any]], t_offset: float) -> None:
    """One delivered group, whole: a first signal that comes meanwhile waits until its lines and
    its trees' lines are taken (a tree line cut off would leave its tree short for good)."""
    with deferred_interrupts():
        _write_group(run, group, positions, t_offset)


def _write_group(run: Any, group: StreamGroup, positions: Dict[str, Tuple[int, Any]], t_offset: float) -> None:
    failures = {f.uuid: f for f in group.failures}
    # a branched group (docs/branching.md): each fork's child is written at its root's position, and
    # only a whole tree is done (an interrupt's cut tree goes whole to interrupted.jsonl: mtflow/run/trees.py)
    parents = {child: fork['parent'] for tree in group.trees for fork in tree['forks'] for child in fork['children']}
    roots = {leaf: tree['root'] for tree in group.trees for leaf in tree['leaves']}
    whole, cut = whole_trees(group.trees, {u for u, reason in zip(group.uuids, group.finish_reasons)
                                           if reason != INTERRUPTED})
    placed: Dict[str, Tuple[int, Any]] = {}
    for k, uuid in enumerate(group.uuids):
        root = roots.get(uuid, uuid)
        if root not in placed:  # a tree an interrupt cut comes in two groups: its position is kept for the second
            placed[root] = positions.get(root, (k, group.requests[k]))
        index, request = placed[root]
        finished = FinishedRequest(index, uuid, group.outputs[k], group.finish_reasons[k], failures.get(uuid),
                                   group.events[k], parents.get(uuid))
        run.write_finished(finished, index, request, t_offset, live=group.requests[k], whole=uuid not in cut)
        if group.finish_reasons[k] != INTERRUPTED and uuid not in cut:
            positions.pop(root, None)  # done: only what is in flight is held
    run.store.write_trees(run.written_trees(whole))
    run.tick()
