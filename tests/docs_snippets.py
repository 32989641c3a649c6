"""The fenced ``bash``/``sh``/``python`` blocks of README.md and docs/*.md, for
``tests/test_docs_snippets.py``.

A block runs as written, as a reader runs it: the blocks of one page in order, in one working
directory (so a later block reads what an earlier one wrote), with the virtual environment's
``bin`` first on ``PATH``. Python blocks are fragments of a user's program: they run with the
names a reader already has (``scheduler``, ``rollout_fn``, ``requests``, ...: :func:`prelude`,
a scripted model and a two-turn scheduler). The line before a fence may say more::

    <!-- docs-test: skip gpu: needs vLLM on a GPU -->        not run here (a kind of SKIP_KINDS)
    <!-- docs-test: needs swift -->                          run where the module imports (CI's setup installs it)
    <!-- docs-test: launch torchrun --nproc_per_node 2 -->   a Python program: saved as rollout.py, run so
    <!-- docs-test: pytest -->                               a test module: saved as test_snippet.py, run by pytest

The test reports each skip with its reason.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / 'README.md'] + sorted((ROOT / 'docs').glob('*.md'))
LANGS = ('bash', 'sh', 'python')
#: why a block may be skipped: a GPU, the network, or being the very command CI runs (the suite)
SKIP_KINDS = ('gpu', 'network', 'ci')
_FENCE = re.compile(r'^```(\w*)[^\n]*\n(.*?)^```', re.S | re.M)
_MARK = re.compile(r'<!--\s*docs-test:\s*(skip\s+(?P<kind>\w+):\s*(?P<reason>.*?)|needs\s+(?P<needs>[\w.]+)|'
                   r'launch\s+(?P<launch>.*?)|(?P<pytest>pytest))\s*-->\s*$')
#: the header of a launched Python block: the prelude's names, as an exec'd block gets them
LAUNCH_HEADER = 'from tests.docs_snippets import prelude as _prelude\nglobals().update(_prelude())\n'


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

    @property
    def id(self) -> str:
        return f'{self.page.relative_to(ROOT)}:{self.line}'


def blocks() -> List[Block]:
    out: List[Block] = []
    for page in PAGES:
        text = page.read_text(encoding='utf-8')
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
            out.append(block)
    return out


def prelude() -> Dict[str, Any]:
    """The names the Python blocks use without defining them: a scripted model that answers every
    turn, a scheduler that goes on for two turns, two requests and their first-turn outputs."""
    import mtflow
    from mtflow import RequestConfig, RolloutInferRequest
    from mtflow.backends import make_backend

    class GoOn(mtflow.Scheduler):
        def step(self, infer_request, response_choice, current_turn):
            infer_request.messages.append({'role': 'user', 'content': 'go on'})
            return {'infer_request': infer_request}

    def make_requests(prefix: str = 'r') -> List[Any]:
        return [RolloutInferRequest(messages=[{'role': 'user', 'content': 'What is 2 + 2?'}], uuid=f'{prefix}{i}')
                for i in range(2)]

    backend = make_backend('scripted', outputs=[{'content': 'CALC: 2 + 2', 'token_ids': [1, 2]},
                                                {'content': 'ANSWER: 4', 'token_ids': [3, 4]}], cycle=True)
    request_config = RequestConfig(max_tokens=16)
    requests = make_requests()
    return {
        'mtflow': mtflow, 'backend': backend, 'rollout_fn': backend, 'request_config': request_config,
        'config': request_config, 'scheduler': GoOn(max_turns=2), 'requests': requests,
        'my_shard_of_requests': make_requests('shard'),
        'first_turn_outputs': backend(make_requests(), request_config), 'new_requests': make_requests('n'),
        'tokenizer': None, 'gather_object': mtflow.identity_gather,
    }
