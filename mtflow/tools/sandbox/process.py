"""One sandbox: the launcher that sets the limits inside it, what it is started with
(:class:`SandboxSpec`), and the started process tree (:class:`Sandbox`), which is killed and
cleaned up as a whole."""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from mtflow.tools.isolation import (SHM_MB, UID_BUSY_STATUS, SandboxCommand, UidLease, build_command,
                                    current_interpreter, mount_tmp_code, namespace_init, rootless, subordinate_block,
                                    subordinate_ids, uid_check_code, wait_uid_gone)
from mtflow.tools import seccomp
from mtflow.tools.cgroup import DEFAULT_CPU_CORES, CallCgroup, join_argv, make_call_cgroup
from mtflow.tools.sandbox.budget import Ticket, take_room
from mtflow.tools.sandbox.result import MEMORY_STATUS

__all__ = ['SandboxSpec', 'Sandbox', 'high_fd']

#: runs inside the sandbox: reads the program (memfd or stdin), sets the rlimits, runs it; a
#: ``MemoryError`` exits with ``MEMORY_STATUS`` (and a program's own ``exit(MEMORY_STATUS)`` with 1)
_LAUNCHER = r'''
import os, resource, sys
{ns_report}{uid_check}{ffi}{mount_tmp}{install_filter}{no_epoll}with os.fdopen({code_fd}, 'rb') as _f:
    _src = _f.read().decode('utf-8', 'replace')
if {code_fd} == 0:  # a warm sandbox got its program on stdin; the program gets /dev/null there
    os.open('/dev/null', os.O_RDONLY)
with open('main.py', 'w', encoding='utf-8') as _f:
    _f.write(_src)
def _limit(kind, soft, hard=None):
    if soft is None:
        return
    hard = soft if hard is None else hard
    cur_soft, cur_hard = resource.getrlimit(kind)
    if cur_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    resource.setrlimit(kind, (soft, hard))
_limit(resource.RLIMIT_AS, {memory})
_limit(resource.RLIMIT_CPU, {cpu}, {cpu} + 1)  # SIGXCPU first (a timeout), not a bare SIGKILL
_limit(resource.RLIMIT_FSIZE, {fsize})
_limit(resource.RLIMIT_NOFILE, 64)
_limit(resource.RLIMIT_CORE, 0)
_limit(resource.RLIMIT_NPROC, {nproc})
_limit(resource.RLIMIT_MSGQUEUE, 0)  # per-user kernel quotas the driver's uid shares when rootless
_limit(resource.RLIMIT_SIGPENDING, 256)
del _limit, resource, _f
sys.path.extend({site})  # the site_packages option: after the standard library, read-only
_main = type(sys)('__main__')  # the program's own __main__, so pickle finds what it defines (multiprocessing)
_main.__builtins__ = __builtins__
# and where it is: a fresh interpreter multiprocessing starts (spawn, forkserver) runs main.py again
# as __mp_main__ to find the program's functions there (without it, workers die and a Pool waits)
_main.__file__ = os.path.abspath('main.py')
sys.modules['__main__'] = _main
try:
    exec(compile(_src, 'main.py', 'exec'), _main.__dict__)
except SystemExit as _e:
    _code = _e.code
    if _code == {mem_status}:
        sys.exit(1)
    raise
except BaseException as _e:  # show the traceback from main.py on, without this launcher's frame
    import traceback
    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    sys.stdout.flush()
    os._exit({mem_status} if isinstance(_e, MemoryError) else 1)
'''


#: the launcher's first lines in an isolated sandbox: it writes its PID namespace (``pid:[inode]``)
#: to ``{fd}``, the write end of a pipe to the driver, and closes it, before anything of the
#: program runs (:meth:`Sandbox.pid_namespace`: every process of the call is in that namespace)
NS_REPORT = "os.write({fd}, os.readlink('/proc/self/ns/pid').encode())\nos.close({fd})\n"


