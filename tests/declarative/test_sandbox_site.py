"""The ``site_packages`` option: a directory of packages the sandboxed program can import, read-only,
with nothing else of the host beside it in view."""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid

import pytest

from mtflow.tools.sandbox import make_python_tool

from .sandbox_util import KINDS, assert_nothing_survives, run


@pytest.fixture
def site():
    """``<root>/venv/site-packages`` with one module, and a secret beside the venv (not under /tmp,
    which the sandbox replaces with its own)."""
    root = tempfile.mkdtemp(prefix='mtflow-site-', dir='/var/tmp')
    os.chmod(root, 0o755)
    pkgs = os.path.join(root, 'venv', 'site-packages')
    os.makedirs(pkgs)
    for d in (os.path.join(root, 'venv'), pkgs):
        os.chmod(d, 0o755)
    token = uuid.uuid4().hex
    with open(os.path.join(pkgs, 'mtflow_demo_pkg.py'), 'w') as f:
        f.write(f'VALUE = {token!r}\n')
    with open(os.path.join(root, 'venv', 'secret.txt'), 'w') as f:
        f.write('secret-' + token)
    try:
        yield pkgs, token
    finally:
        shutil.rmtree(root)


_PROGRAM = '''
import os, sys
import mtflow_demo_pkg
print("imported", mtflow_demo_pkg.VALUE)
print("last", sys.path[-1] == {pkgs!r})
for path in [{pkgs!r} + "/planted.py", {pkgs!r} + "/mtflow_demo_pkg.py"]:
    try:
        open(path, "a").write("x = 1\\n")
        print("wrote", path)
    except OSError as exc:
        print("refused", os.path.basename(path), exc.errno)
secret = os.path.join(os.path.dirname({pkgs!r}), "secret.txt")
print("secret", os.path.exists(secret), sorted(os.listdir(os.path.dirname({pkgs!r}))))
'''


@pytest.mark.parametrize('kind', KINDS)
def test_site_packages_are_importable_read_only_and_alone(kind, site):
    pkgs, token = site
    r = run(_PROGRAM.format(pkgs=pkgs), kind, site_packages=[pkgs])
    assert r.error_kind == '', r.output
    lines = r.output.splitlines()
    assert lines[0] == f'imported {token}' and lines[1] == 'last True'
    assert lines[2] == 'refused planted.py 30'  # EROFS: a read-only bind
    assert lines[3] in ('refused mtflow_demo_pkg.py 30', 'refused mtflow_demo_pkg.py 13')  # (EACCES first as root)
    assert lines[4] == "secret False ['site-packages']"  # the venv's other files are not in view
    assert not os.path.exists(os.path.join(pkgs, 'planted.py'))
    with open(os.path.join(pkgs, 'mtflow_demo_pkg.py')) as f:
        assert f.read() == f'VALUE = {token!r}\n'
    assert_nothing_survives(r)


def test_without_the_option_the_package_is_not_there(site):
    r = run('import mtflow_demo_pkg', 'bwrap')
    assert r.error_kind == 'exit' and 'ModuleNotFoundError' in r.output


@pytest.mark.parametrize('value, message', [
    ('relative/path', 'must be an absolute path'), (['/nonexistent-mtflow'], 'is not a directory'),
    (['/tmp'], 'is under /tmp'), (7, 'must be a path or a list of paths')])
def test_bad_site_packages_are_load_time_errors(value, message):
    with pytest.raises(ValueError, match=message):
        make_python_tool({'site_packages': value, 'warm_pool': 0})


def test_the_tool_option_with_a_warm_pool(site):
    pkgs, token = site
    tool = make_python_tool({'site_packages': pkgs, 'warm_pool': 1, 'timeout_s': 30})
    try:
        if not tool.isolation.available:
            pytest.skip(tool.isolation.detail)
        outs = [asyncio.run(tool(code='import mtflow_demo_pkg; print(mtflow_demo_pkg.VALUE)')) for _ in range(2)]
    finally:
        tool.close()
    assert outs == [token + '\n'] * 2
