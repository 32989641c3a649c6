"""The built-in ``python`` tool: model-written code in a sandbox built with bubblewrap (or unshare).

Model code can loop forever, allocate all memory, fork without end, write files, read secrets
(the environment, ``/proc/<ppid>/environ``, ``$HOME``), open sockets, start processes that outlive
the call, or signal the rollout process itself. Here every call runs in its own sandbox
(:mod:`mtflow.tools.isolation`: new PID, network, IPC, UTS and mount namespaces, a read-only
view of ``/usr`` and the interpreter only, a private size-capped ``/tmp``, a dedicated
unprivileged uid), with

- a wall-clock timeout, and a CPU-time limit (``RLIMIT_CPU``);
- an address-space limit (``RLIMIT_AS``: allocations beyond it raise ``MemoryError``), a file-size
  limit, a limit on open files and a process-count limit (``RLIMIT_NPROC``, per leased uid);
- stdout and stderr captured together, truncated to ``max_output_chars``; reading stops (and the
  sandbox is killed) once far more than that has been produced;
- the whole process tree killed at the end of every call, however it ends (also when the caller
  cancels it, e.g. the runner's own ``timeout_s``).

The limits are set by a small launcher inside the sandbox (``resource.setrlimit``) rather than a
``preexec_fn``, which is unsafe in a threaded parent. The code reaches the sandbox through an
inherited ``memfd``; nothing is written on the host.

Outcomes are accounted honestly: :attr:`SandboxResult.error_kind` is ``timeout`` (wall clock or
CPU time), ``memory`` (``MemoryError``), ``exit`` (non-zero exit status) or ``killed`` (a signal,
or a flood of output); the tool raises :class:`~mtflow.tools.runner.ToolError` with that kind, so
the call is a tool error in the trace, the summary and the viewer, and the model still sees the
output. Without a working isolation tool every call is refused (``refused``) unless the options
say ``isolation: none``. See ``docs/sandbox.md``.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from mtflow.tools.isolation import (ISOLATION_CHOICES, IsolationUnavailable, SandboxCommand, UidLease, build_command,
                        current_interpreter, namespace_init, resolve_isolation, rootless, wait_uid_gone)
from mtflow.tools.runner import ToolError

#: the launcher's exit status after a ``MemoryError`` (a program's own ``exit(117)`` becomes 1)
MEMORY_STATUS = 117

_LAUNCHER = r'''
import os, resource, sys
with os.fdopen({code_fd}, 'rb') as _f:
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
del _limit, resource, _f
try:
    exec(compile(_src, 'main.py', 'exec'), {{'__name__': '__main__', '__builtins__': __builtins__}})
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


@dataclass
class SandboxResult:
    """What one run produced: merged output (truncated), exit code, and why it stopped."""
    output: str
    returncode: Optional[int]
    timed_out: bool = False
    truncated: bool = False
    signal: Optional[int] = None  # the signal that ended the program
    flooded: bool = False  # killed for producing far more output than is kept
    memory_mb: Optional[int] = None
    timeout_s: Optional[float] = None
    isolation: str = ''
    uid: Optional[int] = None  # the leased uid it ran as (isolated runs)

    @property
    def error_kind(self) -> str:
        """``''`` for a clean exit, else ``timeout``, ``memory``, ``exit`` or ``killed``."""
        if self.timed_out or self.signal == signal.SIGXCPU:
            return 'timeout'
        if self.flooded or self.signal is not None:
            return 'killed'
        if self.returncode == MEMORY_STATUS:
            return 'memory'
        if self.returncode not in (0, None):
            return 'exit'
        return ''

    def headline(self) -> str:
        """One line saying why the run is an error (``''`` when it is not)."""
        kind = self.error_kind
        if kind == 'timeout':
            if self.timed_out:
                return f'TimeoutError: execution timed out after {self.timeout_s:g} s'
            return 'TimeoutError: CPU time limit exceeded'
        if kind == 'memory':
            return f'MemoryError: out of memory (limit {self.memory_mb} MB)'
        if kind == 'killed':
            if self.flooded:
                return 'killed: the program printed far more output than is kept'
            return f'killed by signal {_signal_name(self.signal)}'
        if kind == 'exit':
            return f'exit status {self.returncode}'
        return ''

    def as_observation(self) -> str:
        """The text the model sees: the output, then why it stopped when that was an error."""
        text, head = self.output, self.headline()
        if head and self.error_kind == 'exit':
            head = f'({head})'
        if head:
            text += ('\n' if text and not text.endswith('\n') else '') + head
        return text


def _signal_name(sig: Optional[int]) -> str:
    try:
        return f'{signal.Signals(sig).name} ({sig})'
    except (ValueError, TypeError):
        return str(sig)


def _signal_of(returncode: Optional[int], kind: str) -> Optional[int]:
    """The signal that ended the program: a negative status, or ``128 + N`` (how bwrap's and the
    unshare script's PID 1 report a program killed by signal N)."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    if kind in ('bwrap', 'unshare') and 128 < returncode < 128 + 65:
        return returncode - 128
    return None


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

    def launcher(self, code_fd: int) -> str:
        return _LAUNCHER.format(code_fd=code_fd, memory=self.memory_mb * 1024 * 1024, cpu=self.cpu_s,
                                fsize=self.max_file_mb * 1024 * 1024,
                                # rootless, PID 1 (sh) shares the program's uid and namespace: one more
                                nproc=None if self.kind == 'none' else self.max_processes + (1 if rootless() else 0),
                                mem_status=MEMORY_STATUS)


class Sandbox:
    """One started sandbox (a process tree) for exactly one program: the code comes through an
    inherited memfd (``code_fd``), or, for a sandbox a warm pool started ahead, on its stdin."""

    def __init__(self, spec: SandboxSpec, code_fd: Optional[int] = None) -> None:
        self.spec = spec
        self.lease: Optional[UidLease] = None
        self.workdir: Optional[str] = None
        self.cmd: Optional[SandboxCommand] = None
        self.warm = code_fd is None
        python_argv = [current_interpreter().executable, '-I', '-S', '-u', '-c',
                       spec.launcher(0 if code_fd is None else code_fd)]
        try:
            if spec.kind != 'none':
                self.lease = None if rootless() else UidLease()
                self.cmd = build_command(spec.kind, self.lease.uid if self.lease else None, spec.tmp_mb, python_argv)
            else:
                self.workdir = tempfile.mkdtemp(prefix='mtflow-py-')
                self.cmd = SandboxCommand(python_argv, {}, cwd=self.workdir)
            self.popen = subprocess.Popen(
                self.cmd.argv, env=self.cmd.env, cwd=self.cmd.cwd,
                stdin=subprocess.PIPE if code_fd is None else subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True, pass_fds=() if code_fd is None else (code_fd, ))
        except BaseException:
            self.cleanup(False)
            raise

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
        release the uid, remove the scratch directories."""
        if self.lease is not None:
            if killed:
                wait_uid_gone(self.lease.uid)  # PID 1 is gone; the namespace's others go right after
            self.lease.release()
            self.lease = None
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


async def run_python(code: str,
                     *,
                     timeout_s: float = 5.0,
                     memory_mb: int = 512,
                     cpu_s: Optional[int] = None,
                     max_output_chars: int = 4000,
                     max_file_mb: int = 16,
                     max_processes: int = 64,
                     tmp_mb: int = 64,
                     isolation: str = 'auto',
                     pool: Optional['SandboxPool'] = None) -> SandboxResult:
    """Run ``code`` in a sandbox and return what it produced (see the module docstring). With a
    ``pool`` (:class:`SandboxPool`, started with the same limits) a prepared sandbox is used when
    one is ready.

    Raises :class:`IsolationUnavailable` when ``isolation`` cannot be had on this machine."""
    iso = resolve_isolation(isolation)
    if not iso.available:
        raise IsolationUnavailable(iso.detail)
    cpu = int(cpu_s if cpu_s is not None else max(1, int(timeout_s) + 1))
    spec = SandboxSpec(iso.kind, memory_mb, cpu, max_file_mb, max_processes, tmp_mb)
    data = code.encode('utf-8', 'surrogatepass')
    sandbox = pool.take() if pool is not None and pool.spec == spec else None
    if sandbox is None:
        code_fd = os.memfd_create('mtflow-code')
        try:
            os.write(code_fd, data)
            os.lseek(code_fd, 0, os.SEEK_SET)
            sandbox = Sandbox(spec, code_fd)
        finally:
            os.close(code_fd)
    return await _supervise(sandbox, data if sandbox.warm else None, timeout_s, max_output_chars)


async def _supervise(sandbox: Sandbox, stdin_data: Optional[bytes], timeout_s: float,
                     max_output_chars: int) -> SandboxResult:
    """Feed the program (warm sandboxes), collect its output within the limits, and tear the
    sandbox down on every path, cancellation included: nothing the call started survives it."""
    loop = asyncio.get_running_loop()
    popen = sandbox.popen
    exited = loop.create_future()
    pidfd = _watch_exit(loop, popen, exited)
    transport = None
    killed = False
    try:
        reader = asyncio.StreamReader(limit=1 << 20)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), popen.stdout)
        if stdin_data is not None:
            await _feed(loop, popen.stdin, stdin_data)
        limit = max(0, int(max_output_chars))
        chunks: list = []
        size = 0
        flooded = False

        async def read_all() -> None:
            nonlocal size, flooded, killed
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                if size < limit * 4 + 4096:
                    chunks.append(chunk)
                size += len(chunk)
                if size > limit * 16 + 65536:  # far beyond what we keep: stop the producer
                    flooded = killed = True
                    sandbox.kill()
                    break
            await exited

        timed_out = False
        try:
            await asyncio.wait_for(read_all(), timeout_s)
        except asyncio.TimeoutError:
            timed_out = killed = True
            sandbox.kill()
        await _reap(sandbox, exited)
        text = b''.join(chunks).decode('utf-8', errors='replace')
        truncated = flooded or len(text) > limit
        if truncated:
            text = text[:limit] + f'\n... [output truncated: {size} bytes in total, {limit} characters shown]'
        returncode = None if timed_out else popen.returncode
        sig = None if (timed_out or flooded) else _signal_of(returncode, sandbox.spec.kind)
        return SandboxResult(text, returncode, timed_out, truncated, sig, flooded, sandbox.spec.memory_mb, timeout_s,
                             sandbox.spec.kind, sandbox.lease.uid if sandbox.lease else None)
    finally:
        if popen.poll() is None:
            killed = True
            sandbox.kill()
        elif not sandbox.isolated:
            sandbox.kill()  # the rest of the process group (detached ones escape: isolation none)
        try:
            await _reap(sandbox, exited)
        except asyncio.CancelledError:  # cancelled again while tearing down: finish synchronously
            popen.wait(5)
        if pidfd is not None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        if transport is not None:
            transport.close()
        for f in (popen.stdin, popen.stdout):
            if f is not None and not f.closed:
                f.close()
        sandbox.cleanup(killed)


def _watch_exit(loop: asyncio.AbstractEventLoop, popen: 'subprocess.Popen[bytes]',
                exited: 'asyncio.Future[None]') -> Optional[int]:
    """Resolve ``exited`` when the outer process exits: a pidfd on the loop (no thread, no
    SIGCHLD handler), or polling where pidfds are missing (Linux < 5.3)."""
    def done() -> None:
        if not exited.done():
            exited.set_result(None)

    try:
        pidfd = os.pidfd_open(popen.pid)
    except (AttributeError, OSError):
        async def poll() -> None:
            while popen.poll() is None:
                await asyncio.sleep(0.005)
            done()
        loop.create_task(poll())
        return None
    loop.add_reader(pidfd, done)
    return pidfd


async def _feed(loop: asyncio.AbstractEventLoop, pipe: Any, data: bytes) -> None:
    """Write a warm sandbox's program to its stdin and close it (EOF starts the program). Up to
    the pipe's capacity a write cannot block; beyond it, a thread writes."""
    def write() -> None:
        try:
            pipe.write(data)
            pipe.close()
        except BrokenPipeError:  # the sandbox died while waiting; its exit status tells the rest
            pass

    if len(data) <= 65536:
        write()
    else:
        await loop.run_in_executor(None, write)


async def _reap(sandbox: Sandbox, exited: 'asyncio.Future[None]') -> None:
    """Wait for the outer process to exit (SIGKILL its whole group after 5 s) and reap it."""
    if sandbox.popen.returncode is None:
        try:
            await asyncio.wait_for(asyncio.shield(exited), 5.0)
        except asyncio.TimeoutError:
            try:
                os.killpg(sandbox.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            await exited
    sandbox.popen.wait()


class SandboxPool:
    """Sandboxes started ahead of their calls (``warm_pool: N`` in the tool options), so a call
    pays only for running its program. Each is used for exactly one program and then torn down,
    like any other; a thread keeps ``size`` of them ready. Idle ones hold a leased uid each."""

    def __init__(self, spec: SandboxSpec, size: int) -> None:
        self.spec, self.size = spec, size
        self._ready: 'collections.deque[Sandbox]' = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        _POOLS.add(self)

    def take(self) -> Optional[Sandbox]:
        """A ready sandbox, or None (the caller starts one itself); a refill is started either way."""
        if self._thread is None:
            self.start()
        found = None
        with self._lock:
            while self._ready and found is None:
                candidate = self._ready.popleft()
                if candidate.alive():
                    found = candidate
                else:
                    candidate.discard()
        self._wake.set()
        return found

    def start(self) -> None:
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._refill, name='mtflow-sandbox-pool', daemon=True)
                self._thread.start()

    def ready(self) -> int:
        with self._lock:
            return len(self._ready)

    def _refill(self) -> None:
        while not self._closed:
            with self._lock:
                missing = self.size - len(self._ready)
            for _ in range(max(0, missing)):
                if self._closed:
                    break
                try:
                    sandbox = Sandbox(self.spec)
                except Exception:  # e.g. all uids in use: the calls start their own
                    break
                with self._lock:
                    if self._closed:
                        sandbox.discard()
                        break
                    self._ready.append(sandbox)
            self._wake.wait(1.0)
            self._wake.clear()

    def close(self) -> None:
        """Stop refilling and tear down the idle sandboxes."""
        self._closed = True
        self._wake.set()
        with self._lock:
            idle, self._ready = list(self._ready), collections.deque()
        for sandbox in idle:
            sandbox.discard()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)


