"""Every fenced ``bash``/``sh``/``python`` block of README.md and docs/ runs as pasted
(``tests/docs_snippets.py`` collects them; in order, in one directory; a block repeated word for
word on another page runs once): each Python block in a fresh interpreter with nothing defined for
it, each shell block with the commands a reader has after the README's setup. A block that cannot
run here says why on the line before its fence (a GPU, the network, or being the suite itself);
each skip is reported with its reason. A new block without a marker must run."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

from tests.docs_snippets import ROOT, SKIP_KINDS, Block, blocks, free_names

BLOCKS = blocks()
#: what a page's directory links to: the checkout a reader runs the docs in
LINKED = ('configs', 'schedulers', 'tests', 'benchmarks', 'scripts', 'mtflow', 'pyproject.toml', '.extras')
#: each block's own limit (the slowest: an ms-swift GRPO step, the embedded model's games on 2 cores)
TIMEOUT_S = 900


def test_the_collector_finds_the_pages_blocks():
    assert len(BLOCKS) >= 30 and {b.lang for b in BLOCKS} >= {'bash', 'python'}
    for b in BLOCKS:
        if b.skip is not None:
            assert b.skip[0] in SKIP_KINDS and b.skip[1], f'{b.id}: a skip needs a kind of {SKIP_KINDS} and a reason'


@pytest.mark.parametrize('block', [b for b in BLOCKS if b.lang == 'python'], ids=lambda b: b.id)
def test_a_python_block_defines_what_it_uses_or_names_the_block_it_continues(block):
    """A skipped block too: a reader pastes it where it can run."""
    taken = block.continued_names
    missing = free_names(block.code) - set(taken or [])
    assert not missing, (f'{block.id}: uses {sorted(missing)} without defining them: build them in the block, or '
                         'start it with "# continues the block above: NAME, ..." under a block that defines them')
    if taken is None:
        return
    assert block.after is not None, f'{block.id}: says it continues the block above, and the page has none'
    assert not (block.after.skip and not block.skip), f'{block.id}: runs, but the block it continues is skipped'
    before = block.after.program()
    undefined = [n for n in taken if n in free_names(before + '\n' + n)]
    assert not undefined, f'{block.id}: takes {undefined} from the block above ({block.after.id}), which does not define them'


def test_a_fragment_says_what_it_takes_and_runs_after_the_block_it_continues(tmp_path):
    page = tmp_path / 'page.md'
    page.write_text('```python\nx = 2\n```\n\ntext\n\n```python\n# continues the block above: x\nprint(x * y)\n```\n'
                    '\n```python\n# continues the block above: x (and nothing else)\nassert x == 2\n```\n')
    first, second, third = blocks([page])
    assert first.after is None and first.continued_names is None and free_names(first.code) == set()
    assert second.after is first and second.continued_names == ['x']
    assert free_names(second.code) == {'x', 'y'}, 'y is used and neither defined nor taken: the check finds it'
    assert third.after is second and third.continued_names == ['x'] and free_names(third.code) == {'x'}
    assert third.program() == 'x = 2\n\n# continues the block above: x\nprint(x * y)\n\n' + third.code


@pytest.fixture(scope='session')
def workdir(tmp_path_factory) -> Path:
    """One reader's checkout for every page: a later block reads what an earlier one wrote
    (``trace show runs/default`` after the run that wrote it), README first, then docs/ by name.
    ``.venv`` is the environment running the tests (the checkout's own in CI)."""
    d = tmp_path_factory.mktemp('reader')
    for name in LINKED:
        if (ROOT / name).exists():
            (d / name).symlink_to(ROOT / name)
    (d / '.venv').symlink_to(Path(sys.prefix))  # CI: the checkout's .venv; a worktree: the one testing it
    return d


#: each command already run as written, and where: the same command on another page runs once
RAN: Dict[str, str] = {}


def _env() -> Dict[str, str]:
    """The reader's environment: the project importable (an editable install in CI; ``PYTHONPATH``
    for a worktree the venv was not installed from), and no virtual environment on ``PATH``: the
    README's setup does not activate one."""
    venvs = {str(Path(sys.executable).parent), str(ROOT / '.venv' / 'bin')}
    path = os.pathsep.join(p for p in os.environ.get('PATH', '').split(os.pathsep) if p and p not in venvs)
    env = {k: v for k, v in os.environ.items() if k not in ('VIRTUAL_ENV', 'PYTHONHOME')}
    return dict(env, PYTHONPATH=str(ROOT), PATH=path)


def _run(argv, cwd: Path, block: Block) -> None:
    proc = subprocess.run(argv, cwd=str(cwd), env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    where = f' (after {block.after.id})' if block.after is not None else ''
    assert proc.returncode == 0, f'{block.id}{where}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}'


@pytest.mark.parametrize('block', BLOCKS, ids=[b.id for b in BLOCKS])
def test_the_block_runs_as_pasted(block, workdir):
    if block.skip is not None:
        pytest.skip(f'{block.skip[0]}: {block.skip[1]}')
    if block.needs:
        pytest.importorskip(block.needs, reason=f'{block.id} needs {block.needs} (scripts/test.sh installs it)')
    program = block.program()
    key = f'{block.lang}:{block.launch}:{block.pytest}:{program}'
    if key in RAN:
        return  # the same block, word for word, ran (and passed) at RAN[key]
    python = str(workdir / '.venv' / 'bin' / 'python')
    if block.launch:
        (workdir / 'rollout.py').write_text(program)
        _run(['bash', '-e', '-o', 'pipefail', '-c', block.launch + ' rollout.py'], workdir, block)
    elif block.pytest:
        (workdir / 'test_snippet.py').write_text(program)  # a test module of the repository's tests/
        if not (workdir / 'data').exists():
            (workdir / 'data').symlink_to(ROOT / 'tests' / 'data')
        _run([python, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', 'test_snippet.py'], workdir, block)
    elif block.lang == 'python':
        _run([python, '-c', program], workdir, block)
    else:
        _run(['bash', '-e', '-o', 'pipefail', '-c', block.code], workdir, block)
    RAN[key] = block.id


def test_shell_blocks_use_the_commands_the_readme_sets_up():
    """After ``bash scripts/setup.sh`` a reader has ``.venv/bin/mtflow``, ``.venv/bin/python``, ...;
    a bare ``mtflow``, ``python`` or ``swift`` needs an activated environment the README never makes."""
    bare = shlex.split('mtflow python python3 pip swift torchrun accelerate pytest')
    found = []
    for b in BLOCKS:
        commands = [b.launch] if b.launch else ([] if b.lang == 'python' else b.code.splitlines())
        for line in commands:
            for part in line.split('#', 1)[0].replace('&&', ';').replace('|', ';').split(';'):
                words = [w for w in part.split() if '=' not in w or w.startswith('-')]
                if words and words[0] in bare and not (words[0] == 'python3' and '-m venv' in part):
                    found.append(f'{b.id}: {part.strip()}')
    assert not found, 'bare commands (use .venv/bin/...):\n' + '\n'.join(found)
