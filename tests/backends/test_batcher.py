"""The dynamic batcher: concurrent single-request calls become batch calls of the wrapped
``rollout_fn``; every caller gets exactly its own outputs or its own batch's error.

Grouping is asserted through ``batch_sizes`` and the wrapped function's recorded calls, never
through wall-clock time; windows are generous (seconds) so a loaded machine cannot split a group."""
import asyncio
import threading
import time

import pytest

from mtflow.backends.batcher import BatcherClosed, DynamicBatcher
from tests.helpers import out, req


class Echo:
    """A batch ``rollout_fn``: each output's text is ``<uuid>:<call number>``; records each call."""

    def __init__(self, fail_on=None, wrong_count=False, gate=None):
        self.entered = threading.Event()
        self.calls = []
        self.configs = []
        self.fail_on = fail_on
        self.wrong_count = wrong_count
        self.gate = gate
        self.lock = threading.Lock()

    def __call__(self, requests, request_config):
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(timeout=30)
        with self.lock:
            self.calls.append([r.uuid for r in requests])
            self.configs.append(request_config)
            n = len(self.calls)
        if self.fail_on and any(r.uuid == self.fail_on for r in requests):
            raise ValueError(f'engine rejected {self.fail_on}')
        outs = [out(f'{r.uuid}:{n}') for r in requests]
        return outs[:-1] if self.wrong_count else outs


def _text(o):
    return o.response.choices[0].message.content


async def _all(batcher, uuids, config=None):
    return await asyncio.gather(*(batcher([req(u)], config) for u in uuids), return_exceptions=True)


def test_concurrent_calls_are_grouped_up_to_max_batch_size():
    fn = Echo()
    with DynamicBatcher(fn, max_batch_size=4, max_wait_s=5.0) as batcher:
        uuids = [f'r{i}' for i in range(12)]
        results = asyncio.run(_all(batcher, uuids))
    assert batcher.batch_sizes == [4, 4, 4], 'full batches go at once, without waiting for the window'
    assert fn.calls == [uuids[0:4], uuids[4:8], uuids[8:12]], 'first come, first batched'
    for u, res in zip(uuids, results):
        assert len(res) == 1 and _text(res[0]).split(':')[0] == u, 'each caller gets its own output'


def test_a_partial_batch_goes_when_the_window_closes():
    fn = Echo()
    with DynamicBatcher(fn, max_batch_size=8, max_wait_s=0.3) as batcher:
        results = asyncio.run(_all(batcher, ['a', 'b', 'c']))
    assert batcher.batch_sizes == [3]
    assert [_text(r[0]) for r in results] == ['a:1', 'b:1', 'c:1']


def test_requests_queue_while_a_batch_runs_and_go_together_next():
    gate = threading.Event()
    fn = Echo(gate=gate)
    with DynamicBatcher(fn, max_batch_size=16, max_wait_s=0.0) as batcher:
        first = batcher.submit([req('first')])
        assert fn.entered.wait(timeout=30)  # the dispatcher is inside the first batch call now
        later = [batcher.submit([req(f'l{i}')]) for i in range(5)]
        gate.set()
        assert _text(first.result(timeout=30)[0]) == 'first:1'
        assert [_text(f.result(timeout=30)[0]) for f in later] == [f'l{i}:2' for i in range(5)]
    assert batcher.batch_sizes == [1, 5]


def test_a_callers_list_stays_together_and_outputs_are_split_back():
    fn = Echo()
    with DynamicBatcher(fn, max_batch_size=5, max_wait_s=0.5) as batcher:

        async def go():
            return await asyncio.gather(batcher([req('a'), req('b')]), batcher([req('c')]),
                                        batcher([req('d'), req('e'), req('f')]), batcher([]))

        ab, c, d_f, empty = asyncio.run(go())
    assert [_text(o) for o in ab] == ['a:1', 'b:1'] and [_text(o) for o in c] == ['c:1']
    assert [_text(o) for o in d_f] == ['d:2', 'e:2', 'f:2'], 'a list that does not fit waits for the next batch'
    assert empty == [] and batcher.batch_sizes == [3, 3]


