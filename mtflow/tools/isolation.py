"""Which isolation the ``python`` tool gets on this machine, and the command line that builds it.

The sandbox is built with existing tools, never by hand:

- ``bwrap`` (bubblewrap, the default): new PID, network, IPC, UTS and mount namespaces; a root
  made of read-only binds of ``/usr`` (and the ``/bin``, ``/lib*`` links), the interpreter's
  prefix, a fresh ``/proc`` of the new PID namespace, a minimal ``/dev`` and a ``tmpfs`` at
  ``/tmp`` (the working directory, capped in size and inodes; the sandbox mounts it itself, see
  :func:`bwrap_command`) that vanishes with the sandbox;
- ``unshare`` (util-linux, the fallback where ``bwrap`` is missing or cannot create namespaces):
  the same namespaces, and the same root built with ``mount``/``chroot`` in a throw-away mount
  namespace;
- both then drop to a **dedicated unprivileged uid** with ``setpriv`` (no capabilities, no
  groups, ``no_new_privs``) before the interpreter starts; without root, bwrap instead makes its own
  user namespace (the program is ``nobody`` inside; outside, a subordinate uid of its own where
  this user has them, :mod:`mtflow.tools.subuid`, else this user; see :func:`rootless`).

The uid is leased per call from a block nobody else uses (an exclusive ``flock`` on a file per
uid in one root-only directory, :data:`LEASE_DIR`, whose ownership and mode are checked and whose
files are opened without following links, so concurrent calls, in this process or any other
driver on the host, never share one, and no other user can make root write elsewhere). A lease
directory is per ``/run``, that is per container; what every container on one kernel shares is the
kernel's count of each uid's tasks, so the sandbox's launcher, once it runs as the leased uid,
checks with that count that no other process runs as it (:data:`UID_CHECK`) before any code runs,
and the call starts again on another uid when one does. That is what makes
``RLIMIT_NPROC`` bind: the kernel counts processes per uid and ignores the limit for root, so a
fork bomb in one call fills its own uid's quota and nothing else. When the sandbox's first process
(PID 1 of its namespace) exits, the kernel kills every other process in the namespace, so nothing
a call started outlives it.

On top of the namespaces, every sandbox gets the seccomp filter of :mod:`mtflow.tools.seccomp`
(keyrings, tracing, namespaces, mounts and other shared kernel state denied) and, where this
process can make one, a cgroup of its own (:mod:`mtflow.tools.cgroup`: the call's memory as a
whole, ``memfd``, ``tmpfs`` and kernel memory included); the load-time report says which.

:func:`resolve_isolation` probes once per process (a real ``print`` run through the real command
line) and caches the answer; when no tool works, the answer says why, and the ``python`` tool
refuses its calls with that reason instead of running code unconfined.
"""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from mtflow.tools import cgroup, seccomp, subuid

#: what ``isolation:`` accepts: ``auto`` (bwrap, else unshare, else refuse), one tool (else
#: refuse), or ``none`` (no isolation; a warning at load time).
ISOLATION_CHOICES = ('auto', 'bwrap', 'unshare', 'none')

#: the PATH used for the helper programs the sandbox runs (mount, chroot, setpriv...)
SYSTEM_PATH = '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'

#: how many uids the lease block holds (concurrent calls per machine, all processes together)
UID_BLOCK = 4096


class IsolationUnavailable(RuntimeError):
    """No isolation tool works here (the message says what was tried and why it failed)."""


@dataclass(frozen=True)
class Isolation:
    """The isolation a ``python`` tool gets: ``kind`` is ``bwrap``, ``unshare`` or ``none``, or
    ``''`` when the requested isolation is unavailable (``detail`` then says why)."""
    requested: str
    kind: str
    detail: str

    @property
    def available(self) -> bool:
        return bool(self.kind)

    def describe(self) -> str:
        """One line for ``mtflow validate`` and the docs."""
        if not self.available:
            return f'no isolation available ({self.requested!r} requested): every call is refused: {self.detail}'
        if self.kind == 'none':
            return 'none (isolation: none): model code runs unconfined as this user'
        return f'{self.kind} ({self.detail})'


# ---- the interpreter and what it needs to see -----------------------------------------------------
@dataclass(frozen=True)
class Interpreter:
    """The Python the sandbox runs (this one's base interpreter, stdlib only: ``-I -S``)."""
    executable: str
    prefixes: Tuple[str, ...]  # directories to bind read-only besides /usr


def current_interpreter() -> Interpreter:
    exe = os.path.realpath(getattr(sys, '_base_executable', None) or sys.executable)
    prefixes = []
    for p in {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}:
        if not _under(p, '/usr'):
            prefixes.append(p)
    exe_dir = os.path.dirname(exe)
    if not _under(exe_dir, '/usr') and not any(_under(exe_dir, p) for p in prefixes):
        prefixes.append(exe_dir)
    return Interpreter(exe, tuple(sorted(prefixes)))


