"""The redesign moved the top-level modules into layer packages; the old paths keep working for
one release, each with a DeprecationWarning that names the new path (``mtflow/_compat.py``)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from mtflow._compat import MOVED


@pytest.mark.parametrize('old,new', sorted(MOVED.items()))
def test_an_old_path_is_the_new_module_and_warns(old, new):
    code = (f'import warnings, importlib\n'
            f'warnings.simplefilter("error")\n'
            f'import mtflow\n'
            f'new = importlib.import_module({new!r})\n'
            f'try:\n'
            f'    importlib.import_module({old!r})\n'
            f'except DeprecationWarning as w:\n'
            f'    assert {new!r} in str(w), w\n'
            f'else:\n'
            f'    raise SystemExit("no DeprecationWarning")\n'
            f'warnings.simplefilter("ignore")\n'
            f'import sys\n'
            f'old = importlib.import_module({old!r})\n'
            f'assert old is new and old.__spec__.name == {new!r}, (old, old.__spec__)\n')
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_old_executor_path_serves_the_public_names():
    with pytest.warns(DeprecationWarning, match='mtflow.engine.executor'):
        sys.modules.pop('mtflow.executor', None)
        import mtflow.executor as old
    import mtflow
    assert old.Executor is mtflow.Executor and old.run_multi_turn is mtflow.run_multi_turn
