"""Executor.stream: groups out as they finish, concurrency kept, backpressure, budgets, the async twin."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from benchmarks.longtail_sim import LongTailScheduler, SimEngine, Workload
from mtflow import Executor, StreamGroup, StreamUntil


def _groups(w: Workload, n: int, size: int):
    reqs = w.requests(n)
    return [reqs[i:i + size] for i in range(0, n, size)]


def _executor(w: Workload, slots: int = 64) -> Executor:
    return Executor(LongTailScheduler(w), SimEngine(w, 0.0002, slots))


def test_stream_delivers_every_group_with_the_async_runs_outputs():
    w = Workload(seed=1, tool_median_s=0.002)
    engine = SimEngine(w, 0.0002, 64)
    ex = Executor(LongTailScheduler(w), engine)
    got = list(ex.stream(iter(_groups(w, 48, 4)), max_concurrency=12))
    assert [len(g.outputs) for g in got] == [4] * 12
    assert sorted(g.seq for g in got) == list(range(12))
    assert engine.max_in_flight <= 12
    ref = Executor(LongTailScheduler(w), SimEngine(w, 0.0002, 64), mode='async').run(w.requests(48))
    by_uuid = {u: o for g in got for u, o in zip(g.uuids, g.outputs)}
    for req, out in zip(w.requests(48), ref.outputs):
        assert by_uuid[req.uuid].response_token_ids == out.response_token_ids
        assert by_uuid[req.uuid].response_loss_mask == out.response_loss_mask
    assert all(g.events and g.events[0][-1].dst == 'finished' for g in got)
    assert all(g.version_span == 0 and g.age == 0 for g in got)


def test_groups_come_out_as_they_finish_not_in_source_order():
    w = Workload(seed=2, tool_median_s=0.002)
    got = list(_executor(w).stream(iter(_groups(w, 64, 2)), max_concurrency=64))
    assert [g.seq for g in got] != sorted(g.seq for g in got)  # a long-tailed group does not hold back the others


def test_single_requests_are_groups_of_one():
    w = Workload(seed=3, tool_median_s=0.001)
    got = list(_executor(w).stream(w.requests(5), max_concurrency=2))
    assert sorted(g.uuids[0] for g in got) == [f'r{i:04d}' for i in range(5)]
    assert all(g.output.response_token_ids for g in got)


def test_backpressure_stops_admission_while_the_consumer_is_slow():
    w = Workload(seed=4, tool_median_s=0.001, reply_median=4)
    pulled = []

    def source():
        for i, group in enumerate(_groups(w, 120, 2)):
            pulled.append(i)
            yield group

    stream = _executor(w).stream(source(), max_concurrency=4, buffer=3)
    first = next(stream)
    time.sleep(0.5)  # the consumer "trains"; the producer fills the buffer, then waits
    before = len(pulled)
    time.sleep(0.3)
    assert len(pulled) == before  # nothing admitted while the buffer is full
    assert before <= 1 + 3 + 4  # taken + buffered + in flight (groups of 2: at most 4 groups in flight)
    rest = list(stream)
    assert len(rest) + 1 == 60 and isinstance(first, StreamGroup)
    assert stream.stats['backpressure_waits'] > 0


@pytest.mark.parametrize('until,check', [
    ({'groups': 5}, lambda s, got: len(got) == 5),
    ({'requests': 7}, lambda s, got: sum(len(g.outputs) for g in got) in (8, )),
    (StreamUntil(tokens=500), lambda s, got: s.stats['delivered_tokens'] >= 500 and
     s.stats['delivered_tokens'] - got[-1].tokens < 500),
])
def test_until_stops_the_stream(until, check):
    w = Workload(seed=5, tool_median_s=0.001)
    stream = _executor(w).stream(iter(_groups(w, 200, 2)), max_concurrency=8, until=until)
    got = list(stream)
    assert check(stream, got)
    assert len(got) < 100
    done = {u for g in got for u in g.uuids}
    assert stream.unfinished and not done & {u.uuid for u in stream.unfinished}


def test_until_seconds_and_close():
    w = Workload(seed=6, tool_median_s=0.001, reply_median=4)
    stream = _executor(w).stream(iter(_groups(w, 4000, 4)), max_concurrency=8, until={'seconds': 0.5})
    t = time.perf_counter()
    got = list(stream)
    assert time.perf_counter() - t < 3 and 0 < len(got) < 1000
    with _executor(w).stream(iter(_groups(w, 4000, 4)), max_concurrency=8) as s2:
        next(s2)
    assert s2.unfinished and threading.active_count() < 20


def test_astream_from_a_running_loop():
    w = Workload(seed=7, tool_median_s=0.001)

    async def source():
        for group in _groups(w, 12, 3):
            yield group

    async def main():
        seen = []
        async for group in _executor(w).astream(source(), max_concurrency=6):
            seen.append(group.seq)
            await asyncio.sleep(0)
        return seen

    assert sorted(asyncio.run(main())) == [0, 1, 2, 3]


def test_bad_options_are_named():
    w = Workload(seed=8)
    ex = _executor(w)
    with pytest.raises(ValueError, match='max_staleness'):
        ex.stream([], max_staleness=-1)
    with pytest.raises(ValueError, match='stale must be'):
        ex.stream([], stale='mask-all')
    with pytest.raises(ValueError, match='until'):
        ex.stream([], until={'turns': 3})


def test_interrupt_finishes_the_requests_in_flight_as_interrupted():
    w = Workload(seed=9, tool_median_s=0.002)
    stream = _executor(w).stream(iter(_groups(w, 400, 4)), max_concurrency=8)
    first = next(stream)
    rest = stream.interrupt()
    last = rest[-1]
    assert last.seq == -1 and set(last.finish_reasons) == {'interrupted'}
    assert all(g.seq >= 0 and 'interrupted' not in g.finish_reasons for g in [first] + rest[:-1])
    assert all(o.messages for o in last.outputs) and not stream.unfinished
    assert stream.interrupt() == []
