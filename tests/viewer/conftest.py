"""Shared fixtures of the viewer tests: a known run written to files.

``pytester`` is enabled in ``test_pytest_plugin.py`` itself (``pytest_plugins`` in a conftest below
the rootdir is an error when the whole suite runs)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict

import pytest

from tests.viewer.viewer_scenario import write_scenario


@pytest.fixture
def scenario_files(tmp_path: Path) -> Dict[str, Path]:
    """``{'trace', 'trajectories', 'tokenizer'}`` paths of the scenario run (see viewer_scenario.py)."""
    return write_scenario(tmp_path)
