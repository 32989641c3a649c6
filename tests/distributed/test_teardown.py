"""``destroy_process_group_at_exit``: the group is destroyed by the time the interpreter exits
(what ms-swift 4.6 never does; a gloo group alive at exit aborts now and then with SIGABRT), and
left alone after an uncaught exception."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip('torch.distributed')

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import atexit, sys
    import torch.distributed as dist
    # registered first, so it runs last (atexit is LIFO): reports what the interpreter exits with
    atexit.register(lambda: print('initialized at exit:', dist.is_initialized(), flush=True))
    from mtflow.distributed.teardown import destroy_process_group_at_exit
    destroy_process_group_at_exit()
    destroy_process_group_at_exit()  # idempotent
    store = dist.HashStore()
    dist.init_process_group('gloo', store=store, rank=0, world_size=1)
    out = [None]
    dist.all_gather_object(out, [1])
    if sys.argv[1] == 'crash':
        raise RuntimeError('rank crashed')
''')


# A crashed rank keeps its group alive on purpose, so gloo's teardown abort (SIGABRT, -6: the very
# failure a clean exit avoids) may replace the exit status 1 of the uncaught exception.
@pytest.mark.parametrize('mode, initialized, codes', [('clean', False, (0, )), ('crash', True, (1, -6))])
def test_the_group_is_destroyed_at_a_clean_exit_only(tmp_path, mode, initialized, codes):
    script = tmp_path / 'job.py'
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), mode], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={'PYTHONPATH': str(ROOT), 'PATH': '/usr/bin:/bin'})
    assert proc.returncode in codes, proc.stderr[-2000:]
    assert f'initialized at exit: {initialized}' in proc.stdout
