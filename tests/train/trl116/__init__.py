"""Tests that need TRL 1.16 (``tests/train/test_trl116.py`` runs them with ``.extras/trl116`` first
on the path)."""
from __future__ import annotations

from typing import Any

import pytest


def trl_1_16() -> Any:
    """The ``trl`` module when it is 1.16 or newer; else the calling module is skipped, saying why."""
    trl = pytest.importorskip('trl')
    if tuple(int(x) for x in trl.__version__.split('.')[:2]) < (1, 16):
        pytest.skip(f'needs TRL >= 1.16 (environment_factory); this is {trl.__version__}: tests/train/test_trl116.py '
                    'runs it with .extras/trl116', allow_module_level=True)
    return trl