def test_a_failing_batch_call_fails_exactly_its_callers():
    fn = Echo(fail_on='bad')
    with DynamicBatcher(fn, max_batch_size=2, max_wait_s=5.0) as batcher:
        results = asyncio.run(_all(batcher, ['a', 'bad', 'c', 'd']))
    assert fn.calls == [['a', 'bad'], ['c', 'd']]
    assert all(isinstance(r, ValueError) and 'engine rejected bad' in str(r) for r in results[:2])
    assert [_text(r[0]) for r in results[2:]] == ['c:2', 'd:2']


def test_a_wrong_number_of_outputs_fails_that_batch():
    fn = Echo(wrong_count=True)
    with DynamicBatcher(fn, max_batch_size=3, max_wait_s=5.0) as batcher:
        results = asyncio.run(_all(batcher, ['a', 'b', 'c']))
    assert all(isinstance(r, RuntimeError) and '2 output(s) for 3 request(s)' in str(r) for r in results)


def test_different_request_configs_never_share_a_batch_call():
    fn = Echo()
    greedy, sampled = {'temperature': 0}, {'temperature': 1}
    with DynamicBatcher(fn, max_batch_size=8, max_wait_s=0.3) as batcher:

        async def go():
            return await asyncio.gather(batcher([req('g1')], greedy), batcher([req('s1')], sampled),
                                        batcher([req('g2')], dict(greedy)), batcher([req('s2')], sampled))

        asyncio.run(go())
    assert sorted(fn.calls) == [['g1', 'g2'], ['s1', 's2']], 'equal configs (even distinct objects) group'
    for call, config in zip(fn.calls, fn.configs):
        assert config == (greedy if call[0].startswith('g') else sampled)


