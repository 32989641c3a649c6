"""The worked trainer loop of docs/streaming.md, run as written: a tiny random model on CPU,
trained by a few policy-gradient steps against the producer with ``max_staleness=1``; the block
asserts that no group it trained on spans more than one version or is older than one."""
from __future__ import annotations

import pytest

from tests.docs_snippets import ROOT, blocks

pytest.importorskip('transformers')


def _trainer_block():
    page = ROOT / 'docs' / 'streaming.md'
    found = [b for b in blocks() if b.page == page and b.lang == 'python' and 'optimizer.step()' in b.code]
    assert len(found) == 1, 'docs/streaming.md: the worked trainer loop block'
    return found[0]


@pytest.mark.slow
def test_the_worked_trainer_loop_runs_as_written(capsys):
    block = _trainer_block()
    namespace: dict = {'__name__': 'docs_streaming'}
    exec(compile(block.code, block.id, 'exec'), namespace)  # noqa: S102 - our own docs
    rows = namespace['rows']
    assert len(rows) == 6 and all(span <= 1 and age <= 1 for _, _, span, age, _ in rows)
    assert namespace['stream'].stats['delivered_groups'] >= 6
    versions = {v for _, vs, _, _, _ in rows for member in vs for v in member}
    assert max(versions) >= 2  # the weights did move while the loop trained
    assert 'step 5 versions' in capsys.readouterr().out