def with_site_packages(interp: Interpreter, site_packages: Sequence[str]) -> Interpreter:
    """``interp`` with the ``site_packages`` directories bound read-only as well (those not already
    in view under ``/usr`` or the interpreter's prefix)."""
    extra = [p for p in site_packages if not _under(p, '/usr') and not any(_under(p, q) for q in interp.prefixes)]
    return Interpreter(interp.executable, interp.prefixes + tuple(sorted(set(extra))))


#: where a ``site_packages`` directory may not be: the sandbox mounts its own file systems there
SITE_FORBIDDEN = ('/tmp', '/proc', '/dev')


def check_site_packages(paths: Sequence[str]) -> Tuple[str, ...]:
    """The ``site_packages`` option checked: absolute, existing directories, no whitespace, not
    under :data:`SITE_FORBIDDEN`; ``ValueError`` says which entry is wrong and why."""
    out = []
    for p in paths:
        if not isinstance(p, str) or not os.path.isabs(p):
            raise ValueError(f'site_packages entry {p!r} must be an absolute path')
        real = os.path.realpath(p)
        if not os.path.isdir(real):
            raise ValueError(f'site_packages entry {p!r} is not a directory')
        if any(c.isspace() for c in real):
            raise ValueError(f'site_packages entry {p!r} contains whitespace')
        bad = [f for f in SITE_FORBIDDEN if _under(real, f)]
        if bad:
            raise ValueError(f'site_packages entry {p!r} is under {bad[0]}, which the sandbox replaces with its own')
        out.append(real)
    return tuple(out)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip('/') + '/')


def _top_level_links() -> List[Tuple[str, Optional[str]]]:
    """``(/bin, 'usr/bin')`` for a merged-/usr link, ``(/lib64, None)`` for a real directory."""
    out = []
    for name in ('/bin', '/sbin', '/lib', '/lib32', '/lib64', '/libx32'):
        if os.path.islink(name):
            out.append((name, os.readlink(name)))
        elif os.path.isdir(name):
            out.append((name, None))
    return out


# ---- uid leases ----------------------------------------------------------------------------------
#: the lease block's first uid where the whole uid range is mapped. The block before this one
#: (``1200000000``) is what drivers before the root-only lease directory leased through
#: ``$TMPDIR``; a separate block keeps old and new drivers on one host from sharing a uid.
UID_BASE = 1_200_100_000


def _uid_base() -> int:
    """The first uid of the lease block: high in the largest range this user namespace maps (one
    block below the top, the top block being the one older drivers used)."""
    best = (0, 0)
    try:
        with open('/proc/self/uid_map', encoding='ascii') as f:
            for line in f:
                inside, _outside, count = (int(x) for x in line.split())
                if count > best[1]:
                    best = (inside, count)
    except (OSError, ValueError):
        best = (0, 1 << 32)
    start, count = best
    if count >= 1 << 31:
        return UID_BASE
    base = start + count - 2 * UID_BLOCK - 2
    if base <= 65535:
        raise IsolationUnavailable(f'this user namespace maps too few uids ({count}) for a block of '
                                   f'{UID_BLOCK} sandbox uids')
    return base


#: where root keeps its uid leases: one root-owned directory per host (not under ``$TMPDIR``,
#: which each driver may set differently and any user may pre-create names in)
LEASE_DIR = '/run/mtflow-sandbox-uids'


class LeaseDirUnsafe(IsolationUnavailable):
    """The lease directory exists but is not root's own (a symlink, another owner, open to
    others): sharing it could give two calls one uid, so every call is refused."""


