"""``mtflow trace html RUN_A --compare RUN_B``: the two-run page on the committed replay example
and a replay of it against a changed environment: the totals, exactly the differing requests
listed, each with its first differing turn highlighted and the differing cells outlined."""
import re
from pathlib import Path

from mtflow.cli import main

EXAMPLE = Path(__file__).resolve().parents[1] / 'data' / 'replay_example'


def _changed_replay(tmp_path: Path) -> Path:
    (tmp_path / 'scheduler.yaml').write_text((EXAMPLE / 'scheduler.yaml').read_text().replace(
        'close_within: 3', 'close_within: 1'))
    (tmp_path / 'hot_cold.py').write_text((EXAMPLE / 'hot_cold.py').read_text())
    (tmp_path / 'config.yaml').write_text(
        (EXAMPLE / 'config.yaml').read_text().replace('model: script.jsonl', f'model: {EXAMPLE / "script.jsonl"}')
        .replace('dataset: prompts.jsonl', f'dataset: {EXAMPLE / "prompts.jsonl"}'))
    assert main(['replay', str(EXAMPLE / 'run'), str(tmp_path / 'config.yaml'), '--out', str(tmp_path / 'b'),
                 '-q']) == 0
    return tmp_path / 'b'


def test_the_two_run_page_highlights_each_first_difference(tmp_path, capsys):
    b = _changed_replay(tmp_path)
    page = tmp_path / 'cmp.html'
    assert main(['trace', 'html', str(EXAMPLE / 'run' / 'trace.jsonl'), '--compare', str(b), '-o', str(page)]) == 0
    text = page.read_text()
    assert '<b>3</b>identical' in text and '<b>3</b>different' in text
    blocks = dict(re.findall(r'<div class="req" id="r-([^"]+)">(.*?)</div>', text, re.S))
    assert set(blocks) == {'hc-1', 'hc-2', 'hc-5'}
    for uuid, block in blocks.items():
        first = re.findall(r'<tr class="first-diff">(.*?)</tr>', block, re.S)
        assert len(first) == 1 and first[0].startswith('<td>2 ◀ first difference')
        assert first[0].count('class="differs"') == 2  # A's and B's observation
        assert 'Very close.' in first[0]
    assert 'replay_diverged' in blocks['hc-1']


def test_identical_runs_say_so(tmp_path):
    page = tmp_path / 'same.html'
    assert main(['trace', 'html', str(EXAMPLE / 'run'), '--compare', str(EXAMPLE / 'run'), '-o', str(page)]) == 0
    text = page.read_text()
    assert '<b>6</b>identical' in text and 'the runs are identical' in text and 'class="req"' not in text