def test_blocking_calls_from_threads_are_grouped():
    fn = Echo()
    barrier = threading.Barrier(8)
    results = {}
    with DynamicBatcher(fn, max_batch_size=8, max_wait_s=2.0) as batcher:

        def worker(i):
            barrier.wait(timeout=30)
            results[i] = batcher.call([req(f't{i}')])

        threads = [threading.Thread(target=worker, args=(i, )) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert batcher.batch_sizes == [8]
    assert {i: _text(r[0]).split(':')[0] for i, r in results.items()} == {i: f't{i}' for i in range(8)}


def test_an_async_batch_function_is_awaited():
    calls = []

    async def batch_fn(requests, config):
        calls.append(len(requests))
        await asyncio.sleep(0)
        return [out(r.uuid) for r in requests]

    with DynamicBatcher(batch_fn, max_batch_size=3, max_wait_s=5.0) as batcher:
        results = asyncio.run(_all(batcher, ['a', 'b', 'c']))
    assert calls == [3] and [_text(r[0]) for r in results] == ['a', 'b', 'c']


def test_a_cancelled_call_is_not_sent():
    fn = Echo()
    with DynamicBatcher(fn, max_batch_size=8, max_wait_s=0.5) as batcher:

        async def go():
            doomed = asyncio.ensure_future(batcher([req('doomed')]))
            kept = asyncio.ensure_future(batcher([req('kept')]))
            await asyncio.sleep(0)
            doomed.cancel()
            return await kept

        assert _text(asyncio.run(go())[0]) == 'kept:1'
    assert fn.calls == [['kept']]


def test_close_fails_waiting_calls_and_refuses_new_ones():
    batcher = DynamicBatcher(Echo(), max_batch_size=8, max_wait_s=60.0)
    waiting = batcher.submit([req('w')])
    batcher.close()
    with pytest.raises(BatcherClosed):
        waiting.result(timeout=30)
    with pytest.raises(BatcherClosed):
        batcher.submit([req('late')])
    batcher.close()  # twice is fine


def test_bad_options():
    with pytest.raises(ValueError, match='max_batch_size'):
        DynamicBatcher(Echo(), max_batch_size=0)
    with pytest.raises(ValueError, match='max_wait_s'):
        DynamicBatcher(Echo(), max_wait_s=-1)
    with pytest.raises(TypeError, match='callable'):
        DynamicBatcher(None)


@pytest.mark.hf
def test_the_hf_backend_in_async_mode_gets_a_batcher_with_the_same_outputs():
    pytest.importorskip('torch')
    from mtflow import RequestConfig
    from mtflow.backends.hf import HFBackend
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    backend = HFBackend(make_model(tok, seed=2), tok, max_batch_size=4)
    config = RequestConfig(temperature=0, max_tokens=5, logprobs=True)
    requests = [req(f'q{i}', {'role': 'user', 'content': f'guess {i}' * (i + 1)}) for i in range(6)]
    want = backend(requests[:4], config) + backend(requests[4:], config)  # the batches the batcher makes
    rollout_fn = backend.async_rollout_fn(max_wait_s=5.0)
    assert isinstance(rollout_fn, DynamicBatcher) and rollout_fn.max_batch_size == 4

    async def go():
        return await asyncio.wait_for(asyncio.gather(*(rollout_fn([r], config) for r in requests)), timeout=300)

    with rollout_fn:
        got = asyncio.run(go())
    assert rollout_fn.batch_sizes == [4, 2]
    for g, w in zip(got, want):
        assert g[0].response.choices[0].token_ids == w.response.choices[0].token_ids
        assert [i['logprob'] for i in g[0].response.choices[0].logprobs['content']] == pytest.approx(
            [i['logprob'] for i in w.response.choices[0].logprobs['content']], abs=1e-4)
    assert backend.stats.calls == 4 and backend.stats.requests == 12


# ---- coalescing the requests of the last batch as they come back (issue 29) ------------------------
def _play(batcher, uuids, turns, stagger_s=0.0, drop=()):
    """Each uuid in its own thread: ``turns`` blocking calls, the k-th request sleeping ``k *
    stagger_s`` before each (a driver applying outputs one after another); a uuid in ``drop``
    stops after its first turn (it finished)."""
    import time

    def player(k, u):
        for turn in range(turns):
            if turn and u in drop:
                return
            time.sleep(k * stagger_s)
            batcher.call([req(u)])

    threads = [threading.Thread(target=player, args=(k, u)) for k, u in enumerate(uuids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)


def test_requests_coming_back_one_after_another_go_as_one_batch():
    """The returners arrive 30 ms apart; with a plain 0-ms window the first would go alone (the
    case that made async mode slower than lockstep on vllm.LLM)."""
    fn = Echo()
    with DynamicBatcher(fn, max_batch_size=8, max_wait_s=5.0, settle_s=5.0, max_delay_s=60.0) as first_turn:
        _play(first_turn, ['a', 'b', 'c', 'd'], turns=1)
    assert first_turn.batch_sizes == [4]
    fn = Echo()
    with DynamicBatcher(fn, max_batch_size=8, max_wait_s=0.0, settle_s=5.0, max_delay_s=60.0) as batcher:
        batcher.call([req('a'), req('b'), req('c'), req('d')])  # turn 1, one call
        _play(batcher, ['a', 'b', 'c', 'd'], turns=1, stagger_s=0.03)
    assert batcher.batch_sizes == [4, 4], 'all four came back: one call, although the window is 0 ms'
    assert len(batcher.return_lags_s) == 4 and max(batcher.return_lags_s) >= 0.09 - 0.01


def test_a_request_that_does_not_come_back_is_waited_for_only_a_quiet_gap():
    fn = Echo()
    with DynamicBatcher(fn, max_batch_size=8, max_wait_s=0.0, settle_s=2.0, max_delay_s=60.0) as batcher:
        batcher.call([req('a'), req('b'), req('gone')])
        _play(batcher, ['a', 'b'], turns=1)  # 'gone' finished: the batch goes after 2 s of quiet
    assert batcher.batch_sizes == [3, 2]


def test_max_delay_caps_the_wait_for_the_last_batch():
    fn = Echo()
    with DynamicBatcher(fn, max_batch_size=8, max_wait_s=0.0, settle_s=600.0, max_delay_s=0.2) as batcher:
        batcher.call([req('a'), req('gone')])
        fut = batcher.submit([req('a')])
        assert _text(fut.result(timeout=30)[0]) == 'a:2', 'the oldest waits max_delay_s, not settle_s'
    assert batcher.batch_sizes == [2, 1]


def test_a_request_queued_behind_a_running_batch_waits_for_that_batchs_requests():
    """'b' queued while 'a''s call ran, for longer than max_delay_s; when that call returns, 'b'
    still waits for 'a' to come back (the delay counts from the engine becoming free). Counted from
    b's arrival it went alone, and the two cohorts alternated for the whole run on vllm.LLM."""
    fn = Echo(gate=threading.Event())
    with DynamicBatcher(fn, max_batch_size=8, max_wait_s=0.0, settle_s=5.0, max_delay_s=1.0) as batcher:
        first = batcher.submit([req('a')])
        assert fn.entered.wait(timeout=30)
        queued = batcher.submit([req('b')])
        time.sleep(1.5)  # longer than max_delay_s, while 'a''s call runs
        fn.gate.set()
        first.result(timeout=30)
        back = batcher.submit([req('a')])
        assert [_text(back.result(timeout=30)[0]), _text(queued.result(timeout=30)[0])] == ['a:2', 'b:2']
    assert batcher.batch_sizes == [1, 2]


def test_when_all_came_back_the_batch_goes_without_waiting_for_the_gap():
    fn = Echo()
    with DynamicBatcher(fn, max_batch_size=8, max_wait_s=600.0, settle_s=600.0, max_delay_s=600.0) as batcher:
        batcher.submit([req('a')])
        batcher.submit([req('b')])
        first = batcher.submit([req('c')])
        with pytest.raises(Exception):  # nothing expected back yet: the 600 s window holds them
            first.result(timeout=0.3)
        batcher.max_wait_s = 0.0  # let turn 1 go now
        with batcher._cond:
            batcher._cond.notify_all()
        first.result(timeout=30)
        futs = [batcher.submit([req(u)]) for u in 'abc']
        assert [_text(f.result(timeout=30)[0]) for f in futs] == ['a:2', 'b:2', 'c:2']
    assert batcher.batch_sizes == [3, 3]


def test_settle_fraction_caps_the_wait_for_the_last_batch_at_a_share_of_its_time():
    """Sessions that come back late (the gateway's): 'b' queued while 'a' and 'gone' ran for about a
    second; 'a' comes back, 'gone' never does. With a quiet gap of 600 s the batch would wait for
    max_delay_s; settle_fraction=0.5 lets it go after half the last call's time, with 'a' in it."""
    fn = Echo(gate=threading.Event())
    with DynamicBatcher(fn, max_batch_size=8, max_wait_s=0.0, settle_s=600.0, max_delay_s=600.0,
                        settle_fraction=0.5) as batcher:
        first = batcher.submit([req('a'), req('gone')])
        assert fn.entered.wait(timeout=30)
        queued = batcher.submit([req('b')])
        time.sleep(1.0)  # the call runs a second: the wait for its requests is at most half of it
        fn.gate.set()
        first.result(timeout=30)
        back = batcher.submit([req('a')])
        assert [_text(back.result(timeout=30)[0]), _text(queued.result(timeout=30)[0])] == ['a:2', 'b:2']
    assert batcher.batch_sizes == [2, 2]
    with pytest.raises(ValueError, match='settle_fraction'):
        DynamicBatcher(fn, settle_fraction=-1)


def test_settle_fraction_does_not_wait_for_callers_that_come_back_later_than_it_would():
    """Agents that think between calls (their return lags longer than the share of the batch's
    time): a request waiting behind the last batch goes at once, with nothing to wait for."""
    fn = Echo()
    with DynamicBatcher(fn, max_batch_size=8, max_wait_s=0.0, settle_s=600.0, max_delay_s=600.0,
                        settle_fraction=0.5) as batcher:
        batcher.call([req('a')])
        time.sleep(0.3)  # 'a' thinks far longer than its batch call took
        batcher.call([req('a')])  # its lag is recorded when the next batch goes ...
        lone = batcher.submit([req('b')])  # ... and 'a' is expected back, slowly: 'b' does not wait 600 s
        assert _text(lone.result(timeout=30)[0]) == 'b:3'
    assert batcher.batch_sizes == [1, 1, 1] and min(batcher.return_lags_s) >= 0.25