def open_lease_dir(path: str = LEASE_DIR, owner: int = 0) -> int:
    """An ``O_DIRECTORY | O_NOFOLLOW`` fd on the lease directory, made (mode 0700) when missing;
    refused (:class:`LeaseDirUnsafe`, naming the path and what is wrong) unless it is a real
    directory owned by ``owner`` (root; rootless, this user: :func:`rootless_lease_dir`) with no
    access for others, in a parent only root may rename it in."""
    parent = os.path.dirname(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise IsolationUnavailable(f'cannot create the uid lease directory {path}: {exc.strerror}') from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        kind = 'a symlink or not a directory' if exc.errno in (errno.ELOOP, errno.ENOTDIR) else exc.strerror
        raise LeaseDirUnsafe(f'the uid lease directory {path} is unsafe ({kind}); remove it (root recreates it, '
                             f'mode 0700) and check who made it') from None
    st = os.fstat(fd)
    who = 'root' if owner == 0 else f'uid {owner}'
    problem = (f'owned by uid {st.st_uid}, not {who}' if st.st_uid != owner else
               f'mode {st.st_mode & 0o7777:04o} lets others in (must be 0700)' if st.st_mode & 0o077 else '')
    pst = os.stat(parent)
    if not problem and (pst.st_uid != 0 or pst.st_mode & 0o022 and not pst.st_mode & 0o1000):
        problem = f'its parent {parent} is writable by others'
    if problem:
        os.close(fd)
        raise LeaseDirUnsafe(f'the uid lease directory {path} is unsafe ({problem}); remove it ({who} recreates '
                             'it, mode 0700) and check who made it')
    return fd


def rootless_lease_dir() -> str:
    """Where this (normal) user leases its subordinate uids (:mod:`mtflow.tools.subuid`): one
    directory per user and host, whatever each driver's ``$TMPDIR``, as root's :data:`LEASE_DIR`."""
    return f'/tmp/mtflow-sandbox-uids-{os.geteuid()}'


@dataclass(frozen=True)
class UidBlock:
    """The uids a :class:`UidLease` is drawn from: ``size`` from ``base``, leased in ``lease_dir``
    (owned by ``owner``)."""
    base: int
    size: int
    lease_dir: str
    owner: int


class UidLease:
    """An exclusively held uid (``flock`` on ``<lease dir>/<uid>``, :data:`LEASE_DIR`), released by
    :meth:`release`. Every root process on the host, whatever its ``$TMPDIR``, leases from the same
    root-only directory, so two drivers never share a uid. Another container on the same kernel
    has a lease directory of its own (its own ``/run``): the sandbox's launcher checks that no
    other process runs as the uid (:data:`UID_CHECK`), and a uid found in use is skipped here for
    :data:`UID_BUSY_S` (:meth:`mark_busy`). The scan starts at a random uid drawn from the
    operating system, never from ``random`` (which a training script seeds: every container would
    then start at the same uid)."""

    _dir_fds: Dict[str, int] = {}
    _dir_lock = threading.Lock()
    lease_dir = LEASE_DIR
    #: uid -> until when (``time.monotonic``) it is skipped: found in use outside this host's leases
    _busy: Dict[int, float] = {}

    def __init__(self, block: Optional[UidBlock] = None) -> None:
        """A uid of root's block (:data:`UID_BLOCK` from :func:`_uid_base`, in :attr:`lease_dir`),
        or of ``block`` (rootless: this user's subordinate uids)."""
        if block is None:
            block = UidBlock(_uid_base(), UID_BLOCK, self.lease_dir, 0)
        base, size = block.base, block.size
        dir_fd = self._open_dir(block.lease_dir, block.owner)
        start = self._first() % size
        now = time.monotonic()
        for k in range(size):
            uid = base + (start + k) % size
            if self._busy.get(uid, 0.0) > now:
                continue
            try:
                fd = os.open(str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
            except OSError as exc:
                raise LeaseDirUnsafe(f'cannot open the lease file {block.lease_dir}/{uid} ({exc.strerror}): the uid '
                                     'lease directory holds something its owner did not make there') from None
            st = os.fstat(fd)
            if not (st.st_uid == block.owner and (st.st_mode & 0o170000) == 0o100000):
                os.close(fd)
                raise LeaseDirUnsafe(f'the lease file {block.lease_dir}/{uid} is not a regular file of its owner')
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EAGAIN, errno.EACCES):
                    continue
                raise
            self.uid, self._fd = uid, fd
            return
        raise IsolationUnavailable(f'all {size} sandbox uids are in use (leases in {block.lease_dir}): '
                                   'fewer concurrent calls, or wait for running ones to end')

    @staticmethod
    def _first() -> int:
        """Where the scan starts: a uniformly random offset in the block, from the OS."""
        return secrets.randbelow(UID_BLOCK)

    @classmethod
    def mark_busy(cls, uid: int) -> None:
        """``uid`` is in use by processes this host's leases do not know (a sandbox of another
        container on this kernel): skip it for :data:`UID_BUSY_S`."""
        with cls._dir_lock:
            now = time.monotonic()
            for stale in [u for u, until in cls._busy.items() if until <= now]:
                del cls._busy[stale]
            cls._busy[uid] = now + UID_BUSY_S

    @classmethod
    def _open_dir(cls, path: str, owner: int) -> int:
        with cls._dir_lock:
            if path not in cls._dir_fds:
                cls._dir_fds[path] = open_lease_dir(path, owner)
            return cls._dir_fds[path]

    @classmethod
    def forget_dir(cls) -> None:
        """Close the cached directory fds (tests that point :attr:`lease_dir` elsewhere)."""
        with cls._dir_lock:
            for fd in cls._dir_fds.values():
                os.close(fd)
            cls._dir_fds.clear()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


#: how long a uid found in use outside this host's leases is skipped (:meth:`UidLease.mark_busy`)
UID_BUSY_S = 60.0

#: the launcher's exit status when its uid is in use (:data:`UID_CHECK`): nothing of the program
#: ran, and the call starts again on another uid. (A program's own status 118 is told apart by the
#: check's pipe: the launcher writes to it before the program runs, and only when the uid was free.)
UID_BUSY_STATUS = 118

#: run first by the launcher of a sandbox as root, as the leased uid (``{fd}``: the write end of a
#: pipe to the driver). The kernel counts the tasks of each uid (``RLIMIT_NPROC``'s count) for the
#: whole kernel: every container on it shares the count, whatever its ``/run``, PID namespace or
#: network namespace. With ``RLIMIT_NPROC`` at 2, a ``fork`` succeeds only if this process is the
#: uid's only task (the child would be the second), else it fails with ``EAGAIN``: another
#: container's call runs as this uid, so this launcher exits with :data:`UID_BUSY_STATUS` before
#: anything of the program ran. Claim, then count, as a lock does: two launchers that become the
#: same uid at once both see two tasks and both give way, and one that checked alone keeps the uid
#: until its call ends, so any later one sees it. On success it writes ``1`` to ``{fd}`` and closes it.
UID_CHECK = r'''
_nproc = resource.getrlimit(resource.RLIMIT_NPROC)
resource.setrlimit(resource.RLIMIT_NPROC, (2, _nproc[1]))
try:
    _kid = os.fork()
except BlockingIOError:
    os._exit({busy})
if _kid == 0:
    os._exit(0)
os.waitpid(_kid, 0)
resource.setrlimit(resource.RLIMIT_NPROC, _nproc)
os.write({fd}, b'1')
os.close({fd})
del _nproc, _kid
'''


def uid_check_code(fd: int) -> str:
    """:data:`UID_CHECK` for the launcher, reporting on ``fd``."""
    return UID_CHECK.format(fd=fd, busy=UID_BUSY_STATUS)


def processes_of_uid(uid: int) -> List[int]:
    """The pids (host view) whose real uid is ``uid`` (from ``/proc/<pid>/status``, which, unlike
    the owner of ``/proc/<pid>``, a process cannot hide by making itself non-dumpable)."""
    found = []
    want = str(uid)
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            with open(f'/proc/{name}/status', 'rb') as f:
                for line in f:
                    if line.startswith(b'Uid:'):
                        if line.split()[1].decode() == want:
                            found.append(int(name))
                        break
        except OSError:
            pass
    return found


def namespace_init(outer_pid: int) -> Optional[int]:
    """The host pid of the sandbox's PID 1: the one child of the outer ``bwrap``/``unshare``."""
    try:
        with open(f'/proc/{outer_pid}/task/{outer_pid}/children', encoding='ascii') as f:
            children = f.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def wait_uid_gone(uid: int, timeout_s: float = 10.0) -> bool:
    """Wait until no process runs as ``uid`` (the kernel is still tearing a namespace down right
    after its PID 1 was killed); true when none is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not processes_of_uid(uid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


# ---- command lines -------------------------------------------------------------------------------
@dataclass(frozen=True)
class SandboxCommand:
    """What to execute for one call: ``argv``, its environment, and a host directory to remove."""
    argv: List[str]
    env: Dict[str, str]
    cwd: Optional[str] = None
    scratch: Optional[str] = None  # host directory to delete afterwards (unshare's mount point)


def _setpriv(setpriv: str, uid: int) -> List[str]:
    return [setpriv, f'--reuid={uid}', f'--regid={uid}', '--clear-groups', '--no-new-privs',
            '--inh-caps=-all', '--bounding-set=-all', '--']


def tmp_inodes(tmp_mb: int) -> int:
    """The inode cap of a sandbox's ``/tmp`` or ``/dev/shm`` (``nr_inodes``: 256 per MB, at least
    1024), so that a flood of empty files cannot grow kernel memory far beyond what ``tmp_mb`` says."""
    return max(1024, tmp_mb * 256)


#: the default size of a sandbox's own ``/dev/shm`` (``shm_mb``): POSIX semaphores and shared
#: memory (``multiprocessing.Pool``, ``Queue``, ``shared_memory``); a ``tmpfs`` like ``/tmp``
SHM_MB = 16


def tmpfs_options(size_mb: int) -> str:
    """``size`` and ``nr_inodes`` of one of the sandbox's own ``tmpfs`` mounts (``/tmp``, ``/dev/shm``)."""
    return f'size={size_mb * 1024 * 1024},nr_inodes={tmp_inodes(size_mb)}'