@dataclass(frozen=True)
class SandboxSpec:
    """Everything a sandbox is started with, before it knows its program (so a warm pool can
    start it ahead of the call)."""
    kind: str  # 'bwrap', 'unshare' or 'none'
    memory_mb: int = 512
    cpu_s: int = 6
    max_file_mb: int = 16
    max_processes: int = 64
    tmp_mb: int = 64
    site_packages: Tuple[str, ...] = ()  # read-only directories the program may import from
    shm_mb: int = SHM_MB  # its own /dev/shm (tmpfs)
    cpu_cores: Optional[float] = DEFAULT_CPU_CORES  # CPU bandwidth of the whole call (cgroup; None: no quota)

    def launcher(self, code_fd: int, filter_fd: Optional[int] = None, mount_tmp: bool = False,
                 bounded: bool = True, uid_fd: Optional[int] = None, ns_fd: Optional[int] = None) -> str:
        """The launcher's source; with ``ns_fd`` it first reports its PID namespace there
        (:data:`NS_REPORT`); with ``uid_fd`` (a leased uid, as root) it first checks that no
        other process runs as its uid and says so on that fd (:data:`mtflow.tools.isolation.UID_CHECK`);
        with ``filter_fd`` it installs the seccomp filter read from that
        fd; with ``mount_tmp`` (rootless bwrap) it mounts its ``/tmp`` before that; not
        ``bounded`` (no cgroup; the filter denies ``epoll_create``) it hides ``select.epoll``, so
        that ``selectors`` and ``asyncio`` fall back to ``poll``."""
        # the filter denies fcntl record locks: sqlite then locks with files (seccomp.SQLITE_CODE)
        install = '' if filter_fd is None else seccomp.install_code(filter_fd) + seccomp.SQLITE_CODE
        mount = mount_tmp_code(self.tmp_mb, self.shm_mb) if mount_tmp else ''
        ffi = seccomp.FFI_CODE if install or mount else ''
        if ffi:
            install += f'del {seccomp.FFI_NAMES}\n'
        no_epoll = '' if bounded else 'import select as _sel\ndel _sel.epoll, _sel\n'
        uid_check = '' if uid_fd is None else uid_check_code(uid_fd)
        ns_report = '' if ns_fd is None else NS_REPORT.format(fd=ns_fd)
        return _LAUNCHER.format(ns_report=ns_report, uid_check=uid_check, ffi=ffi, mount_tmp=mount,
                                install_filter=install, no_epoll=no_epoll,
                                site=repr(list(self.site_packages)),
                                code_fd=code_fd,
                                memory=self.memory_mb * 1024 * 1024, cpu=self.cpu_s,
                                fsize=self.max_file_mb * 1024 * 1024,
                                # rootless, PID 1 (sh) shares the program's uid and namespace: one more
                                nproc=None if self.kind == 'none' else self.max_processes + (1 if rootless() else 0),
                                mem_status=MEMORY_STATUS)


def high_fd(fd: int) -> int:
    """``fd`` moved to 10 or above, clear of the low fds the sandbox's shell scripts use."""
    if fd >= 10:
        return fd
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    finally:
        os.close(fd)


