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

import math
import re
from typing import Dict, Iterable, Optional, Tuple

__all__ = ['QUERIES', 'HITS', 'parse_samples', 'prefix_cache_counters', 'counter_delta']

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
