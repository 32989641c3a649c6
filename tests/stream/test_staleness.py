"""Bounded staleness on a simulated engine: a trainer thread updates the weights every 0.15 s
while long-tailed groups stream; ``max_staleness`` bounds every delivered group's version span
and age, and ``on_update='abort'`` issues interrupted generations again from the exact ids."""
from __future__ import annotations

import threading
import time
from typing import List

import pytest

from benchmarks.longtail_sim import LongTailScheduler, SimEngine, Workload
from mtflow import Executor, StreamGroup

UPDATES = 8
EVERY_S = 0.15


def _workload() -> Workload:
    return Workload(seed=11, tool_median_s=0.004, reply_median=16)


def _stream(resumable: bool = False, rollout_timeout_s=None, **options) -> tuple:
    w = _workload()
    ex = Executor(LongTailScheduler(w), SimEngine(w, 0.0002, 64, resumable=resumable),
                  rollout_timeout_s=rollout_timeout_s)
    reqs = w.requests(160)
    groups = [reqs[i:i + 4] for i in range(0, len(reqs), 4)]
    stop = threading.Event()

    def trainer():  # a fixed number of updates, so that a restarted group always finishes in the end
        for v in range(1, UPDATES + 1):
            if stop.wait(EVERY_S):
                return
            ex.set_policy_version(v)

    thread = threading.Thread(target=trainer, daemon=True)
    stream = ex.stream(iter(groups), max_concurrency=24, **options)
    thread.start()
    got: List[StreamGroup] = list(stream)
    stop.set()
    thread.join()
    return got, stream


def test_without_a_bound_groups_span_versions():
    got, _ = _stream()
    assert max(g.version_span for g in got) >= 1  # what the bound is for: the test below can fail
    assert len(got) == 40


@pytest.mark.parametrize('k', [0, 1])
def test_max_staleness_bounds_every_delivered_group(k):
    got, stream = _stream(max_staleness=k, stale='restart')
    assert len(got) == 40  # restarted, never lost
    assert all(g.version_span <= k and g.age <= k for g in got), [(g.version_span, g.age) for g in got]
    if k == 0:
        assert all(len({v for vs in g.versions for v in vs}) == 1 for g in got)
        assert stream.stats['restarted_groups'] > 0


def test_drop_discards_stale_groups():
    got, stream = _stream(max_staleness=0, stale='drop')
    assert stream.stats['dropped_groups'] > 0
    assert len(got) + stream.stats['dropped_groups'] == 40
    assert all(g.version_span == 0 and g.age == 0 for g in got)


def test_abort_on_update_resumes_from_the_exact_ids():
    got, stream = _stream(on_update='abort')
    assert stream.stats['aborted_generations'] > 0
    w = _workload()
    ref = Executor(LongTailScheduler(w), SimEngine(w, 0.0002, 64), mode='async').run(w.requests(160))
    by_uuid = {u: o for g in got for u, o in zip(g.uuids, g.outputs)}
    for req, out in zip(w.requests(160), ref.outputs):
        mine = by_uuid[req.uuid]
        assert len(mine.response_token_ids) == len(out.response_token_ids)
        for k, (a, b) in enumerate(zip(mine.response_token_ids, out.response_token_ids)):
            assert a == b, f'{req.uuid} segment {k}'
        versions = mine.rollout_infos['policy_versions']
        assert versions == sorted(versions) and len(versions) == mine.rollout_infos['num_turns']


