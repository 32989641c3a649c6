"""uid leases as root: one root-only directory per host, so two drivers (whatever their
``$TMPDIR``) never share a uid, and a directory another user made is refused, not followed."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from mtflow.tools import isolation
from mtflow.tools.isolation import LeaseDirUnsafe, UidLease, open_lease_dir
from mtflow.tools.sandbox.python_tool import refusal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason='uid leases are made as root only')


@pytest.fixture
def lease_dir(tmp_path, monkeypatch):
    """Point the leases at ``tmp_path/leases`` (its parent made root-only, as /run is)."""
    os.chmod(tmp_path, 0o755)
    UidLease.forget_dir()
    monkeypatch.setattr(UidLease, 'lease_dir', str(tmp_path / 'leases'))
    yield tmp_path / 'leases'
    UidLease.forget_dir()


def test_the_lease_directory_is_root_only_and_under_run():
    assert isolation.LEASE_DIR.startswith('/run/')
    lease = UidLease()
    try:
        st = os.stat(isolation.LEASE_DIR)
        assert (st.st_uid, st.st_mode & 0o777) == (0, 0o700)
        # not the block pre-v2 drivers lease through $TMPDIR (1200000000 + 4096): old and new never collide
        assert not 1_200_000_000 <= lease.uid < 1_200_000_000 + isolation.UID_BLOCK
    finally:
        lease.release()


_OTHER_DRIVER = textwrap.dedent('''
    import random, sys
    random.randrange = lambda n: int(sys.argv[1])  # start where the first driver's lease is
    from mtflow.tools.isolation import UidLease
    print(UidLease().uid)
''')


def test_two_drivers_with_their_own_tmpdir_never_share_a_uid(tmp_path):
    held = UidLease()
    try:
        start = held.uid - isolation._uid_base()
        env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=ROOT)
        out = subprocess.run([sys.executable, '-c', _OTHER_DRIVER, str(start)], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout) != held.uid and int(out.stdout) == held.uid + 1 - (
            isolation.UID_BLOCK if start == isolation.UID_BLOCK - 1 else 0)
    finally:
        held.release()


def test_a_symlinked_lease_directory_is_refused(lease_dir, tmp_path):
    target = tmp_path / 'elsewhere'
    target.mkdir()
    os.chmod(target, 0o700)
    lease_dir.symlink_to(target)
    with pytest.raises(LeaseDirUnsafe, match='symlink') as info:
        UidLease()
    assert os.listdir(target) == []  # nothing created where the link points
    assert 'isolation: none' not in refusal(str(info.value))


@pytest.mark.parametrize('owner, mode, problem', [(65534, 0o700, 'owned by uid 65534'),
                                                  (0, 0o777, 'lets others in'), (0, 0o755, 'lets others in')])
def test_a_lease_directory_of_another_user_or_open_to_others_is_refused(lease_dir, owner, mode, problem):
    lease_dir.mkdir()
    os.chown(lease_dir, owner, owner)
    os.chmod(lease_dir, mode)
    with pytest.raises(LeaseDirUnsafe, match=problem) as info:
        UidLease()
    assert os.listdir(lease_dir) == []
    message = refusal(str(info.value))
    assert str(lease_dir) in message and 'isolation: none' not in message


def test_a_planted_link_inside_the_directory_is_not_followed(lease_dir, tmp_path):
    base = isolation._uid_base()
    lease_dir.mkdir(mode=0o700)
    victim = tmp_path / 'victim'
    for k in range(isolation.UID_BLOCK):
        (lease_dir / str(base + k)).symlink_to(victim)
    with pytest.raises(LeaseDirUnsafe, match='cannot open the lease file'):
        UidLease()
    assert not victim.exists()


def test_a_good_directory_gives_leases(lease_dir):
    fd = open_lease_dir(str(lease_dir))
    os.close(fd)
    a, b = UidLease(), UidLease()
    try:
        assert a.uid != b.uid
        for uid in (a.uid, b.uid):
            st = os.lstat(lease_dir / str(uid))
            assert st.st_uid == 0 and st.st_mode & 0o777 == 0o600
    finally:
        a.release()
        b.release()
