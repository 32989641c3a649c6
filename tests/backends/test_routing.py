"""Several OpenAI-compatible servers behind one backend: real HTTP servers on 127.0.0.1 (the
test chat server with its simulated prefix cache), a multi-turn workload, and the routing
policies' prefix-cache hit rates; a replica killed mid-run; the router's placement rules."""
import asyncio
import threading

import pytest

pytest.importorskip('httpx')
pytest.importorskip('torch')
pytest.importorskip('transformers')

from mtflow import Executor  # noqa: E402
from mtflow.accounting.token_record import RecordAccounting  # noqa: E402
from mtflow.backends import BackendError  # noqa: E402
from mtflow.backends.openai_server import OpenAIBackend  # noqa: E402
from mtflow.backends.routing import Router  # noqa: E402
from tests.backends.chat_server import ChatServer  # noqa: E402
from tests.backends.routing_util import (CONFIG, GoOn, enter, hf, leave, make_servers, rollout,  # noqa: E402,F401
                                         run_cli_over, task, tok)

pytestmark = pytest.mark.hf


def test_sticky_routing_keeps_the_prefix_cache_and_round_robin_loses_it(hf, tok):
    servers = make_servers(hf, 4)
    enter(servers)
    try:
        result, sticky, logs, _ = rollout(servers, tok, 'sticky_least_loaded')
        assert result.ok and result.finish_reasons == ['max_turns'] * 7
        assert sticky['hit_rate_after_turn_1'] >= 0.9, sticky
        # each request's turns all on one replica; the 7 requests spread over the 4
        placements = {u: {e['replica'] for e in log} for u, log in logs.items()}
        assert all(len(p) == 1 for p in placements.values()), placements
        assert sorted(r['served'] for r in sticky['replicas']) == [5, 10, 10, 10]
        assert all(len(log) == 5 and log[0]['cached_tokens'] < log[1]['cached_tokens'] for log in logs.values())
        # the servers' own counters agree with what the backend recorded
        assert sum(s.cached_total for s in servers) == sticky['cached_tokens']
        for s in servers:
            s.cache.clear()
        _, rr, rr_logs, _ = rollout(servers, tok, 'round_robin')
        assert rr['hit_rate_after_turn_1'] <= 0.35, rr
        assert all(len({e['replica'] for e in log}) > 1 for log in rr_logs.values())
    finally:
        leave(servers)


@pytest.mark.parametrize('http_client', ['httpx', 'aiohttp'])
def test_a_killed_replica_moves_its_requests_and_nothing_is_lost(hf, tok, http_client):
    pytest.importorskip(http_client)
    servers = make_servers(hf, 3)
    enter(servers)
    victim = servers[1]
    turns = {'n': 0}

    class _KillAtTurn2(GoOn):

        def step(self, infer_request, response_choice, current_turn):
            if current_turn == 2 and not victim.dead:
                victim.delay = 0.5  # its next requests are in flight when it dies
                threading.Timer(0.2, victim.kill).start()
            turns['n'] += 1
            return super().step(infer_request, response_choice, current_turn)

    delivered = []
    try:
        with OpenAIBackend(urls=[s.base_url for s in servers], tokenizer=tok, backoff=0.01, model='tiny-qwen2',
                           health_interval_s=0.2, http_client=http_client) as client:
            result = Executor(_KillAtTurn2(), client, CONFIG, max_turns=4, accounting=RecordAccounting(),
                              on_finished=lambda f: delivered.append(f.uuid)).run([task(i) for i in range(6)])
            summary = client.serving_summary()
            logs = {f'r{i}': client.serving(f'r{i}') for i in range(6)}
    finally:
        leave(servers)
    assert victim.dead
    assert result.ok and result.finish_reasons == ['max_turns'] * 6
    assert sorted(delivered) == sorted(f'r{i}' for i in range(6)), 'every trajectory exactly once'
    moved = [e for log in logs.values() for e in log if e.get('moves')]
    assert moved and summary['moves'] == sum(len(e['moves']) for e in moved)
    assert all(m['from'] == 1 for e in moved for m in e['moves'])
    assert not summary['replicas'][1]['healthy']
    # after the kill nothing more lands on the dead replica, and the moved requests stick to their new one
    for log in logs.values():
        after = [e['replica'] for e in log[3:]]
        assert 1 not in after
    assert all(len(log) == 4 for log in logs.values())