@pytest.mark.parametrize('rollout_timeout_s', [None, 60.0])  # under a deadline too: the cut's ids are kept
def test_resume_on_update_continues_each_cut_generation_from_its_exact_ids(rollout_timeout_s):
    got, stream = _stream(resumable=True, on_update='resume', rollout_timeout_s=rollout_timeout_s)
    assert stream.stats['resumed_generations'] > 0
    w = _workload()
    ref = Executor(LongTailScheduler(w), SimEngine(w, 0.0002, 64), mode='async').run(w.requests(160))
    by_uuid = {u: o for g in got for u, o in zip(g.uuids, g.outputs)}
    cut_turns = 0
    for req, out in zip(w.requests(160), ref.outputs):
        mine = by_uuid[req.uuid]
        assert mine.response_token_ids == out.response_token_ids, req.uuid  # not regenerated: continued
        assert mine.rollout_logprobs == out.rollout_logprobs, req.uuid
        assert mine.messages == out.messages, req.uuid
        versions = mine.rollout_infos['policy_versions']
        assert versions == sorted(versions) and len(versions) == mine.rollout_infos['num_turns']
        for entry in mine.rollout_infos.get('policy_version_segments', []):
            t, spans = entry['turn'], entry['segments']
            segment = out.response_token_ids[t - 1]  # the turn's sampled ids, then 4 tool ids (not the last turn)
            sampled = segment if t == mine.rollout_infos['num_turns'] else segment[:-4]
            assert spans[0][0] == 0 and spans[-1][1] == len(sampled)  # the segments cover the turn ...
            assert all(a[1] == b[0] and a[2] <= b[2] for a, b in zip(spans, spans[1:]))  # ... in order
            for start, end, _v in spans:  # the exact-id check, per segment
                assert mine.response_token_ids[t - 1][start:end] == sampled[start:end], (req.uuid, t, start)
            assert versions[t - 1] == spans[0][2]  # the turn counts as old as its first token
            cut_turns += len({v for _, _, v in spans}) > 1
    assert cut_turns > 0  # some turn was sampled by two versions and still came out exact


def test_resume_needs_a_resumable_rollout_fn():
    w = _workload()
    ex = Executor(LongTailScheduler(w), SimEngine(w, 0.0002, 64))
    with pytest.raises(ValueError, match="on_update='resume' needs a rollout_fn that returns what it generated"):
        ex.stream(iter([]), on_update='resume')


def test_a_group_found_stale_after_until_stopped_the_stream_is_handed_back_unfinished():
    w = Workload(seed=3, tool_median_s=0.001, reply_median=4)
    ex = Executor(LongTailScheduler(w), SimEngine(w, 0.0001, 64))
    reqs = w.requests(20)
    groups = [reqs[i:i + 2] for i in range(0, 20, 2)]
    ex.set_policy_version(0)
    stream = ex.stream(iter(groups), max_concurrency=20, buffer=10, until={'groups': 3}, max_staleness=0)
    first = next(stream)
    deadline = time.monotonic() + 30
    while not stream.driver.ended and time.monotonic() < deadline:  # the budget stops the driver meanwhile
        time.sleep(0.01)
    assert stream.driver.ended
    ex.set_policy_version(1)  # the two groups still in the buffer are now a version too old
    rest = list(stream)
    assert rest == []  # too stale to deliver, and the stream is over: not delivered ...
    stale = {u for g in groups for u in (r.uuid for r in g)} - set(first.uuids)
    back = {item.record.uuid: item for item in stream.unfinished}
    assert stream.stats['handed_back_groups'] == 2
    handed = {u for u, item in back.items() if not item.started}
    assert len(handed) == 4 and handed <= stale  # ... but handed back, to run again, never lost
    assert all(item.record.turns == 0 for item in back.values() if not item.started)
    assert stream.stats['delivered_groups'] == 1
    again = Executor(LongTailScheduler(w), SimEngine(w, 0.0001, 64), mode='async').run(
        [back[u] for u in sorted(handed)])
    assert all(r != 'error' for r in again.finish_reasons) and len(again.outputs) == 4


def test_a_resumable_call_past_its_deadline_times_out_like_any_other():
    """At the deadline a resumable rollout_fn answers the cancellation with GenerationAborted (its
    partial output), which asyncio.wait_for passes on in place of TimeoutError: the request must
    still end as a timeout, exactly as with a rollout_fn that is not resumable."""
    import asyncio

    from mtflow import RolloutInferRequest, Scheduler
    from mtflow.engine.resume import GenerationAborted

    async def slow(requests, request_config=None):
        await asyncio.sleep(30)

    async def resumable(requests, request_config=None):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise GenerationAborted(None) from None

    resumable.resumable = True

    def run(fn):
        reqs = [RolloutInferRequest(uuid='late', messages=[{'role': 'user', 'content': 'hi'}])]
        return Executor(Scheduler(), fn, mode='async', rollout_timeout_s=0.2, on_error='return').run(reqs)

    plain, cut = run(slow), run(resumable)
    assert plain.finish_reasons == ['timeout'] and cut.finish_reasons == ['timeout']
    assert [(f.uuid, f.phase, type(f.error).__name__) for f in cut.failures] == \
        [(f.uuid, f.phase, type(f.error).__name__) for f in plain.failures]