#: rootless bwrap: the launcher (``mtflow.tools.sandbox.process``) mounts the sandbox's ``/tmp``
#: (and its own ``/dev/shm``) itself, because only a mount made there can cap its inodes (bubblewrap 0.8's ``--tmpfs`` has
#: ``--size`` but no ``nr_inodes``, and util-linux ``mount`` refuses a uid other than 0). bwrap
#: leaves it ``CAP_SYS_ADMIN`` for this (``--cap-add``), but in the nested user namespace bwrap
#: makes to switch to ``nobody``, which does not own bwrap's mount namespace: so the launcher first
#: makes a mount namespace of its own (the mounts it inherits are locked: still read-only, not
#: removable), mounts ``/tmp`` there, then drops every capability and checks they are gone, before
#: the filter is installed and before the program is read. It needs
#: :data:`mtflow.tools.seccomp.FFI_CODE` run before it.
_MOUNT_TMP = r'''
if _fn('unshare')(0x20000) != 0 or _fn('mount')(  # CLONE_NEWNS; 6: MS_NOSUID | MS_NODEV
        b'mtflow-tmp', b'/tmp', b'tmpfs', 6, b'mode=1777,{tmp}') != 0 or _fn('mount')(
        b'mtflow-shm', b'/dev/shm', b'tmpfs', 6, b'mode=1777,{shm}') != 0:
    os.write(2, b'mtflow launcher: could not mount /tmp and /dev/shm (errno %d)\n' % _ct.get_errno())
    os._exit(126)
os.chdir('/tmp')
_fn('prctl')(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
_fn('capset')((0x20080522).to_bytes(4, sys.byteorder) + bytes(4), bytes(24))  # version 3, pid 0; all zero
with open('/proc/self/status') as _f:
    _caps = [_l.split()[1] for _l in _f if _l.startswith(('CapInh', 'CapPrm', 'CapEff', 'CapAmb'))]
if len(_caps) != 4 or any(int(_x, 16) for _x in _caps):
    os.write(2, b'mtflow launcher: could not drop the capabilities it mounted /tmp with\n')
    os._exit(126)
del _f, _caps
'''


