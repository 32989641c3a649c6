"""The reward spread of a run, group by group: what GRPO learns from. A group is the requests of
one prompt (``num_generations`` copies, see ``mtflow/data/sources.py``); advantages are rewards
minus the group mean, so a group whose requests all earned the same reward teaches nothing.
``mtflow run`` puts :func:`reward_spread` in ``summary.json`` (``reward_groups``) and prints it."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

__all__ = ['reward_spread', 'spread_rows']

#: groups listed one by one in summary.json (the counts cover all of them)
MAX_LISTED = 64


def reward_spread(groups: Sequence[str], rewards: Sequence[Optional[float]]) -> Optional[Dict[str, Any]]:
    """Per-group reward statistics (``None`` when no request has a numeric reward).

    ``with_spread`` counts groups whose rewards are not all equal (at least two requests);
    ``mean_std`` is the mean over groups of the population standard deviation."""
    by: Dict[str, List[float]] = {}
    for g, r in zip(groups, rewards):
        if isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r):
            by.setdefault(g, []).append(float(r))
    if not by:
        return None
    stats = []
    for g, rs in by.items():
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / len(rs))
        stats.append({'group': g, 'n': len(rs), 'mean': round(mean, 4), 'std': round(std, 4), 'min': round(min(rs), 4),
                      'max': round(max(rs), 4)})
    rewarded = sum(1 for rs in by.values() for r in rs if r > 0)
    total = sum(len(rs) for rs in by.values())
    return {
        'groups': len(stats),
        'group_sizes': sorted({s['n'] for s in stats}),
        'with_spread': sum(1 for s in stats if s['n'] > 1 and s['max'] > s['min']),
        'mean_std': round(sum(s['std'] for s in stats) / len(stats), 4),
        'requests_rewarded': rewarded,
        'requests_scored': total,
        'per_group': stats[:MAX_LISTED],
    }


def spread_rows(spread: Dict[str, Any], shown: int = 6) -> List[tuple]:
    """``(label, text)`` rows for the summary table."""
    sizes = '/'.join(map(str, spread['group_sizes']))
    rows = [('rewarded requests', f"{spread['requests_rewarded']} of {spread['requests_scored']} (reward > 0)")]
    if max(spread['group_sizes']) == 1:
        rows.append(('reward spread', 'one request per prompt: set num_generations for GRPO groups'))
        return rows
    rows.append(('reward spread', f"{spread['with_spread']} of {spread['groups']} groups (size {sizes}) have unequal "
                 f"rewards; mean group std {spread['mean_std']}"))
    parts = [f"{s['group']} {s['mean']:g}±{s['std']:g}" for s in spread['per_group'][:shown]]
    more = spread['groups'] - min(shown, len(spread['per_group']))
    rows.append(('per group (mean±std)', '  '.join(parts) + (f'  (+{more} more in summary.json)' if more else '')))
    return rows