def test_weight_version_goes_to_the_server_as_cache_salt(hf, tok):
    with ChatServer(hf) as server:
        with OpenAIBackend(urls=[server.base_url], tokenizer=tok, model='tiny-qwen2', weight_version=3) as client:
            client([task(0)], CONFIG)
            client.set_weight_version(4)
            client([task(1)], CONFIG)
    assert [b['cache_salt'] for b in server.bodies] == ['weights-3', 'weights-4']


def test_urls_must_be_a_list_and_the_policy_known():
    with pytest.raises(BackendError, match='urls must be a list'):
        OpenAIBackend(urls='http://127.0.0.1:1/v1', model='m')
    with pytest.raises(BackendError, match='routing must be one of sticky_least_loaded'):
        OpenAIBackend(urls=['http://127.0.0.1:1/v1'], routing='random', model='m')
    with pytest.raises(BackendError, match='lists a server twice'):
        OpenAIBackend(urls=['http://a/v1', 'http://a/v1/'], model='m')


# ---- the router alone ------------------------------------------------------------------------------
def _place(router, keys):
    """Acquire and release one slot per key (as one turn of requests that finish in order)."""

    async def go():
        got = []
        for k in keys:
            r = await router.acquire(k)
            got.append(r.index)
        for r in router.replicas:
            for _ in range(r.in_flight):
                await router.release(r)
        return got

    return asyncio.run(go())


def test_sticky_keeps_a_key_on_its_replica_until_it_is_down_or_the_weights_change():
    router = Router(['http://a', 'http://b', 'http://c'])
    first = _place(router, ['x', 'y', 'z'])
    assert sorted(first) == [0, 1, 2], 'new keys go to the least loaded'
    assert _place(router, ['z', 'y', 'x']) == first[::-1]
    router.mark_down(router.replicas[first[0]])
    again = _place(router, ['x', 'y', 'z'])
    assert again[0] != first[0] and again[1:] == first[1:]
    router.mark_up(router.replicas[first[0]])
    assert _place(router, ['x'])[0] == again[0], 'x stays where it moved'
    router.set_weight_version(2)
    assert router._sticky == {}


def test_consistent_hash_is_stable_and_moves_only_a_dead_replicas_keys():
    keys = [f'k{i}' for i in range(200)]
    router = Router([f'http://s{i}' for i in range(4)], 'consistent_hash')
    base = _place(router, keys)
    assert _place(router, keys) == base
    assert min(base.count(i) for i in range(4)) > 20, 'the ring spreads the keys'
    router.mark_down(router.replicas[2])
    moved = _place(router, keys)
    assert all(m == b for m, b in zip(moved, base) if b != 2) and 2 not in moved
    router.set_weight_version('v2')
    assert _place(router, keys) != base, 'a new weight version salts the hash'


def test_a_full_fleet_queues_instead_of_failing():
    router = Router(['http://a', 'http://b'], 'least_loaded', max_in_flight=1)

    async def go():
        a = await router.acquire('p')
        b = await router.acquire('q')
        waiter = asyncio.ensure_future(router.acquire('r'))
        await asyncio.sleep(0.01)
        assert not waiter.done() and router.queued == 1
        await router.release(a)
        got = await asyncio.wait_for(waiter, 1)
        return a, b, got

    a, b, got = asyncio.run(go())
    assert got is a and b.in_flight == 1