def mount_tmp_code(tmp_mb: int, shm_mb: int = SHM_MB) -> str:
    """Python source (:data:`_MOUNT_TMP`) that mounts a rootless sandbox's ``/tmp`` (``tmp_mb``,
    :func:`tmp_inodes`) and ``/dev/shm`` (``shm_mb``) and drops the capability it did so with."""
    return _MOUNT_TMP.format(tmp=tmpfs_options(tmp_mb), shm=tmpfs_options(shm_mb))


#: ``/proc`` files of kernel state that no namespace separates, masked with ``/dev/null`` (as
#: Docker masks them): rootless, ``/proc/keys`` lists the names and payload sizes of the driver
#: user's keys (the program is that user outside its namespace), ``/proc/key-users`` their counts
MASKED_PROC = ('/proc/keys', '/proc/key-users')


def _masked_proc() -> List[str]:
    return [p for p in MASKED_PROC if os.path.exists(p)]


#: the uid a rootless sandbox's program has inside its user namespace (``nobody``)
ROOTLESS_UID = 65534


def rootless() -> bool:
    """Not root: bwrap then makes its own user namespace (the program is ``nobody`` inside and,
    outside, a subordinate uid of its own or this user), and the process limit counts per
    namespace instead of per leased uid (and, for the namespaces' creator, against this user's:
    :mod:`mtflow.tools.sandbox.budget`)."""
    return os.geteuid() != 0


def bwrap_command(bwrap: str, setpriv: Optional[str], interp: Interpreter, uid: Optional[int], tmp_mb: int,
                  python_argv: Sequence[str], shm_mb: int = SHM_MB) -> SandboxCommand:
    """bwrap as root, dropping to the leased ``uid`` with setpriv; or, with ``uid=None``
    (:func:`rootless`), in a new user namespace. ``/tmp`` is mounted by the sandbox itself, with
    ``nr_inodes`` (:func:`tmp_inodes`), which bubblewrap 0.8's ``--tmpfs`` cannot set: as root by
    PID 1 (``mount``), rootless by the launcher, which bwrap gives ``CAP_SYS_ADMIN`` of the
    sandbox's own user namespace for it (``--cap-add``) and which drops it before the program. Its
    own writable ``/dev/shm`` (``shm_mb``) is mounted the same way, over the read-only ``/dev``."""
    userns = ['--unshare-user', '--uid', str(ROOTLESS_UID), '--gid', str(ROOTLESS_UID), '--disable-userns',
              '--cap-add', 'CAP_SYS_ADMIN'] if uid is None else []
    argv = [bwrap, *userns, '--unshare-pid', '--unshare-net', '--unshare-ipc', '--unshare-uts', '--unshare-cgroup-try',
            '--die-with-parent', '--new-session', '--clearenv', '--ro-bind', '/usr', '/usr']
    for name, target in _top_level_links():
        argv += ['--symlink', target, name] if target is not None else ['--ro-bind', name, name]
    made = set()
    for prefix in interp.prefixes:
        parts = prefix.strip('/').split('/')
        for i in range(1, len(parts)):
            parent = '/' + '/'.join(parts[:i])
            if parent not in made and parent != '/usr':
                argv += ['--perms', '0755', '--dir', parent]
                made.add(parent)
        argv += ['--ro-bind', prefix, prefix]
    argv += ['--proc', '/proc']
    for path in _masked_proc():
        argv += ['--dev-bind', '/dev/null', path]  # (a device on a --ro-bind is nodev: EACCES)
    argv += ['--dev', '/dev', '--perms', '01777', '--dir', '/tmp', '--remount-ro', '/dev',
             '--remount-ro', '/', '--chdir', '/tmp', '--as-pid-1', '--', '/bin/sh', '-c', _INIT_SCRIPT, 'mtflow-init',
             *((tmpfs_options(tmp_mb), tmpfs_options(shm_mb)) if uid is not None else ('-', '-'))]
    argv += (_setpriv(setpriv, uid) if uid is not None and setpriv else []) + list(python_argv)
    return SandboxCommand(argv, {'PATH': SYSTEM_PATH})


