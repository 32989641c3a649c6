"""The sandbox's seccomp filter and the fresh session keyring each sandbox is started in.

The filter is built with libseccomp (``pyseccomp``, a ctypes binding; Debian's ``python3-seccomp``
has the same API), never by hand, modelled on Docker's default profile and Flatpak's: every
syscall is allowed except those that reach shared kernel state or widen the kernel's attack
surface, which fail with ``EPERM`` (``clone3`` with ``ENOSYS``, as Docker does, so that the C
library falls back to ``clone``, whose namespace flags a filter can see). Syscalls of a foreign
ABI (``int 0x80``, x32) kill the process (libseccomp's default for a wrong architecture).

The sandbox's launcher installs it with ``prctl`` (bwrap and unshare alike: after the sandbox's
``/tmp`` is mounted, which the filter would deny, and before it runs the code). Where no cgroup
counts the call's memory, :func:`filter_bpf` ``(bounded=False)`` also denies
:data:`DENIED_UNBOUNDED`, the ways to hold memory no process maps.

The keyring: kernel keyrings are not namespaced. A process inherits its parent's session
keyring, and every process of a uid shares that uid's user keyring; the filter denies the three
key syscalls outright, and each sandbox is also started from a thread that has just joined a new
anonymous session keyring (what runc and systemd's ``KeyringMode=private`` do), so not even the
driver's session keyring is its own.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, TypeVar

__all__ = ['ArgDenial', 'DENIED', 'DENIED_ARGS', 'DENIED_UNBOUNDED', 'SQLITE_CODE', 'NAMESPACE_FLAGS', 'SeccompUnavailable', 'filter_bpf', 'filter_fd',
           'in_fresh_keyring', 'spawn']

T = TypeVar('T')

#: the syscalls the sandbox may not make (``EPERM``); those unknown to this kernel or
#: architecture are skipped
DENIED: Tuple[str, ...] = (
    # kernel keyrings (shared across namespaces)
    'add_key', 'keyctl', 'request_key',
    # other processes' memory, tracing, kernel programs and counters
    'ptrace', 'process_vm_readv', 'process_vm_writev', 'kcmp', 'bpf', 'perf_event_open', 'userfaultfd',
    'io_uring_setup', 'io_uring_enter', 'io_uring_register',
    # namespaces, mounts, roots
    'unshare', 'setns', 'mount', 'umount2', 'pivot_root', 'chroot', 'mount_setattr', 'move_mount', 'open_tree',
    'fsopen', 'fsconfig', 'fsmount', 'fspick', 'open_by_handle_at', 'name_to_handle_at',
    # the kernel itself and the machine
    'kexec_load', 'kexec_file_load', 'init_module', 'finit_module', 'delete_module', 'reboot', 'swapon', 'swapoff',
    'acct', 'quotactl', 'quotactl_fd', 'syslog', 'iopl', 'ioperm', 'settimeofday', 'clock_settime', 'clock_adjtime',
    'adjtimex', 'uselib', 'ustat', 'sysfs', '_sysctl', 'nfsservctl', 'lookup_dcookie', 'vhangup',
    # per-user kernel quotas shared with the driver's uid when rootless
    'inotify_init', 'inotify_init1', 'fanotify_init', 'fanotify_mark',
    # secret memory (mlocked, outside the page cache): nothing a sandboxed program needs
    'memfd_secret',
    # user pages pinned into pipes, owned by no process: 1536 MB through 3 pipes rootless, bounded
    # only by the user's pipe quota
    'vmsplice',
    # page-cache folios pinned into pipes and socket buffers (issue 52, 1): a pipe slot (or a unix
    # socket's buffer) that holds one spliced byte of a file holds that byte's whole folio, up to
    # 2 MB where the file was mapped with huge pages; neither rlimits nor the call's cgroup count
    # a folio the host cached already, and the pipe quota counts the slot as one page: 1024 MB held
    # under memory_mb 64. (tee only copies those references; sendfile into a pipe or a socket
    # splices; shutil.copyfile, socket.sendfile and asyncio fall back to read and write on EPERM)
    'splice', 'tee', 'sendfile', 'sendfile64',
    # channels between calls: flock on a shared read-only file (a filter cannot see which file);
    # page-cache residency (cachestat; the kernel restricts mincore already), eviction of another
    # process's pages (process_madvise); AIO, whose iocb can ask RWF_NOWAIT out of the filter's view
    'flock', 'cachestat', 'process_madvise', 'io_setup', 'io_submit',
)

#: denied as well where no cgroup bounds the call (rootless, or a host that gives no cgroup): the
#: ways to hold memory that no process maps, which ``RLIMIT_AS`` cannot see and nothing else bounds
#: there: ``memfd_create`` (shared memory of any size, one ``max_file_mb`` per fd), and System V
#: IPC, whose limits in a fresh IPC namespace are the kernel's defaults (shared memory segments
#: that outlive their mapping, ``kernel.shmall`` about 2^64 bytes; 32000 message queues of 16 kB;
#: 32000 semaphore sets of 32000). The program's own code reaches it through a memfd the driver
#: made outside the sandbox, so nothing of the launcher needs them. And ``epoll``: its watches are
#: kernel memory that only a cgroup counts, and their per-user quota (``fs.epoll.max_user_watches``)
#: is the driver's own when rootless; one call of 64 processes with 64 fds each can register about
#: 64 x 32 x 32 x 64 = 4M watches (an fd number and file per watch, the file kept open elsewhere).
#: The launcher then hides ``select.epoll``, so ``selectors`` and ``asyncio`` use ``poll``.
DENIED_UNBOUNDED: Tuple[str, ...] = ('memfd_create', 'shmget', 'msgget', 'semget', 'epoll_create', 'epoll_create1')

@dataclass(frozen=True)
class ArgDenial:
    """One syscall denied (``EPERM``) when its arguments match every ``(index, value, mask)`` of
    ``args`` (``arg & mask == value``); ``bounded_too`` false: only where no cgroup bounds the
    call. ``reason`` is why (the docs' table repeats it)."""
    syscall: str
    args: Tuple[Tuple[int, int, int], ...]
    reason: str
    bounded_too: bool = True


#: the mask for an ``int`` argument: the kernel reads only its low 32 bits, so a filter that
#: compared all 64 would let ``AF_VSOCK | 1 << 32`` through
_INT = 0xFFFFFFFF
SOL_SOCKET, AF_INET, AF_INET6, AF_NETLINK, AF_VSOCK = 1, 2, 10, 16, 40
NETLINK_KOBJECT_UEVENT = 15
F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW, F_SETLEASE = 5, 6, 7, 36, 37, 38, 1024
RWF_NOWAIT, POSIX_FADV_DONTNEED, MADV_COLD, MADV_PAGEOUT = 0x8, 4, 20, 21
_BUFFERS = ('SO_SNDBUF', 7), ('SO_RCVBUF', 8), ('SO_SNDBUFFORCE', 32), ('SO_RCVBUFFORCE', 33)
_LOCKS = (('F_GETLK', F_GETLK), ('F_SETLK', F_SETLK), ('F_SETLKW', F_SETLKW), ('F_OFD_GETLK', F_OFD_GETLK),
          ('F_OFD_SETLK', F_OFD_SETLK), ('F_OFD_SETLKW', F_OFD_SETLKW), ('F_SETLEASE', F_SETLEASE))

#: the syscalls denied by argument: what ordinary programs do not need and what a channel between
#: calls, or memory outside the call's bound, does. Locks: a filter cannot see which file an fd
#: is, and every lock is a channel on a file two calls share (``flock`` on a read-only ``/usr``
#: file; ``fcntl`` write locks on the host's ``/dev/null``, which is writable on a read-only mount;
#: ``F_GETLK`` sees a neighbour's read lock) and kernel memory outside the cgroup (one lock record
#: per byte range: 341,600 in 5 s), so record locks are denied everywhere and sqlite is given a VFS
#: that locks with files instead (:data:`SQLITE_CODE`). ``flock`` itself is in :data:`DENIED`.
DENIED_ARGS: Tuple[ArgDenial, ...] = (
    ArgDenial('socket', ((0, AF_VSOCK, _INT),),
              'AF_VSOCK is outside the network namespace: the VM\'s port space, shared by every call and the host'),
    ArgDenial('socket', ((0, AF_NETLINK, _INT), (2, NETLINK_KOBJECT_UEVENT, _INT)),
              'the kernel sends uevents (devices added, removed, changed) to every network namespace its first '
              'user namespace owns: as root each call\'s, so a call would watch the host\'s devices and a host '
              'event it can cause (a synthetic uevent) would reach every call'),
    *(ArgDenial('socket', ((0, family, _INT),),
                'IP sockets, with a cgroup too: TCP buffers are one pool for the whole kernel, not charged to a v1 '
                'memory cgroup (one call queued 440 MB under memory_mb: 64, and could stall every TCP socket of '
                'the host); only the sandbox\'s own lo is there anyway') for family in (AF_INET, AF_INET6)),
    *(ArgDenial('setsockopt', ((1, SOL_SOCKET, _INT), (2, option, _INT)),
                f'{name}: raised socket buffers are kernel memory only a cgroup counts (60 unix sockets held 494 MB)',
                bounded_too=False) for name, option in _BUFFERS),
    ArgDenial('preadv2', ((5, RWF_NOWAIT, RWF_NOWAIT),),
              'RWF_NOWAIT reads tell whether a shared file\'s pages are cached: a channel between calls'),
    ArgDenial('pwritev2', ((5, RWF_NOWAIT, RWF_NOWAIT),), 'RWF_NOWAIT, as for preadv2'),
    ArgDenial('fadvise64', ((3, POSIX_FADV_DONTNEED, _INT),),
              'POSIX_FADV_DONTNEED evicts a shared file\'s pages: the sending side of a page-cache channel, and '
              'it slows every call that uses the file'),
    *(ArgDenial('madvise', ((2, advice, _INT),), f'{name} pushes shared file pages out, as fadvise DONTNEED does')
      for name, advice in (('MADV_COLD', MADV_COLD), ('MADV_PAGEOUT', MADV_PAGEOUT))),
    *(ArgDenial('fcntl', ((1, cmd, _INT),), f'{name}: record locks are a channel on shared files (/dev/null) '
                                            'and unbounded kernel memory (see above)') for name, cmd in _LOCKS),
)

#: run by the launcher before the program: the first ``import _sqlite3`` makes SQLite's
#: ``unix-dotfile`` VFS the default, which locks a database with a ``<name>.lock`` directory beside
#: it instead of ``fcntl`` record locks (denied, :data:`DENIED_ARGS`), so ``sqlite3.connect`` of a
#: file in ``/tmp`` works, readers and writers of several processes still excluded (readers
#: exclude each other too; WAL needs ``locking_mode=EXCLUSIVE``). ``ctypes`` is imported only then.
SQLITE_CODE = r'''
class _SqliteDotfile:
    """The import of ``_sqlite3``, then ``sqlite3_vfs_register(sqlite3_vfs_find("unix-dotfile"), 1)``."""
    def __init__(self, loader):
        self.loader = loader
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != '_sqlite3':
            return None
        import importlib.machinery
        sys.meta_path.remove(cls)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = cls(spec.loader)
        return spec
    def create_module(self, spec):
        return self.loader.create_module(spec)
    def exec_module(self, module):
        self.loader.exec_module(module)
        import ctypes
        try:
            lib = ctypes.CDLL(module.__file__)
            lib.sqlite3_vfs_find.restype = ctypes.c_void_p
            vfs = lib.sqlite3_vfs_find(b'unix-dotfile')
            if vfs:
                lib.sqlite3_vfs_register(ctypes.c_void_p(vfs), 1)
        except (OSError, AttributeError):  # a build without it: sqlite's own locks fail with EPERM
            pass
sys.meta_path.insert(0, _SqliteDotfile)
del _SqliteDotfile
'''

#: clone flags that make namespaces (``CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID |
#: NEWNET``, and ``CLONE_NEWTIME`` = 0x80)
NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80


class SeccompUnavailable(RuntimeError):
    """libseccomp (or its binding) is missing: the message says what to install."""


@functools.lru_cache(maxsize=None)
def filter_bpf(bounded: bool = True) -> bytes:
    """The filter as a BPF program (``struct sock_filter`` array), built once per process and
    variant (the build is deterministic, so a race on the first call costs a second build, nothing
    more). ``bounded=False`` (no cgroup counts the call's memory) also denies
    :data:`DENIED_UNBOUNDED`."""
    return _build(DENIED if bounded else DENIED + DENIED_UNBOUNDED, bounded)


def _build(denied: Tuple[str, ...], bounded: bool = True) -> bytes:
    try:
        import pyseccomp as seccomp  # lazy: ctypes-loads libseccomp; only a sandbox start needs it
    except (ImportError, OSError) as exc:
        try:
            import seccomp  # type: ignore[no-redef]  # Debian's python3-seccomp, same API
        except ImportError:
            raise SeccompUnavailable(f'no seccomp binding ({exc}): pip install pyseccomp (it needs libseccomp2, '
                                     'apt-get install libseccomp2)') from None
    f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for name in denied:
        try:
            f.add_rule(seccomp.ERRNO(errno.EPERM), name)
        except (RuntimeError, ValueError, OSError):  # not a syscall on this architecture / kernel
            pass
    for flag in _bits(NAMESPACE_FLAGS):
        f.add_rule(seccomp.ERRNO(errno.EPERM), 'clone', seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    try:
        f.add_rule(seccomp.ERRNO(errno.ENOSYS), 'clone3')
    except (RuntimeError, ValueError, OSError):
        pass
    for rule in DENIED_ARGS:
        if bounded and not rule.bounded_too:
            continue
        try:
            f.add_rule(seccomp.ERRNO(errno.EPERM), rule.syscall,
                       *(seccomp.Arg(i, seccomp.MASKED_EQ, mask, value) for i, value, mask in rule.args))
        except (RuntimeError, ValueError, OSError):  # not a syscall on this architecture / kernel
            pass
    r, w = os.pipe()
    try:
        with os.fdopen(w, 'wb') as out:
            f.export_bpf(out)
        chunks = []
        while True:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
    data = b''.join(chunks)
    if not data or len(data) % 8:
        raise SeccompUnavailable(f'libseccomp exported a filter of {len(data)} bytes, not a BPF program')
    return data


def _bits(mask: int) -> list:
    return [1 << i for i in range(mask.bit_length()) if mask >> i & 1]


def filter_fd(bounded: bool = True) -> int:
    """A fresh readable fd (a memfd at offset 0, made here, outside any sandbox) holding the
    filter (:func:`filter_bpf`) for the launcher; the caller closes it."""
    data = filter_bpf(bounded)
    fd = os.memfd_create('mtflow-seccomp', os.MFD_CLOEXEC | getattr(os, 'MFD_ALLOW_SEALING', 2))
    try:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


# ---- a fresh session keyring ---------------------------------------------------------------------
_KEYCTL_JOIN_SESSION_KEYRING = 1
_keyctl_nr: Optional[int] = None


def _keyctl() -> Optional[int]:
    global _keyctl_nr
    if _keyctl_nr is None:
        try:
            import pyseccomp as seccomp  # lazy: the syscall number of keyctl on this architecture
            _keyctl_nr = int(seccomp.resolve_syscall(seccomp.system_arch(), 'keyctl'))
        except (ImportError, OSError, RuntimeError, ValueError):
            _keyctl_nr = -1
    return _keyctl_nr if _keyctl_nr >= 0 else None


def in_fresh_keyring(fn: Callable[[], T]) -> T:
    """``fn()`` run on a sandbox spawner thread right after it joined a new anonymous session
    keyring: a child it starts inherits that keyring (credentials are per thread in Linux), and
    the driver's other threads keep theirs. The threads live as long as the process, because a
    parent-death signal (bwrap's ``--die-with-parent``, ``setpriv --pdeathsig``) fires when the
    *thread* that started the child exits. Called on a spawner thread (inside :func:`spawn`), it
    runs ``fn`` there. Where keyrings are unavailable (``ENOSYS``, or denied by an outer filter)
    ``fn`` runs all the same: the sandbox's filter denies the key syscalls."""
    nr = _keyctl()

    def run() -> T:
        if nr is not None:
            _libc().syscall(ctypes.c_long(nr), ctypes.c_long(_KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None))
        return fn()

    if getattr(_on_spawner, 'yes', False):
        return run()
    return _spawner().submit(run).result()


def spawn(fn: Callable[[], T]) -> 'Future[T]':
    """Run ``fn`` (which starts a sandbox: lease, cgroup, ``Popen`` through :func:`in_fresh_keyring`)
    on one of the :data:`SPAWNERS` spawner threads, so that concurrent calls start their sandboxes
    side by side instead of one after another on the event loop's thread."""
    return _spawner().submit(fn)


#: spawner threads: sandbox starts that may overlap (a start mostly waits: cgroup ``mkdir``, the
#: ``fork``/``exec`` of the outer process)
SPAWNERS = 4
_on_spawner = threading.local()
_spawn_pool: Optional[ThreadPoolExecutor] = None
_spawn_lock = threading.Lock()
_libc_handle: Optional[ctypes.CDLL] = None


def _mark_spawner() -> None:
    _on_spawner.yes = True


def _spawner() -> ThreadPoolExecutor:
    global _spawn_pool
    with _spawn_lock:
        if _spawn_pool is None:
            _spawn_pool = ThreadPoolExecutor(max_workers=SPAWNERS, thread_name_prefix='mtflow-sandbox-spawn',
                                             initializer=_mark_spawner)
        return _spawn_pool


def _libc() -> ctypes.CDLL:
    global _libc_handle
    if _libc_handle is None:
        _libc_handle = ctypes.CDLL(None, use_errno=True)
        _libc_handle.syscall.restype = ctypes.c_long
    return _libc_handle


def install_code(fd: int) -> str:
    """Python source for the sandbox's launcher that reads the BPF program from ``fd`` and installs
    it with ``prctl(PR_SET_SECCOMP)`` before the program runs (``no_new_privs`` first, which setpriv
    and bwrap have already set); it needs :data:`FFI_CODE` run before it."""
    return _INSTALL.format(fd=fd)


#: the few libc calls the launcher makes (``prctl``; rootless also ``unshare``, ``mount``,
#: ``capset``), through ``_ctypes`` itself: the ``ctypes`` package costs about 6 ms of CPU per
#: sandbox to import (``types``, ``struct``, ``ctypes._endian`` and its own module), a sixth of a
#: cold call's CPU. Arguments are ints and bytes (passed as ``char *``); the result is the C ``int``.
FFI_CODE = r'''
import _ctypes as _ct
class _CInt(_ct._SimpleCData):
    _type_ = 'i'
class _CFn(_ct.CFuncPtr):
    _flags_ = _ct.FUNCFLAG_CDECL | _ct.FUNCFLAG_USE_ERRNO
    _restype_ = _CInt
_libc_h = type('_Lib', (), {'_handle': _ct.dlopen(None)})()  # what CFuncPtr looks a symbol up in
def _fn(name):
    return _CFn((name, _libc_h))
'''

#: what :data:`FFI_CODE` defines, deleted by the launcher before the program runs
FFI_NAMES = '_ct, _CInt, _CFn, _libc_h, _fn'

_INSTALL = r'''
import _struct
with os.fdopen({fd}, 'rb') as _f:
    _prog = _f.read()
class _CChar(_ct._SimpleCData):
    _type_ = 'c'
class _Filter(_ct.Array):
    _type_, _length_ = _CChar, len(_prog)
_buf = _Filter.from_buffer_copy(_prog)
_fprog = _struct.pack('HP', len(_prog) // 8, _ct.addressof(_buf))  # struct sock_fprog
_prctl = _fn('prctl')
if _prctl(38, 1, 0, 0, 0) != 0 or _prctl(22, 2, _fprog, 0, 0) != 0:  # NO_NEW_PRIVS; SECCOMP, MODE_FILTER
    os.write(2, b'mtflow launcher: could not install the seccomp filter\n')
    os._exit(126)
del _struct, _f, _prog, _CChar, _Filter, _buf, _fprog, _prctl
'''


def describe() -> Tuple[bool, str]:
    """``(available, detail)`` for the load-time isolation report."""
    try:
        n = len(filter_bpf()) // 8
    except SeccompUnavailable as exc:
        return False, str(exc)
    return True, f'seccomp filter ({n} BPF instructions: keyrings, ptrace, namespaces, mounts, bpf, io_uring denied)'