def test_mtflow_run_writes_the_serving_log_into_the_trace_and_the_hit_rates_into_the_summary(
        hf, tmp_path, monkeypatch, capsys):
    import json

    out = run_cli_over(make_servers(hf, 2), tmp_path, monkeypatch)
    shown = capsys.readouterr().out
    assert 'sticky_least_loaded' in shown and 'prefix cache hit' in shown
    summary = json.loads((out / 'summary.json').read_text())
    serving = summary['serving']
    assert serving['policy'] == 'sticky_least_loaded' and [r['served'] for r in serving['replicas']] == [6, 6]
    assert serving['hit_rate_after_turn_1'] >= 0.9
    events = [json.loads(line) for line in (out / 'trace.jsonl').read_text().splitlines()]
    served = [e for e in events if (e.get('extra') or {}).get('serving')]
    assert len(served) == 12 and all(e['from'] == 'generating' for e in served)
    for uuid in (f'p{i}' for i in range(4)):
        mine = sorted((e['turn'], e['extra']['serving']) for e in served if e['uuid'] == uuid)
        assert [t for t, _ in mine] == [1, 2, 3] and len({s['replica'] for _, s in mine}) == 1
        assert mine[0][1]['cached_tokens'] < mine[1][1]['cached_tokens'] < mine[2][1]['cached_tokens']


@pytest.mark.slow
def test_mtflow_run_ray_merges_the_actors_serving_figures(hf, tmp_path, monkeypatch, capsys):
    """Under --ray each actor routes its own requests: the summary's serving block is their sum,
    per server, with the hit rates recomputed from the summed tokens."""
    import json

    pytest.importorskip('ray')
    out = run_cli_over(make_servers(hf, 2), tmp_path, monkeypatch, ray=2)
    shown = capsys.readouterr().out
    flat = ' '.join(shown.replace('│', ' ').split())  # the table's cells wrap
    assert 'prefix cache hit' in shown and 'rebalanced off a backlog; 2 actors summed' in flat
    summary = json.loads((out / 'summary.json').read_text())
    serving = summary['serving']
    assert serving['actors'] == 2 and serving['policy'] == 'sticky_least_loaded'
    assert sum(r['served'] for r in serving['replicas']) == 12  # 4 requests x 3 turns, each counted once
    rows = serving['replicas']
    assert serving['prompt_tokens'] == sum(r['prompt_tokens'] for r in rows) > 0
    assert serving['hit_rate'] == round(serving['cached_tokens'] / serving['prompt_tokens'], 4)
    assert serving['hit_rate_after_turn_1'] >= 0.9  # each actor keeps its conversations where their cache is
    events = [json.loads(line) for line in (out / 'trace.jsonl').read_text().splitlines()]
    assert sum(1 for e in events if (e.get('extra') or {}).get('serving')) == 12


def test_a_backend_mapping_is_kind_plus_backend_options(tmp_path):
    from mtflow.run.config import RunConfigError, load_run_config

    path = tmp_path / 'c.yaml'
    path.write_text('scheduler: s.yaml\nbackend: {kind: openai, urls: [http://a/v1, http://b/v1]}\n'
                    'backend_options: {timeout: 5}\n')
    cfg = load_run_config(path)
    assert cfg.backend == 'openai' and cfg.backend_options == {'timeout': 5, 'urls': ['http://a/v1', 'http://b/v1']}
    path.write_text('scheduler: s.yaml\nbackend: {urls: [http://a/v1]}\n')
    with pytest.raises(RunConfigError, match=r'c.yaml.*a mapping needs kind'):
        load_run_config(path)
    path.write_text('scheduler: s.yaml\nbackend: {kind: openai, timeout: 3}\nbackend_options: {timeout: 5}\n')
    with pytest.raises(RunConfigError, match='timeout given both under backend and in backend_options'):
        load_run_config(path)