# PID 1 of a bwrap sandbox (``--as-pid-1``): sh, out of the program's reach (root; rootless, it
# keeps a capability the program lacks, so the program may not open its /proc/1/mem either). As
# root it first mounts the sandbox's /tmp (size and inode cap in $1; "-": the launcher mounts it).
# It runs the program (pid 2) and reports its status (128 + N for signal N). bwrap itself then
# waits for this PID 1, so when bwrap exits the namespace is gone, and a kill of PID 1 from
# outside is reaped by bwrap (no orphan, no zombie for the host's init). As root it also mounts the
# sandbox's own /dev/shm ($2) over the read-only /dev. The program runs in the
# background only so that sh prints no "Killed" of its own into the output.
_INIT_SCRIPT = ('if [ "$1" != - ]; then mount -t tmpfs -o "mode=1777,nosuid,nodev,$1" mtflow-tmp /tmp && cd /tmp '
                '&& mount -t tmpfs -o "mode=1777,nosuid,nodev,$2" mtflow-shm /dev/shm && unset OLDPWD '
                '|| exit 125; fi; shift 2; exec 3<&0; "$@" <&3 3<&- & wait $! 2>/dev/null; exit $?')
# (a background job's stdin would be /dev/null; a warm sandbox's program comes on stdin)


# The unshare fallback: sh is PID 1 of the new namespaces and builds the root on a tmpfs mounted
# over a host scratch directory (only in this private mount namespace), then runs the program
# chrooted into it as the sandbox uid, and stays PID 1 (root, out of the program's reach) until the
# program ends: its exit status is the program's (128 + N for a signal, as bwrap reports it), and
# its exit ends the namespace.
_UNSHARE_SCRIPT = r'''
set -eu
R=$1; UID_=$2; TMP_OPTS=$3; SETPRIV=$4; SHM_OPTS=$5; shift 5
mount -t tmpfs -o mode=0755,size=1m mtflow-root "$R"
ro_bind() { mkdir -p "$R$1"; mount --bind "$1" "$R$1"; mount -o remount,bind,ro "$R$1"; }
ro_bind /usr
for d in /bin /sbin /lib /lib32 /lib64 /libx32; do
  if [ -L "$d" ]; then ln -s "$(readlink "$d")" "$R$d"; elif [ -d "$d" ]; then ro_bind "$d"; fi
done
for p in $MTFLOW_PREFIXES; do ro_bind "$p"; done
mkdir -p "$R/proc" "$R/dev" "$R/tmp"
mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
for f in $MTFLOW_MASKED; do mount --bind /dev/null "$R$f"; done
mount -t tmpfs -o mode=0755,size=64k mtflow-dev "$R/dev"
for n in null zero full random urandom; do touch "$R/dev/$n"; mount --bind "/dev/$n" "$R/dev/$n"; done
ln -s /proc/self/fd "$R/dev/fd"
mkdir "$R/dev/shm"
mount -t tmpfs -o "mode=1777,nosuid,nodev,$TMP_OPTS" mtflow-tmp "$R/tmp"
mount -o remount,ro,bind "$R/dev"
mount -t tmpfs -o "mode=1777,nosuid,nodev,$SHM_OPTS" mtflow-shm "$R/dev/shm"
mount -o remount,ro,bind "$R"
cd "$R/tmp"
set +e
exec 3<&0
chroot "$R" /usr/bin/env -i -C /tmp "$SETPRIV" --reuid="$UID_" --regid="$UID_" --clear-groups \
  --no-new-privs --inh-caps=-all --bounding-set=-all -- "$@" <&3 3<&- &
wait $! 2>/dev/null  # (in the background, so sh prints no "Killed" of its own into the output)
exit $?
'''


def unshare_command(unshare: str, setpriv: str, interp: Interpreter, uid: int, tmp_mb: int,
                    python_argv: Sequence[str], shm_mb: int = SHM_MB) -> SandboxCommand:
    scratch = tempfile.mkdtemp(prefix='mtflow-root-')
    argv = [setpriv, '--pdeathsig', 'KILL', '--', unshare, '--pid', '--fork', '--kill-child', '--net', '--ipc',
            '--uts', '--mount', '--propagation', 'private', '--', '/bin/sh', '-c', _UNSHARE_SCRIPT, 'mtflow-sandbox',
            scratch, str(uid), tmpfs_options(tmp_mb), setpriv, tmpfs_options(shm_mb)] + list(python_argv)
    env = {'PATH': SYSTEM_PATH, 'MTFLOW_PREFIXES': ' '.join(interp.prefixes), 'MTFLOW_MASKED': ' '.join(_masked_proc())}
    return SandboxCommand(argv, env, scratch=scratch)


