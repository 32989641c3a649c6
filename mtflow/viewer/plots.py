"""The run's plots as inline SVG (no JS, no network): histograms of numbers (reward, tokens per
turn, tool latency) and a column chart of one value per label (mean reward per group).

``svg.py`` draws the state graph and the small horizontal bar charts of counts; these are the
plots of a run's results, what ``vf-eval`` or a W&B panel would show.
"""
from __future__ import annotations

import math
from html import escape
from typing import List, Mapping, Optional, Sequence, Tuple

__all__ = ['histogram_bins', 'histogram_svg', 'column_chart_svg']

_FONT = 'font:11px sans-serif;fill:#334155'


def histogram_bins(values: Sequence[float], bins: int = 10) -> List[Tuple[float, float, int]]:
    """``(low, high, count)`` per bin over ``[min, max]``; one bin per distinct value when there
    are at most ``bins`` of them and they are integers or a few rewards (0, 0.5, 1)."""
    xs = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not xs:
        return []
    distinct = sorted(set(xs))
    if len(distinct) <= bins:
        return [(v, v, sum(1 for x in xs if x == v)) for v in distinct]
    lo, hi = distinct[0], distinct[-1]
    width = (hi - lo) / bins
    counts = [0] * bins
    for x in xs:
        counts[min(int((x - lo) / width), bins - 1)] += 1
    return [(lo + k * width, lo + (k + 1) * width, counts[k]) for k in range(bins)]


def _fmt(x: float) -> str:
    return f'{x:.3g}'


def histogram_svg(values: Sequence[float], title: str, css_class: str, unit: str = '', bins: int = 10,
                  color: str = '#3b82f6') -> str:
    """Columns of counts per bin, the bin's range under each, the count above."""
    rows = histogram_bins(values, bins)
    labels = [(_fmt(lo) if lo == hi else f'{_fmt(lo)}-{_fmt(hi)}') + unit for lo, hi, _ in rows]
    return column_chart_svg(dict(zip(labels, [c for _, _, c in rows])), title, css_class, color=color,
                            note=f'{len([v for v in values if v is not None])} values')


def column_chart_svg(data: Mapping[str, float], title: str, css_class: str, color: str = '#3b82f6',
                     note: Optional[str] = None, max_columns: int = 80) -> str:
    """One column per label (at most ``max_columns``; the rest are counted in the note), its
    value above it and its whole label under it: level when the labels fit their columns, else
    slanted, the chart as tall as the longest label needs (a group's uuid is never cut)."""
    items = list(data.items())
    hidden = len(items) - max_columns if len(items) > max_columns else 0
    items = items[:max_columns]
    col_w = max(8, min(40, 640 // max(len(items), 1)))
    shown = [_fmt(v) if isinstance(v, float) else str(v) for _, v in items]
    labels = [str(k) for k, _ in items]
    label_len, value_len = max(map(len, labels), default=0), max(map(len, shown), default=0)
    rotate = len(items) > 12 or label_len * 6 > col_w
    upright = value_len * 6 > col_w  # values that do not fit a column stand upright
    chart_h = 120
    top_pad = 34 + (value_len * 6 if upright else 0)
    label_h = int(label_len * 6 * 0.87) + 16 if rotate else 22  # 60 degrees
    width = max(260, 30 + col_w * len(items) + 10 + (int(label_len * 3) if rotate else 0))
    height = top_pad + chart_h + label_h
    peak = max([abs(v) for _, v in items] + [1e-12])
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="{escape(css_class)}" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" role="img" aria-label="{escape(title)}">',
           f'<text x="4" y="16" style="font:bold 13px sans-serif;fill:#0f172a">{escape(title)}</text>']
    if note or hidden:
        text = (note or '') + (f'{"; " if note else ""}{hidden} more not drawn' if hidden else '')
        out.append(f'<text x="4" y="29" style="{_FONT};fill:#64748b">{escape(text)}</text>')
    if not items:
        out.append(f'<text x="4" y="{top_pad + 20}" style="font:12px sans-serif;fill:#64748b">nothing</text>')
    base = top_pad + chart_h
    out.append(f'<line x1="26" y1="{base}" x2="{width - 6}" y2="{base}" stroke="#cbd5e1"/>')
    for k, (label, value) in enumerate(zip(labels, shown)):
        v = items[k][1]
        x = 30 + k * col_w
        h = max(1.5 if v else 0.0, (chart_h - 14) * abs(v) / peak)
        cx = x + col_w / 2
        out.append(f'<rect class="col" x="{x + 1}" y="{base - h:.1f}" width="{col_w - 2}" height="{h:.1f}" rx="2" '
                   f'fill="{color}"><title>{escape(label)}: {escape(value)}</title></rect>')
        if upright:
            out.append(f'<text class="value" transform="translate({cx + 3:.1f},{base - h - 3:.1f}) rotate(-90)" '
                       f'style="{_FONT}">{escape(value)}</text>')
        else:
            out.append(f'<text class="value" x="{cx:.1f}" y="{base - h - 3:.1f}" text-anchor="middle" style="{_FONT}">'
                       f'{escape(value)}</text>')
        if rotate:
            out.append(f'<text class="label" transform="translate({cx - 3:.1f},{base + 8}) rotate(60)" '
                       f'style="{_FONT}">{escape(label)}</text>')
        else:
            out.append(f'<text class="label" x="{cx:.1f}" y="{base + 13}" text-anchor="middle" style="{_FONT}">'
                       f'{escape(label)}</text>')
    out.append('</svg>')
    return ''.join(out)
