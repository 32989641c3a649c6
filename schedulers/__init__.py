"""Ready schedulers: YAML files (load with :func:`mtflow.declarative.load_scheduler`) and, where
a subclass is the natural form, their Python equivalents.

``path(name)`` gives the YAML path of a ready scheduler, e.g. ``path('guess_number')``.
"""
from __future__ import annotations

import os
from typing import List

HERE = os.path.dirname(os.path.abspath(__file__))


def path(name: str) -> str:
    """The YAML file of the ready scheduler ``name``."""
    p = os.path.join(HERE, f'{name}.yaml')
    if not os.path.isfile(p):
        raise FileNotFoundError(f'no ready scheduler {name!r} (have: {", ".join(names())})')
    return p


def names() -> List[str]:
    return sorted(f[:-5] for f in os.listdir(HERE) if f.endswith('.yaml'))
