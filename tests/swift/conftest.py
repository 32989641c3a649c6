"""Every test here runs against the real ms-swift package (CI installs ms-swift==4.6.0 in
scripts/test.sh); they carry the ``swift`` marker so ``-m 'not swift'`` can skip them locally."""
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.swift)
