"""The reward spread of a run, group by group: what GRPO learns from. A group is the requests of
one prompt (``num_generations`` copies, see ``mtflow/data/sources.py``); advantages are rewards
minus the group mean, so a group whose requests all earned the same reward teaches nothing.
``mtflow run`` feeds a :class:`GroupRewards` through its run tally (``mtflow/run/tally.py``), puts
its summary in ``summary.json`` (``reward_groups``) and prints :func:`spread_rows`."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

__all__ = ['GroupRewards', 'reward_spread', 'spread_rows']

#: groups listed one by one in summary.json (the counts cover all of them)
MAX_LISTED = 64


def _is_reward(r: Any) -> bool:
    return isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)


class GroupRewards:
    """Running per-group reward sums: ``group -> [n, sum, sum of squares, min, max, first
    position]``, fed one finished request at a time (``mtflow.run.tally.RunTally`` feeds it from
    each trajectory written, and again from the files on ``--resume``). A few numbers per group,
    never the rewards themselves; the groups are listed in dataset order (first position)."""

    def __init__(self) -> None:
        self.by: Dict[str, List[float]] = {}
        self.positive = 0  # requests with reward > 0

    def add(self, group: str, reward: Any, position: Optional[int] = None) -> None:
        if not _is_reward(reward):
            return
        r = float(reward)
        self.positive += r > 0
        pos = float('inf') if position is None else position
        g = self.by.get(group)
        if g is None:
            self.by[group] = [1, r, r * r, r, r, pos]
            return
        g[0] += 1
        g[1] += r
        g[2] += r * r
        g[3] = min(g[3], r)
        g[4] = max(g[4], r)
        g[5] = min(g[5], pos)

    def summary(self) -> Optional[Dict[str, Any]]:
        """Per-group reward statistics (``None`` when no request has a numeric reward).

        ``with_spread`` counts groups whose rewards are not all equal (at least two requests);
        ``mean_std`` is the mean over groups of the population standard deviation."""
        if not self.by:
            return None
        stats, total, spread, std_sum, sizes = [], 0, 0, 0.0, set()
        order = sorted(self.by.items(), key=lambda kv: kv[1][5])
        for g, (n, s, sq, lo, hi, _) in order:
            n = int(n)
            mean = s / n
            std = math.sqrt(max(sq / n - mean * mean, 0.0))
            if hi - lo < 1e-12:
                std = 0.0  # equal rewards: exactly 0, not a rounding residue
            std_sum += std
            sizes.add(n)
            spread += 1 if n > 1 and hi > lo else 0
            total += n
            if len(stats) < MAX_LISTED:
                stats.append({'group': g, 'n': n, 'mean': round(mean, 4), 'std': round(std, 4), 'min': round(lo, 4),
                              'max': round(hi, 4)})
        return {
            'groups': len(self.by),
            'group_sizes': sorted(sizes),
            'with_spread': spread,
            'mean_std': round(std_sum / len(self.by), 4),
            'requests_rewarded': self.positive,
            'requests_scored': total,
            'per_group': stats,
        }

def reward_spread(groups: Sequence[str], rewards: Sequence[Optional[float]]) -> Optional[Dict[str, Any]]:
    """:meth:`GroupRewards.summary` over parallel lists (groups in order of first appearance)."""
    acc = GroupRewards()
    for i, (g, r) in enumerate(zip(groups, rewards)):
        acc.add(g, r, i)
    return acc.summary()


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
