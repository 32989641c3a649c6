"""The servers' own prefix-cache counters (vLLM v1's ``/metrics``): the Prometheus text parser, and
real test servers on 127.0.0.1 whose simulated cache exports ``vllm:prefix_cache_queries_total``
and ``vllm:prefix_cache_hits_total``, read per replica at the start and the end of a run."""
import json

import pytest

from mtflow.backends.server_metrics import counter_delta, prefix_cache_counters

VLLM_PAGE = '''# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 2.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="qwen"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="qwen"} 500.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="qwen"} 900.0
vllm:prefix_cache_hits_total{engine="1",model_name="qwen"} 100.0 1700000000000
vllm:prefix_cache_hits_created{engine="0",model_name="qwen"} 1.7e9
vllm:gpu_prefix_cache_hit_rate{engine="0"} NaN
'''


def test_the_counters_are_summed_over_engines_and_other_lines_skipped():
    assert prefix_cache_counters(VLLM_PAGE) == (1500.0, 1000.0)
    # the family names without _total (as some exporters write them)
    assert prefix_cache_counters('vllm:prefix_cache_queries 10\nvllm:prefix_cache_hits 4\n') == (10.0, 4.0)
    # vLLM v0, or another engine: no counters
    assert prefix_cache_counters('vllm:gpu_prefix_cache_hit_rate 0.5\n') is None
    assert prefix_cache_counters('<html>not found</html>') is None


def test_the_delta_is_none_when_a_read_failed_or_the_server_restarted():
    assert counter_delta((100.0, 50.0), (300.0, 200.0)) == {'queries': 200, 'hits': 150, 'hit_rate': 0.75}
    assert counter_delta((100.0, 50.0), (100.0, 50.0)) == {'queries': 0, 'hits': 0, 'hit_rate': None}
    assert counter_delta(None, (1.0, 1.0)) is None
    assert counter_delta((100.0, 50.0), (10.0, 5.0)) is None  # counters went back: a restart


pytest.importorskip('httpx')
pytest.importorskip('torch')
pytest.importorskip('transformers')

from tests.backends.chat_server import ChatServer  # noqa: E402
from tests.backends.routing_util import enter, hf, leave, make_servers, rollout, run_cli_over, tok  # noqa: E402,F401


@pytest.mark.hf
def test_the_servers_counters_give_the_hit_rate_when_the_replies_report_none(hf, tok):
    servers = make_servers(hf, 2, report_cached=False)  # vLLM without --enable-prompt-tokens-details
    enter(servers)
    try:
        servers[0].cached_total, servers[0].prompt_total = 7000, 9000  # what the server did before this run
        result, summary, _, _ = rollout(servers, tok, 'sticky_least_loaded', n_requests=4, max_turns=3,
                                        begin_metrics=True)
    finally:
        leave(servers)
    assert result.ok
    assert summary['cached_tokens'] == 0 and summary['hit_rate'] is None  # the replies said nothing
    for row, server in zip(summary['replicas'], servers):
        own = row['server_cache']
        assert own == {'queries': server.prompt_total - (9000 if server is servers[0] else 0),
                       'hits': server.cached_total - (7000 if server is servers[0] else 0),
                       'hit_rate': round(own['hits'] / own['queries'], 4)}
        assert row['served'] == 6 and own['hit_rate'] > 0.5  # turns 2 and 3 hit; turn 1 cannot
    total = summary['server_cache']
    assert total['servers'] == 2 and total['queries'] == sum(r['server_cache']['queries'] for r in summary['replicas'])


@pytest.mark.hf
def test_with_usage_too_the_two_hit_rates_agree_and_a_server_without_metrics_is_none(hf, tok):
    servers = make_servers(hf, 2) + [ChatServer(hf, prefix_cache=False)]
    enter(servers)
    try:
        result, summary, _, _ = rollout(servers, tok, 'sticky_least_loaded', n_requests=3, max_turns=3,
                                        begin_metrics=True)
    finally:
        leave(servers)
    assert result.ok
    rows = summary['replicas']
    for row in rows[:2]:
        assert row['server_cache']['hit_rate'] == row['hit_rate']  # the same simulated cache, two ways
    assert rows[2]['server_cache'] is None  # /metrics answered 404
    assert summary['server_cache']['servers'] == 2


@pytest.mark.hf
def test_mtflow_run_shows_the_servers_hit_rate_per_replica(hf, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv('COLUMNS', '200')  # the summary table's rows on one line each
    servers = make_servers(hf, 2, report_cached=False)
    out = run_cli_over(servers, tmp_path, monkeypatch)
    shown = capsys.readouterr().out
    serving = json.loads((out / 'summary.json').read_text())['serving']
    for row, server in zip(serving['replicas'], servers):
        assert row['server_cache'] == {'queries': server.prompt_total, 'hits': server.cached_total,
                                       'hit_rate': round(server.cached_total / server.prompt_total, 4)}
    assert serving['server_cache']['hit_rate'] > 0.5
    assert "servers' /metrics" in shown and shown.count(', /metrics ') == 2, shown
