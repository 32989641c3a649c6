"""What a colocated engine tells the run summary about itself: the settings the backend chose at
load (``backend.load_info``: dtype, prefix-cache block size, and why) and the prefix cache's hit
rate from the engine's own counters (``backend.prefix_cache_summary()``, the vLLM backend: each
output's ``num_cached_tokens``). A block of its own, beside the serving block of several servers
(:mod:`mtflow.run.serving`), read the same way (``mtflow.backends.base.Reports``): a backend
that reports neither shows nothing.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from mtflow.backends.base import reports_of

__all__ = ['engine_settings', 'prefix_cache_figures', 'engine_rows']


def engine_settings(backend: Any) -> Optional[Dict[str, Any]]:
    """The dtype and block size the backend's engine runs with, and where each came from."""
    info = reports_of(backend).load_info or {}
    keys = ('device', 'dtype', 'dtype_why', 'block_size', 'block_size_why')
    settings = {k: info[k] for k in keys if k in info}
    return settings if settings.get('dtype') or settings.get('block_size') else None


def prefix_cache_figures(backend: Any) -> Optional[Dict[str, Any]]:
    """The engine's prefix-cache figures (``None`` for a backend that does not count them)."""
    return reports_of(backend).prefix_cache_summary()


def engine_rows(settings: Optional[Dict[str, Any]], cache: Optional[Dict[str, Any]]) -> List[Tuple[str, str]]:
    """The summary table's rows for :func:`engine_settings` and :func:`prefix_cache_figures`."""
    rows = []
    if settings:
        parts = []
        if settings.get('dtype'):
            parts.append(f"dtype {settings['dtype']} ({settings.get('dtype_why')})")
        if settings.get('block_size'):
            parts.append(f"block_size {settings['block_size']} ({settings.get('block_size_why')})")
        if parts:
            rows.append(('engine', ', '.join(parts)))
    if cache:
        block = f", block_size {cache['block_size']}" if cache.get('block_size') else ''
        rows.append(('engine prefix cache', f"{_pct(cache['hit_rate'])} of {cache['prompt_tokens']} prompt tokens "
                     f"({_pct(cache['hit_rate_after_turn_1'])} after turn 1{block})"))
    return rows


def _pct(value: Optional[float]) -> str:
    return 'n/a' if value is None else f'{100 * value:.1f}%'