_POOLS: 'weakref.WeakSet[SandboxPool]' = weakref.WeakSet()


@atexit.register
def _close_pools() -> None:
    for pool in list(_POOLS):
        pool.close()


# ---- the tool ------------------------------------------------------------------------------------
class SandboxWarning(UserWarning):
    """A ``python`` tool configured to run model code without isolation."""


#: sandboxes the ``python`` tool keeps started ahead of its calls (``warm_pool``; 0: none)
DEFAULT_WARM_POOL = 2

#: option -> (type, minimum) for the ``python`` tool's YAML ``options``
PYTHON_OPTIONS: Dict[str, Any] = {
    'timeout_s': ((int, float), 0.001), 'memory_mb': (int, 16), 'cpu_s': (int, 1), 'max_output_chars': (int, 0),
    'max_file_mb': (int, 1), 'max_processes': (int, 1), 'tmp_mb': (int, 1), 'isolation': (str, None),
    'warm_pool': (int, 0),
}


def check_python_options(options: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` checked (names, types, ranges, ``isolation``); ``ValueError`` says what is wrong."""
    unknown = set(options) - set(PYTHON_OPTIONS)
    if unknown:
        raise ValueError(f'python tool: unknown option(s) {sorted(unknown)} (allowed: {sorted(PYTHON_OPTIONS)})')
    for key, value in options.items():
        types, minimum = PYTHON_OPTIONS[key]
        if value is None and key == 'cpu_s':
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            kind = 'a number' if types == (int, float) else 'an integer' if types is int else 'a string'
            raise ValueError(f'python tool: option {key!r} must be {kind}, got {value!r}')
        if minimum is not None and value < minimum:
            raise ValueError(f'python tool: option {key!r} must be at least {minimum:g}, got {value!r}')
    if options.get('isolation', 'auto') not in ISOLATION_CHOICES:
        raise ValueError(f'python tool: option \'isolation\' must be one of {", ".join(ISOLATION_CHOICES)}, '
                         f'got {options["isolation"]!r}')
    return dict(options)


def make_python_tool(options: Optional[Dict[str, Any]] = None) -> Callable[..., Any]:
    """The ``python`` tool with these options; its isolation is probed now (once per process),
    so a refusal or ``isolation: none`` is known at load time."""
    opts = check_python_options(dict(options or {}))
    warm = opts.pop('warm_pool', DEFAULT_WARM_POOL)
    requested = opts.get('isolation', 'auto')
    iso = resolve_isolation(requested)
    pool = None
    if warm and iso.available:
        timeout_s = opts.get('timeout_s', 5.0)
        cpu = opts.get('cpu_s') or max(1, int(timeout_s) + 1)
        pool = SandboxPool(SandboxSpec(iso.kind, opts.get('memory_mb', 512), int(cpu), opts.get('max_file_mb', 16),
                                       opts.get('max_processes', 64), opts.get('tmp_mb', 64)), warm)
    if requested == 'none':
        warnings.warn('python tool: isolation: none: model-written code runs unconfined, as this user, with '
                      'this machine\'s files, network and processes in reach', SandboxWarning, stacklevel=2)

    async def python(code: str) -> str:
        """Run Python code in a sandbox and return what it prints (stdout and stderr).

        Args:
            code: a complete Python program; use print() to show results.
        """
        if not iso.available:
            raise ToolError('refused', 'python tool refused to run the code: no sandbox is available on this '
                            f'machine ({iso.detail}); install bubblewrap, or set `isolation: none` in the '
                            'tool options to run unconfined')
        try:
            result = await run_python(code, pool=pool, **opts)
        except IsolationUnavailable as exc:
            raise ToolError('refused', f'python tool refused to run the code: {exc}') from None
        if result.error_kind:
            head = result.headline()
            raise ToolError(result.error_kind, head + ('\n' + result.output if result.output else ''))
        return result.as_observation()

    python.isolation = iso  # type: ignore[attr-defined]
    python.pool = pool  # type: ignore[attr-defined]
    python.close = pool.close if pool is not None else (lambda: None)  # type: ignore[attr-defined]
    return python
