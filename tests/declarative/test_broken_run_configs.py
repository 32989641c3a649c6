"""``mtflow validate`` on broken run configs (``tests/data/broken_run_configs``): each file states
``# expect: LINE FIELD | message`` (LINE ``-`` when the problem has no line; ``@file`` when it is
reported for another file the config names); every expectation is printed as
``file[:line]: field: ...message...`` and the exit status is 1."""
from __future__ import annotations

import glob
import os
import re

import pytest

from mtflow.cli import main as cli

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'broken_run_configs')
FILES = sorted(f for f in glob.glob(os.path.join(HERE, '*.yaml')) if not f.endswith('broken_scheduler.yaml'))
_EXPECT = re.compile(r'^# expect: (\S+) (\S+) \| (.+?)(?: @(\S+))?$', re.MULTILINE)


def test_there_are_broken_run_configs():
    assert len(FILES) >= 10


@pytest.mark.parametrize('path', FILES, ids=os.path.basename)
def test_each_broken_run_config(path, capsys):
    with open(path, 'rb') as f:
        expected = _EXPECT.findall(f.read().decode('utf-8', errors='replace'))
    assert expected, path
    assert cli(['validate', path]) == 1
    out = capsys.readouterr().out
    for line, field, fragment, other in expected:
        where = os.path.realpath(os.path.join(HERE, other)) if other else path
        prefix = where if line == '-' else f'{where}:{line}'
        lines = [l for l in out.splitlines() if fragment in l]
        assert lines, f'{fragment!r} not in {out!r}'
        field_part = '' if field == '-' else f' {field}:'
        assert any(l.startswith(f'{prefix}:{field_part}') or (f'{prefix}:{field_part}' in l) for l in lines), (prefix, out)
