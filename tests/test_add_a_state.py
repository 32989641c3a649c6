"""The recipe for a new state in ``docs/architecture.md`` works as written: its worked example (a
toy ``reviewing`` state, added through the graph's lines and one handler) runs under every driver.
It edits the engine's tables, so it runs as its own pytest process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.docs_snippets import blocks

ROOT = Path(__file__).resolve().parents[1]


def test_the_worked_example_of_adding_a_state_runs(tmp_path):
    [block] = [b for b in blocks() if b.page.name == 'architecture.md' and 'reviewing' in b.code and b.pytest]
    module = tmp_path / 'test_toy_state.py'
    module.write_text(block.code)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', str(module)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert '1 passed' in proc.stdout
