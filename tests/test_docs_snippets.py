"""Every fenced ``bash``/``sh``/``python`` block of README.md and docs/ runs as written
(``tests/docs_snippets.py`` collects them; in order, in one directory; a block repeated word for
word on another page runs once), or says on
the line before its fence why it cannot here: a GPU, the network, or being the suite itself; each
skip is reported with its reason. A new block without a marker must run."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

from tests.docs_snippets import LAUNCH_HEADER, ROOT, SKIP_KINDS, Block, blocks, prelude

BLOCKS = blocks()
#: what a page's directory links to: the checkout a reader runs the docs in
LINKED = ('configs', 'schedulers', 'tests', 'benchmarks', 'scripts', 'mtflow', '.venv', 'pyproject.toml', '.extras')
#: each block's own limit (the slowest: an ms-swift GRPO step, the embedded model's games on 2 cores)
TIMEOUT_S = 900


def test_the_collector_finds_the_pages_blocks():
    assert len(BLOCKS) >= 30 and {b.lang for b in BLOCKS} >= {'bash', 'python'}
    for b in BLOCKS:
        if b.skip is not None:
            assert b.skip[0] in SKIP_KINDS and b.skip[1], f'{b.id}: a skip needs a kind of {SKIP_KINDS} and a reason'


@pytest.fixture(scope='session')
def workdir(tmp_path_factory) -> Path:
    """One reader's checkout for every page: a later block reads what an earlier one wrote
    (``trace show runs/default`` after the run that wrote it), README first, then docs/ by name."""
    d = tmp_path_factory.mktemp('reader')
    for name in LINKED:
        if (ROOT / name).exists():
            (d / name).symlink_to(ROOT / name)
    return d


#: each command already run as written, and where: the same command on another page runs once
RAN: Dict[str, str] = {}


def _env() -> Dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    return dict(os.environ, PYTHONPATH=str(ROOT), PATH=venv_bin + os.pathsep + os.environ.get('PATH', ''))


def _shell(command: str, cwd: Path, block: Block) -> None:
    proc = subprocess.run(['bash', '-e', '-o', 'pipefail', '-c', command], cwd=str(cwd), env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f'{block.id}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}'


@pytest.mark.parametrize('block', BLOCKS, ids=[b.id for b in BLOCKS])
def test_the_block_runs_as_written(block, workdir, monkeypatch):
    if block.skip is not None:
        pytest.skip(f'{block.skip[0]}: {block.skip[1]}')
    if block.needs:
        pytest.importorskip(block.needs, reason=f'{block.id} needs {block.needs} (scripts/test.sh installs it)')
    key = f'{block.lang}:{block.launch}:{block.pytest}:{block.code}'
    if key in RAN:
        return  # the same block, word for word, ran (and passed) at RAN[key]
    cwd = workdir
    monkeypatch.chdir(cwd)
    if block.launch:
        (cwd / 'rollout.py').write_text(LAUNCH_HEADER + block.code)
        _shell(block.launch + ' rollout.py', cwd, block)
    elif block.pytest:
        (cwd / 'test_snippet.py').write_text(block.code)  # a test module of the repository's tests/
        if not (cwd / 'data').exists():
            (cwd / 'data').symlink_to(ROOT / 'tests' / 'data')
        _shell(f'{shlex.quote(sys.executable)} -m pytest -q -p no:cacheprovider test_snippet.py', cwd, block)
    elif block.lang == 'python':
        monkeypatch.syspath_prepend(str(ROOT))
        namespace = prelude()
        exec(compile(block.code, block.id, 'exec'), namespace)  # noqa: S102 - our own docs
    else:
        _shell(block.code, cwd, block)
    RAN[key] = block.id