def test_a_slow_replica_times_out_and_its_request_moves(hf, tok):
    servers = make_servers(hf, 2)
    enter(servers)
    servers[0].delay = 8.0  # answers far too late
    try:
        with OpenAIBackend(urls=[s.base_url for s in servers], tokenizer=tok, backoff=0.01, model='tiny-qwen2',
                           timeout=2.0, routing='round_robin', health_interval_s=0) as client:
            outs = client([task(0), task(1)], CONFIG)
            summary = client.serving_summary()
            logs = [client.serving('r0'), client.serving('r1')]
    finally:
        leave(servers)
    assert len(outs) == 2 and all(o.response.choices[0].token_ids for o in outs)
    assert summary['moves'] == 1 and summary['replicas'][0]['healthy'], 'slow is not dead'
    moved = [log[0] for log in logs if log[0].get('moves')]
    assert len(moved) == 1 and moved[0]['replica'] == 1 and 'timed out after 2.0 s' in moved[0]['moves'][0]['reason']


def _run(coro):
    return asyncio.run(coro)


def test_a_full_fleet_keeps_a_turn_waiting_for_the_replica_that_holds_its_cache():
    """Every replica full: x's next turn waits for x's replica, not for whichever slot frees first
    (that spread turns over the fleet by load, losing the cache)."""
    router = Router(['http://a', 'http://b'], max_in_flight=1)

    async def go():
        ra = await router.acquire('x')
        rb = await router.acquire('y')
        assert (ra.index, rb.index) == (0, 1)
        x_next = asyncio.ensure_future(router.acquire('x'))
        await asyncio.sleep(0)
        await router.release(rb)  # b frees first: x does not take it
        await asyncio.sleep(0)
        assert not x_next.done() and rb.in_flight == 0
        y_next = await router.acquire('y')  # y's own replica is free: no wait
        await router.release(ra)
        got = await asyncio.wait_for(x_next, 1)
        return got, y_next

    got, y_next = _run(go())
    assert got.index == 0 and y_next.index == 1 and router.rebalanced == 0 and router.queued == 1


def test_a_backlog_past_the_slack_moves_to_a_free_replica_and_is_counted():
    router = Router(['http://a', 'http://b'], max_in_flight=1, sticky_slack=1)

    async def go():
        ra = await router.acquire('x')
        rb = await router.acquire('y')
        router._sticky.update(p=0, q=0)  # two more conversations whose cache is on a
        p = asyncio.ensure_future(router.acquire('p'))
        q = asyncio.ensure_future(router.acquire('q'))
        x = asyncio.ensure_future(router.acquire('x'))
        await asyncio.sleep(0)
        assert [len(w) for w in router._waiting] == [3, 0]
        await router.release(rb)  # b's own queue and the shared one are empty: it takes a's oldest
        first = await asyncio.wait_for(p, 1)
        await router.release(ra)  # a serves its own queue: q
        second = await asyncio.wait_for(q, 1)
        return first, second, x

    first, second, x = _run(go())
    assert first.index == 1 and second.index == 0 and router.rebalanced == 1
    assert router._sticky['p'] == 1, 'the moved conversation now sticks to where its cache is'


def test_a_cancelled_waiter_leaves_the_queue_and_a_downed_replicas_waiters_move():
    router = Router(['http://a', 'http://b'], max_in_flight=1)

    async def go():
        ra = await router.acquire('x')
        await router.acquire('y')
        gone = asyncio.ensure_future(router.acquire('x'))
        stays = asyncio.ensure_future(router.acquire('x'))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        assert len(router._waiting[0]) == 1
        router.mark_down(ra)  # a dies: its waiter goes to the shared queue, for b
        await asyncio.sleep(0)
        assert not stays.done() and len(router._shared) == 1
        await router.release(router.replicas[1])
        return await asyncio.wait_for(stays, 1)

    assert _run(go()).index == 1
    assert router.replicas[1].in_flight == 1
