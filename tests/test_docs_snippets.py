"""Every fenced ``bash``/``sh``/``python`` block of README.md and docs/ runs as written
(``tests/docs_snippets.py`` collects them), or says on the line before its fence why it cannot
here (a GPU, the network, an extra that setup does not install, minutes of CPU); each skip is
reported with its reason. A new block without a marker must run."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.docs_snippets import ROOT, SKIP_KINDS, blocks, prelude

BLOCKS = blocks()


def test_the_collector_finds_the_pages_blocks():
    assert len(BLOCKS) >= 30 and {b.lang for b in BLOCKS} >= {'bash', 'python'}
    for b in BLOCKS:
        if b.skip is not None:
            assert b.skip[0] in SKIP_KINDS and b.skip[1], f'{b.id}: a skip needs a kind of {SKIP_KINDS} and a reason'


@pytest.mark.parametrize('block', BLOCKS, ids=[b.id for b in BLOCKS])
def test_the_block_runs_as_written(block, tmp_path, monkeypatch):
    if block.skip is not None:
        pytest.skip(f'{block.skip[0]}: {block.skip[1]}')
    for name in ('configs', 'schedulers', 'tests', 'benchmarks', 'scripts', 'mtflow', '.venv'):
        if (ROOT / name).exists():
            (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    if block.lang == 'python':
        monkeypatch.syspath_prepend(str(ROOT))
        namespace = prelude()
        exec(compile(block.code, block.id, 'exec'), namespace)  # noqa: S102 - our own docs
        return
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(['bash', '-e', '-o', 'pipefail', '-c', block.code], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f'{block.id}: exit {proc.returncode}\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}'