# ---- probing -------------------------------------------------------------------------------------
@dataclass
class _Tools:
    bwrap: Optional[str] = None
    unshare: Optional[str] = None
    setpriv: Optional[str] = None
    problems: Dict[str, str] = field(default_factory=dict)


def _find_tools() -> _Tools:
    found = _Tools(shutil.which('bwrap'), shutil.which('unshare'), shutil.which('setpriv'))
    if found.setpriv:
        found.setpriv = os.path.realpath(found.setpriv)
    if not found.setpriv or not _under(found.setpriv, '/usr'):
        # setpriv runs inside the sandbox root, which holds /usr only
        found.problems['setpriv'] = ('setpriv (util-linux) not found on PATH' if not found.setpriv else
                                     f'setpriv at {found.setpriv} is outside /usr')
        found.setpriv = None
    return found


def build_command(kind: str, uid: Optional[int], tmp_mb: int, python_argv: Sequence[str],
                  site_packages: Sequence[str] = (), shm_mb: int = SHM_MB, enter: Sequence[str] = ()) -> SandboxCommand:
    """The command line for one sandboxed call with isolation ``kind`` (``bwrap``/``unshare``), as
    the leased ``uid`` (root), or rootless (``uid=None``: bwrap only), then run under ``enter``
    (:meth:`mtflow.tools.subuid.SubordinateIds.enter_argv`: on a subordinate uid of its own);
    ``site_packages``: directories (checked by :func:`check_site_packages`) bound read-only
    besides the interpreter; ``shm_mb``: the size of its own ``/dev/shm``.
    (The seccomp filter is installed by the launcher in ``python_argv``, after ``/tmp`` is mounted.)"""
    tools = _find_tools()
    interp = with_site_packages(current_interpreter(), site_packages)
    if kind == 'bwrap':
        if not tools.bwrap:
            raise IsolationUnavailable('bwrap (bubblewrap) not found on PATH')
    elif kind == 'unshare':
        if not tools.unshare:
            raise IsolationUnavailable('unshare (util-linux) not found on PATH')
    else:
        raise ValueError(f'unknown isolation kind {kind!r}')
    if uid is None:
        if kind != 'bwrap':
            raise IsolationUnavailable('unshare needs root (it mounts the sandbox root and switches uid); '
                                       'without root only bwrap (with a user namespace) can isolate')
        cmd = bwrap_command(tools.bwrap, None, interp, None, tmp_mb, python_argv, shm_mb)
        return SandboxCommand([*enter, *cmd.argv], cmd.env)
    if tools.setpriv is None:
        raise IsolationUnavailable(tools.problems['setpriv'])
    if kind == 'bwrap':
        return bwrap_command(tools.bwrap, tools.setpriv, interp, uid, tmp_mb, python_argv, shm_mb)
    return unshare_command(tools.unshare, tools.setpriv, interp, uid, tmp_mb, python_argv, shm_mb)


_PROBE_CODE = ('import os, sys; sys.stdout.write("mtflow-probe %d %d" % '
               '(len([p for p in os.listdir("/proc") if p.isdigit()]), os.getuid()))')


# ---- rootless: subordinate uids ------------------------------------------------------------------
def subordinate_ids() -> Optional[subuid.SubordinateIds]:
    """Rootless, this process's namespace of subordinate uids (:mod:`mtflow.tools.subuid`): each
    call then runs on a host uid of its own; ``None`` as root, or where this user has none
    (:func:`why_no_subordinate_ids` says why)."""
    if not rootless():
        return None
    try:
        return subuid.helper()
    except subuid.SubuidUnavailable:
        return None


def why_no_subordinate_ids() -> str:
    try:
        subuid.helper()
    except subuid.SubuidUnavailable as exc:
        return str(exc)
    return ''


def subordinate_block(ids: subuid.SubordinateIds) -> UidBlock:
    """The uids a rootless call leases from: the helper namespace's block, leased in this user's
    :func:`rootless_lease_dir`."""
    return UidBlock(ids.uid_base, ids.size, rootless_lease_dir(), os.geteuid())


def probe(kind: str, timeout_s: float = 30.0) -> Optional[str]:
    """Run a tiny program with isolation ``kind``; ``None`` when it worked as it must (in a new
    PID namespace, where it sees only itself and the namespace's init, as the leased uid), else
    why not. Rootless it tries a subordinate uid first (:func:`subordinate_ids`); where that fails,
    this process uses none from then on (:func:`mtflow.tools.subuid.refuse`) and runs the calls as
    this user."""
    ids = subordinate_ids() if kind == 'bwrap' else None
    why = _probe(kind, ids, timeout_s) if ids is not None else 'no subordinate uids'
    if why is None:
        return None
    plain = _probe(kind, None, timeout_s)
    if ids is not None and plain is None:  # what failed was the subordinate uid (an interpreter it cannot read...)
        subuid.refuse(f'a probe on a subordinate uid failed: {why}')
    return plain


