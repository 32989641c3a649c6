"""The fenced ``bash``/``sh``/``python`` blocks of README.md and docs/*.md, for
``tests/test_docs_snippets.py``.

A block runs as a reader runs it after the README's setup: the blocks of one page in order, in one
working directory that links the checkout (so a later block reads what an earlier one wrote), shell
blocks with the reader's ``PATH`` (no virtual environment on it: ``.venv/bin/mtflow``, not
``mtflow``), and each Python block in a fresh interpreter (``python -c``), with nothing defined
for it: what it uses, it builds or imports.

A Python block that goes on from the one before it says so on its first line, where the reader
sees it, and names what it takes from there::

    # continues the block above: rollout_fn, requests

It then runs after that block (and whatever that one continues), in the same interpreter.
:func:`free_names` checks that every name a block uses is defined in it or named on that line.

The line before a fence may say more::

    <!-- docs-test: skip gpu: needs vLLM on a GPU -->        not run here (a kind of SKIP_KINDS)
    <!-- docs-test: needs swift -->                          run where the module imports (CI's setup installs it)
    <!-- docs-test: launch .venv/bin/torchrun --nproc_per_node 2 -->   a program: saved as rollout.py, run so
    <!-- docs-test: pytest -->                               a test module: saved as test_snippet.py, run by pytest

The test reports each skip with its reason.
"""
from __future__ import annotations

import builtins
import re
import symtable
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Set

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / 'README.md'] + sorted((ROOT / 'docs').glob('*.md'))
LANGS = ('bash', 'sh', 'python')
#: why a block may be skipped: a GPU, the network, or being the very command CI runs (the suite)
SKIP_KINDS = ('gpu', 'network', 'ci')
_FENCE = re.compile(r'^```(\w*)[^\n]*\n(.*?)^```', re.S | re.M)
_MARK = re.compile(r'<!--\s*docs-test:\s*(skip\s+(?P<kind>\w+):\s*(?P<reason>.*?)|needs\s+(?P<needs>[\w.]+)|'
                   r'launch\s+(?P<launch>.*?)|(?P<pytest>pytest))\s*-->\s*$')
#: the first line of a Python block that goes on from the page's previous Python block
CONTINUES = re.compile(r'^#\s*continues the block above:\s*(?P<names>[\w ,]+?)\s*(?:\(.*)?$')
#: names every module has
_MODULE_NAMES = {'__file__', '__name__', '__doc__'}


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    code: str
    skip: Optional[tuple] = None  # (kind, reason)
    needs: Optional[str] = None   # a module that must import
    launch: Optional[str] = None  # the command that runs the saved rollout.py
    pytest: bool = False          # a test module
    after: Optional['Block'] = None  # the block this one continues (its first line says so)

    @property
    def id(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f'{page}:{self.line}'

    @property
    def continued_names(self) -> Optional[List[str]]:
        """The names the first line says this block takes from the block above, or ``None``
        when it is a block of its own."""
        m = CONTINUES.match(self.code.split('\n', 1)[0].strip())
        return None if m is None else [n.strip() for n in m['names'].split(',') if n.strip()]

    def program(self) -> str:
        """What runs: the blocks this one continues, then this one."""
        return (self.after.program() + '\n' if self.after is not None else '') + self.code


def blocks(pages: Optional[List[Path]] = None) -> List[Block]:
    out: List[Block] = []
    for page in PAGES if pages is None else pages:
        text = page.read_text(encoding='utf-8')
        previous: Optional[Block] = None  # the page's last Python block
        for m in _FENCE.finditer(text):
            if m.group(1) not in LANGS:
                continue
            line = text[:m.start()].count('\n') + 1
            before = text[:m.start()].rstrip('\n').rsplit('\n', 1)[-1]
            block = Block(page, line, m.group(1), m.group(2))
            mark = _MARK.search(before)
            if mark:
                block.skip = (mark['kind'], mark['reason']) if mark['kind'] else None
                block.needs, block.launch, block.pytest = mark['needs'], mark['launch'], bool(mark['pytest'])
            if block.lang == 'python':
                if block.continued_names is not None:
                    block.after = previous
                previous = block
            out.append(block)
    return out


def free_names(code: str) -> Set[str]:
    """The names ``code`` reads but neither defines (assigns, imports, defines a function or class
    of that name) at module level nor gets from Python itself: what a fresh interpreter would raise
    ``NameError`` on (in a function body: when it is called)."""
    top = symtable.symtable(code, '<block>', 'exec')
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    known = defined | set(dir(builtins)) | _MODULE_NAMES
    used: Set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for s in table.get_symbols():
            if s.is_referenced() and (table is top or s.is_global()):
                used.add(s.get_name())
        for child in table.get_children():
            walk(child)

    walk(top)
    return used - known
