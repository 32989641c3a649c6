"""The prefix-cache counters an engine server exports on ``GET /metrics`` (Prometheus text).

vLLM v1 counts, per engine, the prompt tokens it looked up in its prefix cache and the ones it
found there: ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total`` (counters,
in tokens, labelled ``engine`` and ``model_name``). The usage-based hit rate
(``usage.prompt_tokens_details.cached_tokens``) needs ``--enable-prompt-tokens-details`` and some
builds answer ``null`` there; the counters are always exported, so mtflow reads them per server at
the start and the end of a run and reports the difference beside the usage-based figure
(:meth:`mtflow.backends.openai_server.OpenAIBackend.begin_server_metrics`).

The parser reads the text exposition format's sample lines (``name{labels} value [timestamp]``)
and sums a metric over its label sets (several engines behind one server). It is a few lines
because two counters are all it needs; ``prometheus_client``'s parser reads the same format.
"""
from __future__ import annotations

import asyncio
import math
import re
from typing import Any, Dict, Iterable, List, Optional, Tuple

from mtflow.backends.http_client import TimedOut, Unreachable

__all__ = ['QUERIES', 'HITS', 'parse_samples', 'prefix_cache_counters', 'counter_delta', 'ServerMetrics']

#: the counters' sample names (vLLM v1); the family names without ``_total`` are accepted too
QUERIES = 'vllm:prefix_cache_queries_total'
HITS = 'vllm:prefix_cache_hits_total'

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?\s*$')


def parse_samples(text: str, names: Iterable[str]) -> Dict[str, float]:
    """The sum over label sets of each sample in ``names`` that ``text`` has (comments, other
    metrics and unparsable lines are skipped; ``NaN`` samples are left out)."""
    wanted = set(names)
    sums: Dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith('#'):
            continue
        m = _SAMPLE.match(line.strip())
        if m is None or m.group(1) not in wanted:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isnan(value):
            continue
        sums[m.group(1)] = sums.get(m.group(1), 0.0) + value
    return sums


def prefix_cache_counters(text: str) -> Optional[Tuple[float, float]]:
    """``(queries, hits)`` in tokens from a ``/metrics`` page, or ``None`` when the server exports
    no prefix-cache counters (another engine, or vLLM v0)."""
    family = {QUERIES: QUERIES, HITS: HITS, QUERIES[:-len('_total')]: QUERIES, HITS[:-len('_total')]: HITS}
    raw = parse_samples(text, family)
    sums: Dict[str, float] = {}
    for name, value in raw.items():
        sums[family[name]] = sums.get(family[name], 0.0) + value
    if QUERIES not in sums or HITS not in sums:
        return None
    return sums[QUERIES], sums[HITS]


def counter_delta(start: Optional[Tuple[float, float]], end: Optional[Tuple[float, float]]) -> Optional[Dict[str, float]]:
    """The counters' growth between two reads as ``{queries, hits, hit_rate}``; ``None`` when
    either read failed or a counter went back (the server restarted in between)."""
    if start is None or end is None:
        return None
    queries, hits = end[0] - start[0], end[1] - start[1]
    if queries < 0 or hits < 0:
        return None
    return {'queries': int(queries), 'hits': int(hits),
            'hit_rate': round(hits / queries, 4) if queries else None}


class ServerMetrics:
    """The OpenAI backend's server-counter methods, a mixin of
    :class:`~mtflow.backends.openai_server.OpenAIBackend` (it uses the backend's ``_runner``,
    ``_client``, ``_ensure_client()``, ``router`` and ``timeout``)."""

    #: the servers' prefix-cache counters at begin_server_metrics and end_server_metrics
    _metrics_start: Optional[List[Optional[Tuple[float, float]]]] = None
    _metrics_end: Optional[List[Optional[Tuple[float, float]]]] = None
    _runner: Any
    _client: Any
    router: Any
    timeout: float

    def begin_server_metrics(self) -> None:
        """Read every server's prefix-cache counters (``GET /metrics``,
        :mod:`mtflow.backends.server_metrics`) now: :meth:`serving_summary` then reports how much
        they grew since, per server, beside the usage-based hit rate (``mtflow run`` calls this
        when the run starts)."""
        if self._runner is not None:
            self._metrics_start, self._metrics_end = self._runner.run(self._read_metrics()), None

    def end_server_metrics(self) -> None:
        """Read the counters again at the end of the run (the summary may be built after
        :meth:`close`); without this call :meth:`serving_summary` reads them when it is called."""
        if self._runner is not None and self._metrics_start is not None:
            self._metrics_end = self._runner.run(self._read_metrics())

    async def _read_metrics(self) -> List[Optional[Tuple[float, float]]]:
        await self._ensure_client()

        async def one(replica: Any) -> Optional[Tuple[float, float]]:
            root = replica.url[:-len('/v1')] if replica.url.endswith('/v1') else replica.url
            try:
                resp = await self._client.request('GET', root + '/metrics', None, timeout=min(self.timeout, 5.0))
            except (TimedOut, Unreachable):
                return None
            return prefix_cache_counters(resp.text) if resp.status_code == 200 else None

        return list(await asyncio.gather(*(one(r) for r in self.router.replicas)))

    def serving_summary(self) -> Dict[str, Any]:
        """Per replica and overall: served requests, moves, prefix-cache hit rates (from the
        replies' usage, and from the servers' ``/metrics`` counters since
        :meth:`begin_server_metrics`, as ``server_cache``)."""
        summary = self.router.summary()
        start, end = self._metrics_start, self._metrics_end
        if start is None or (end is None and self._runner is None):
            return summary
        if end is None:
            end = self._runner.run(self._read_metrics())
        deltas = [counter_delta(a, b) for a, b in zip(start, end)]
        for row, delta in zip(summary['replicas'], deltas):
            row['server_cache'] = delta
        known = [d for d in deltas if d is not None]
        if known:
            queries, hits = sum(d['queries'] for d in known), sum(d['hits'] for d in known)
            summary['server_cache'] = {'queries': queries, 'hits': hits, 'servers': len(known),
                                       'hit_rate': round(hits / queries, 4) if queries else None}
        else:
            summary['server_cache'] = None
        return summary
