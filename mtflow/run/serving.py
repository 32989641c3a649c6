"""What a backend with several servers (``backend_options: {urls: [...]}``) tells the run
directory: each request's serving log goes into its trace, the router's figures into the summary.

The engine knows nothing of replicas; the backend keeps one entry per turn of each request
(:mod:`mtflow.backends.routing`). When a request finishes, :func:`annotate` puts turn t's entry
under ``extra.serving`` of the event that applied turn t's output (the one leaving
``generating`` or ``continuing`` at turn t), so ``mtflow trace show`` and any reader of
``trace.jsonl`` see which replica served the turn, its prompt and cached prompt tokens, and the
moves off a failing replica. A backend whose ``serving(uuid)`` reports nothing (``mtflow.backends.base.Reports``) leaves the
events as they are.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from mtflow.backends.base import reports_of
from mtflow.backends.routing import hit_rate

__all__ = ['annotate', 'begin_server_metrics', 'end_server_metrics', 'serving_figures', 'merged_serving', 'serving_rows',
           'admission_figures', 'admission_rows']

_OUTPUT_STATES = ('generating', 'continuing')


def annotate(backend: Any, uuid: str, events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``events`` (dicts, changed in place and returned) with the backend's serving log of
    ``uuid`` merged in, one entry per turn."""
    entries = reports_of(backend).serving(uuid)
    if not entries:
        return events
    by_turn = {}
    for e in events:
        if e.get('from') in _OUTPUT_STATES and e.get('turn') not in by_turn:
            by_turn[e.get('turn')] = e
    for turn, entry in enumerate(entries, start=1):
        event = by_turn.get(turn)
        if event is not None:
            event['extra'] = {**(event.get('extra') or {}), 'serving': entry}
    return events


def begin_server_metrics(backend: Any) -> None:
    """Read the servers' prefix-cache counters at the start of a run (a backend with
    ``begin_server_metrics``: the OpenAI backend), so the summary reports their growth."""
    reports_of(backend).begin_server_metrics()


def end_server_metrics(backend: Any) -> None:
    """Read them again when the rollout ends (before the backend closes)."""
    try:
        reports_of(backend).end_server_metrics()
    except Exception:  # the figures are informational: a failed read never fails the run
        pass


def serving_figures(backend: Any) -> Optional[Dict[str, Any]]:
    """The router's figures for ``summary.json`` (``None`` for a backend without one)."""
    return reports_of(backend).serving_summary()