def _probe(kind: str, ids: Optional[subuid.SubordinateIds], timeout_s: float) -> Optional[str]:
    lease = None
    try:
        lease = UidLease() if not rootless() else UidLease(subordinate_block(ids)) if ids is not None else None
    except (IsolationUnavailable, OSError) as exc:
        return str(exc)
    want_uid = lease.uid if lease is not None and not rootless() else ROOTLESS_UID
    cmd = None
    try:
        # rootless, the probe mounts its /tmp as the launcher will (a kernel that forbids it refuses here)
        code = _PROBE_CODE if not rootless() else \
            'import os, sys\n' + seccomp.FFI_CODE + mount_tmp_code(1, 1) + _PROBE_CODE
        python_argv = [current_interpreter().executable, '-I', '-S', '-c', code]
        cmd = build_command(kind, None if rootless() or lease is None else lease.uid, 1, python_argv,
                            enter=ids.enter_argv(lease.uid) if ids is not None and lease is not None else ())
        proc = subprocess.run(cmd.argv, env=cmd.env, cwd=cmd.cwd, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout_s, start_new_session=True)
    except IsolationUnavailable as exc:
        return str(exc)
    except (OSError, subprocess.SubprocessError) as exc:
        return f'{kind} could not be run: {exc}'
    finally:
        if cmd is not None and cmd.scratch:
            _remove_scratch(cmd.scratch)
        if lease is not None:
            if not rootless():
                wait_uid_gone(lease.uid, 5.0)
            lease.release()
    out = proc.stdout.decode('utf-8', 'replace').split()
    if proc.returncode != 0 or len(out) != 3 or out[0] != 'mtflow-probe':
        err = (proc.stderr.decode('utf-8', 'replace').strip() or proc.stdout.decode('utf-8', 'replace').strip())
        return f'{kind} failed (exit status {proc.returncode}): {err[-300:] or "no output"}'
    if int(out[1]) > 2 or int(out[2]) != want_uid:
        return (f'{kind} ran the program as uid {out[2]}, seeing {out[1]} processes: not the namespace and uid '
                'it must have')
    return None


def _remove_scratch(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


_DETAIL = {
    'bwrap': 'bubblewrap: new pid, net (lo only), ipc, uts and mount namespaces; read-only /usr and '
             'interpreter; private /tmp; dedicated unprivileged uid with its own process limit',
    'unshare': 'unshare (util-linux): new pid, net (lo only), ipc, uts and mount namespaces; chroot into '
               'read-only /usr and interpreter; private /tmp; dedicated unprivileged uid with its own process limit',
}


def _rootless_detail() -> str:
    ids = subordinate_ids()
    if ids is not None:
        return f'own user namespace (nobody inside) on {ids.describe()}'
    return (f'own user namespace (nobody inside) as this user (no subordinate uids: {why_no_subordinate_ids()}): '
            'per-user kernel quotas (pipe buffers, descriptors in flight) are shared with the driver and every call')


_cache: Dict[str, Isolation] = {}
_cache_lock = threading.Lock()


def resolve_isolation(requested: str = 'auto') -> Isolation:
    """The isolation ``requested`` (one of :data:`ISOLATION_CHOICES`) gives on this machine,
    probed once per process."""
    if requested not in ISOLATION_CHOICES:
        raise ValueError(f'isolation must be one of {", ".join(ISOLATION_CHOICES)}, got {requested!r}')
    if requested == 'none':
        return Isolation('none', 'none', 'no isolation')
    with _cache_lock:
        cached = _cache.get(requested)
        if cached is not None:
            return cached
        kinds = ['bwrap', 'unshare'] if requested == 'auto' else [requested]
        reasons = []
        result = None
        filter_ok, filter_detail = seccomp.describe()
        for kind in kinds:
            why = probe(kind) if filter_ok else f'{kind}: {filter_detail}'
            if why is None:
                detail = _DETAIL[kind]
                if rootless():
                    detail = detail.replace('dedicated unprivileged uid with its own process limit', _rootless_detail())
                result = Isolation(requested, kind, f'{detail}; {filter_detail}; {cgroup.support().describe()}')
                break
            reasons.append(why if why.startswith(kind) else f'{kind}: {why}')
        if result is None:
            result = Isolation(requested, '', '; '.join(reasons))
        _cache[requested] = result
        return result


def forget_probes() -> None:
    """Drop the cached probe results (tests that change PATH, or after installing bubblewrap)."""
    with _cache_lock:
        _cache.clear()
