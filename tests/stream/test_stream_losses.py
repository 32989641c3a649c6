"""Nothing pulled from a stream's source is lost when it stops: every request is delivered, handed
back in ``Stream.unfinished`` (its group whole), or in ``Stream.untaken`` (finished, not taken)."""
from __future__ import annotations

from typing import Dict, List

import pytest

from benchmarks.longtail_sim import LongTailScheduler, SimEngine, Workload
from mtflow import Executor


def _source(w: Workload, n: int, size: int, pulled: List[List[str]]):
    reqs = w.requests(n)
    for i in range(0, n, size):
        group = reqs[i:i + size]
        pulled.append([r.uuid for r in group])
        yield group


def _accounted(stream, taken) -> Dict[str, str]:
    """Where each request ended: 'taken', 'untaken' or 'unfinished' (an error if twice)."""
    where: Dict[str, str] = {}
    lists = [('taken', [u for g in taken for u in g.uuids]),
             ('untaken', [u for g in stream.untaken for u in g.uuids]),
             ('unfinished', [item.uuid for item in stream.unfinished])]
    for name, uuids in lists:
        for uuid in uuids:
            assert uuid not in where, f'{uuid} is both {where[uuid]} and {name}'
            where[uuid] = name
    return where


def _check_whole(pulled: List[List[str]], where: Dict[str, str], stream) -> None:
    lost = [u for group in pulled for u in group if u not in where]
    assert not lost, f'{len(lost)} of {sum(map(len, pulled))} pulled requests lost: {lost[:8]}'
    back = [item.uuid for item in stream.unfinished]
    for group in pulled:
        places = {where[u] for u in group}
        assert len(places) == 1, f'group {group} split over {places}'
        if places == {'unfinished'}:  # handed back whole, its members together and in order
            at = back.index(group[0])
            assert back[at:at + len(group)] == group


@pytest.mark.parametrize('seed', range(10))
def test_until_groups_loses_nothing_over_a_long_tailed_workload(seed):
    w = Workload(seed=100 + seed, tool_median_s=0.001, reply_median=6)
    pulled: List[List[str]] = []
    ex = Executor(LongTailScheduler(w), SimEngine(w, 0.0002, 64))
    stream = ex.stream(_source(w, 800, 4, pulled), max_concurrency=24, until={'groups': 10 + 3 * seed})
    taken = list(stream)
    assert len(taken) == 10 + 3 * seed
    where = _accounted(stream, taken)
    _check_whole(pulled, where, stream)
    finished_back = [item for item in stream.unfinished if item.state == 'finished']
    assert all(item.record.output is not None for item in finished_back)


@pytest.mark.parametrize('seed', range(10))
def test_close_keeps_the_finished_groups_not_taken(seed):
    w = Workload(seed=200 + seed, tool_median_s=0.001, reply_median=6)
    pulled: List[List[str]] = []
    ex = Executor(LongTailScheduler(w), SimEngine(w, 0.0002, 64))
    stream = ex.stream(_source(w, 800, 4, pulled), max_concurrency=24, buffer=6)
    taken = [next(stream) for _ in range(3)]
    stream.close()
    where = _accounted(stream, taken)
    _check_whole(pulled, where, stream)
    assert all(len(g.outputs) == 4 and all(o is not None for o in g.outputs) for g in stream.untaken)


def test_a_group_handed_back_whole_resumes_whole():
    """The members of a partly finished group go back together: resuming them runs only the
    unfinished ones and returns the finished ones' outputs as they were."""
    w = Workload(seed=7, tool_median_s=0.001, reply_median=6)
    pulled: List[List[str]] = []
    ex = Executor(LongTailScheduler(w), SimEngine(w, 0.0002, 64))
    stream = ex.stream(_source(w, 400, 4, pulled), max_concurrency=24, until={'groups': 20})
    list(stream)
    kept = {item.uuid: item.record.output for item in stream.unfinished if item.state == 'finished'}
    assert kept, 'the workload leaves some group partly finished'
    rest = Executor(LongTailScheduler(w), SimEngine(w, 0.0002, 64), mode='async').run(stream.unfinished)
    assert rest.ok and not rest.unfinished
    by_uuid = {item.uuid: out for item, out in zip(stream.unfinished, rest.outputs)}
    assert all(by_uuid[u] is kept[u] for u in kept)


@pytest.mark.parametrize('seed', range(3))
def test_interrupt_returns_every_request_pulled(seed):
    w = Workload(seed=300 + seed, tool_median_s=0.001, reply_median=6)
    pulled: List[List[str]] = []
    stream = Executor(LongTailScheduler(w), SimEngine(w, 0.0002, 64)).stream(_source(w, 800, 4, pulled),
                                                                           max_concurrency=24)
    taken = [next(stream) for _ in range(4)]
    rest = stream.interrupt()
    got = [u for g in taken + rest for u in g.uuids]
    assert sorted(got) == sorted(u for group in pulled for u in group) and not stream.unfinished