class Sandbox:
    """One started sandbox (a process tree) for exactly one program: the code comes through an
    inherited memfd (``code_fd``), or, for a sandbox a warm pool started ahead, on its stdin."""

    def __init__(self, spec: SandboxSpec, code_fd: Optional[int] = None, ticket: Optional[Ticket] = None) -> None:
        """``ticket``: room under this user's process limit (rootless), taken here when not given
        (:class:`~mtflow.tools.sandbox.budget.NoProcessRoom` when there is none now)."""
        self.spec = spec
        self.ticket = ticket
        self.lease: Optional[UidLease] = None
        self.workdir: Optional[str] = None
        self.cmd: Optional[SandboxCommand] = None
        self.cgroup: Optional[CallCgroup] = None
        self.warm = code_fd is None
        #: the sandbox ended before its program ran because another process ran as its uid
        #: (known after :meth:`cleanup`; the call starts again on another uid)
        self.uid_busy = False
        self._uid_fd: Optional[int] = None  # the read end of the launcher's uid check
        self._ns_fd: Optional[int] = None  # the read end of the launcher's PID namespace report
        self._pid_ns: Optional[int] = None
        filter_fd = uid_w = ns_w = None
        try:
            if spec.kind != 'none':
                if self.ticket is None:
                    self.ticket = take_room(spec.max_processes)
                self._ns_fd, ns_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
                ns_w = high_fd(ns_w)
                ids = subordinate_ids()  # rootless: a subordinate uid of its own, where this user has them
                self.lease = UidLease(subordinate_block(ids)) if ids is not None else None if rootless() else UidLease()
                self.cgroup = make_call_cgroup(spec.memory_mb, spec.max_processes, spec.cpu_cores)
                # no cgroup counts memory outside processes: the filter denies the ways to hold it
                filter_fd = high_fd(seccomp.filter_fd(bounded=self.cgroup is not None))
                if not rootless():  # the leased uid's check (rootless there is no kernel-wide count to ask)
                    self._uid_fd, uid_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
                    uid_w = high_fd(uid_w)
                python_argv = self._python_argv(code_fd, filter_fd, mount_tmp=rootless(),
                                                bounded=self.cgroup is not None, uid_fd=uid_w, ns_fd=ns_w)
                uid = self.lease.uid if self.lease is not None else None
                enter = ids.enter_argv(uid) if ids is not None and uid is not None else ()
                self.cmd = build_command(spec.kind, None if rootless() else uid, spec.tmp_mb, python_argv,
                                         site_packages=spec.site_packages, shm_mb=spec.shm_mb, enter=enter)
                argv = join_argv(self.cgroup, self.cmd.argv)
            else:
                self.workdir = tempfile.mkdtemp(prefix='mtflow-py-')
                self.cmd = SandboxCommand(self._python_argv(code_fd, None), {}, cwd=self.workdir)
                argv = self.cmd.argv
            fds = tuple(fd for fd in (code_fd, filter_fd, uid_w, ns_w) if fd is not None)
            cmd = self.cmd
            self.popen = seccomp.in_fresh_keyring(lambda: subprocess.Popen(
                argv, env=cmd.env, cwd=cmd.cwd, stdin=subprocess.PIPE if code_fd is None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, pass_fds=fds))
        except BaseException:
            self.cleanup(False)
            raise
        finally:
            for fd in (filter_fd, uid_w, ns_w):
                if fd is not None:
                    os.close(fd)

    def _python_argv(self, code_fd: Optional[int], filter_fd: Optional[int], mount_tmp: bool = False,
                     bounded: bool = True, uid_fd: Optional[int] = None, ns_fd: Optional[int] = None) -> list:
        return [current_interpreter().executable, '-I', '-S', '-u', '-c',
                self.spec.launcher(0 if code_fd is None else code_fd, filter_fd, mount_tmp, bounded, uid_fd, ns_fd)]

    def pid_namespace(self) -> Optional[int]:
        """The inode of the sandbox's PID namespace, as its launcher reported it before the
        program ran (:data:`NS_REPORT`): every process of the call is in it, and none is left once
        the call is over. ``None`` while the launcher has not got that far (or never did), and
        for ``isolation: none``."""
        if self._pid_ns is None and self._ns_fd is not None:
            try:
                found = re.fullmatch(rb'pid:\[(\d+)\]', os.read(self._ns_fd, 64))
            except BlockingIOError:  # nothing written yet
                return None
            if found:
                self._pid_ns = int(found.group(1))
        return self._pid_ns

    def _uid_checked(self) -> bool:
        """The launcher found no other process running as its uid (it says so on the check's pipe
        before any program runs); false also while it has not got that far."""
        try:
            return self._uid_fd is not None and os.read(self._uid_fd, 1) == b'1'
        except BlockingIOError:  # nothing written yet
            return False

    def usage(self) -> Dict[str, float]:
        """The call's peak memory (MB) and CPU time (s), from its cgroup (empty without one)."""
        out: Dict[str, float] = {}
        if self.cgroup is not None:
            peak, cpu = self.cgroup.peak_mb(), self.cgroup.cpu_s()
            if peak is not None:
                out['memory_peak_mb'] = peak
            if cpu is not None:
                out['cpu_s'] = round(cpu, 6)
        return out

    def oom_killed(self) -> bool:
        return self.cgroup is not None and self.cgroup.oom_killed()

    @property
    def isolated(self) -> bool:
        return self.spec.kind != 'none'

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL the sandbox's PID 1 (whose death kills everything else in the namespace; the
        outer bwrap/unshare reaps it and exits), or, when that is not known (or the run is not
        isolated), the process group of the outer process."""
        init = namespace_init(self.popen.pid) if self.isolated and self.popen.poll() is None else None
        try:
            if init is not None:
                os.kill(init, signal.SIGKILL)
            else:
                os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def cleanup(self, killed: bool) -> None:
        """After the outer process exited: wait out the namespace's teardown when it was killed,
        release the uid (one found in use elsewhere is skipped for a while), remove the scratch
        directories. (Rootless there is no uid to wait on: the outer bwrap exits only after it
        reaped PID 1, and the kernel lets PID 1 of a namespace be reaped only once every other
        process in it is gone; ``--die-with-parent`` covers an outer bwrap that was itself killed.)"""
        checked = self._uid_checked()
        self.pid_namespace()  # kept for the result, then the pipe is closed
        if self._ns_fd is not None:
            os.close(self._ns_fd)
            self._ns_fd = None
        if self._uid_fd is not None:
            popen = getattr(self, 'popen', None)
            self.uid_busy = not checked and popen is not None and popen.returncode == UID_BUSY_STATUS
            os.close(self._uid_fd)
            self._uid_fd = None
        if self.lease is not None:
            if killed and checked:
                # PID 1 is gone; the namespace's others go right after (a uid that was never this
                # call's own may be another container's: nothing to wait for)
                wait_uid_gone(self.lease.uid)
            if self.uid_busy:
                UidLease.mark_busy(self.lease.uid)
            self.lease.release()
            self.lease = None
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        if self.ticket is not None:
            self.ticket.release()
            self.ticket = None
        if self.cmd is not None and self.cmd.scratch:
            shutil.rmtree(self.cmd.scratch, ignore_errors=True)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def discard(self) -> None:
        """Kill and reap an unused sandbox (a warm one that is no longer wanted)."""
        self.kill()
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
        for f in (self.popen.stdin, self.popen.stdout):
            if f is not None:
                f.close()
        self.cleanup(True)