def merged_serving(summaries: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """One ``serving`` block from several backends' (the Ray actors of ``mtflow run --ray``, each
    routing its own requests over the same servers): per server URL, the counts summed and the
    hit rates recomputed from the summed tokens; a server is healthy when every actor last saw
    it so; ``peak_in_flight`` is the sum of the actors' peaks (a bound on the server's own)."""
    summaries = [s for s in summaries if s]
    if not summaries:
        return None
    counts = ('served', 'failures', 'peak_in_flight', 'prompt_tokens', 'cached_tokens', 'later_prompt_tokens',
              'later_cached_tokens')
    by_url: Dict[str, Dict[str, Any]] = {}
    for summary in summaries:
        for row in summary['replicas']:
            limit = row.get('max_in_flight')  # each actor's bound on the server: the same config everywhere
            into = by_url.setdefault(row['url'], {'url': row['url'], 'healthy': True, **{k: 0 for k in counts},
                                                  'max_in_flight': None if limit is None else limit * len(summaries)})
            for k in counts:
                into[k] += row.get(k) or 0
            into['healthy'] = into['healthy'] and row['healthy']
    rows = list(by_url.values())
    for row in rows:
        row['hit_rate'] = hit_rate(row['cached_tokens'], row['prompt_tokens'])
        row['hit_rate_after_turn_1'] = hit_rate(row['later_cached_tokens'], row['later_prompt_tokens'])
    total = {k: sum(r[k] for r in rows) for k in ('prompt_tokens', 'cached_tokens', 'later_prompt_tokens',
                                                     'later_cached_tokens')}
    return {'policy': summaries[0]['policy'], 'replicas': rows, 'actors': len(summaries),
            **{k: sum(s.get(k) or 0 for s in summaries) for k in ('moves', 'queued', 'rebalanced')},
            'queued_s': round(sum(s.get('queued_s') or 0.0 for s in summaries), 4),
            'weight_version': summaries[0].get('weight_version'), **total,
            'hit_rate': hit_rate(total['cached_tokens'], total['prompt_tokens']),
            'hit_rate_after_turn_1': hit_rate(total['later_cached_tokens'], total['later_prompt_tokens'])}


def serving_rows(figures: Optional[Dict[str, Any]]) -> List[tuple]:
    """The summary table's rows: the overall hit rate and moves, then one row per replica
    (only for several servers, or when the server reported cached tokens)."""
    if not figures or (len(figures['replicas']) < 2 and not figures['cached_tokens']
                       and not figures.get('server_cache')):
        return []
    rows = [('routing', f"{figures['policy']}, {figures['moves']} moved off a failing server, "
             f"{figures['queued']} queued for capacity, {figures.get('rebalanced', 0)} rebalanced off a "
             f"backlog" + (f"; {figures['actors']} actors summed" if figures.get('actors') else ''))]
    server = figures.get('server_cache')
    rows.append(('prefix cache hit', f"{_pct(figures['hit_rate'])} of prompt tokens "
                 f"({_pct(figures['hit_rate_after_turn_1'])} after turn 1)"
                 + (f"; servers' /metrics {_pct(server['hit_rate'])}" if server else '')))
    for i, r in enumerate(figures['replicas']):
        state = '' if r['healthy'] else ', down'
        own = r.get('server_cache')
        metrics = f", /metrics {_pct(own['hit_rate'])}" if own else ''
        rows.append((f'  server {i}', f"{r['url']}: {r['served']} served, hit {_pct(r['hit_rate'])}{metrics}{state}"))
    return rows


def _pct(value: Optional[float]) -> str:
    return 'n/a' if value is None else f'{100 * value:.1f}%'


def admission_figures(gates: Optional[Dict[str, Any]], serving: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The ``admission`` block of ``summary.json``: the run's gates (tool calls, environment
    sessions: limit, peak in flight, how many waited and for how long) and, for a backend with a
    router, the model requests per replica (``max_in_flight_per_replica``, peak, time queued).
    ``None`` when the run config has no ``admission:`` block."""
    if gates is None:
        return None
    block = dict(gates)
    if serving:
        block['model'] = {'queued': serving.get('queued', 0), 'queued_s': serving.get('queued_s', 0.0),
                          'replicas': [{'url': r['url'], 'limit': r.get('max_in_flight'),
                                        'peak': r.get('peak_in_flight')} for r in serving['replicas']]}
    return block


def admission_rows(block: Optional[Dict[str, Any]]) -> List[tuple]:
    """The summary table's rows of the admission block: one per resource."""
    if not block:
        return []
    rows = []
    for name in ('tool_calls', 'env_sessions'):
        g = block.get(name)
        if g and g.get('entered'):
            limit = 'no bound' if g['limit'] is None else f"bound {g['limit']}"
            rows.append((f"admission: {name.replace('_', ' ')}", f"peak {g['peak']} in flight ({limit}), "
                         f"{g['queued']} queued for {g['queued_s']:.2f} s"))
    model = block.get('model')
    if model:
        peaks = ', '.join(f"{r['peak']}/{r['limit'] if r['limit'] is not None else '-'}" for r in model['replicas'])
        rows.append(('admission: model', f"peak/bound per server {peaks}, {model['queued']} queued for "
                     f"{model['queued_s']:.2f} s"))
    return rows
