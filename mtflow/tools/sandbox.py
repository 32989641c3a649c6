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
import os
import shutil
import signal
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from .isolation import (ISOLATION_CHOICES, IsolationUnavailable, SandboxCommand, UidLease, build_command,
                        current_interpreter, namespace_init, resolve_isolation, wait_uid_gone)
from .runner import ToolError

#: the launcher's exit status after a ``MemoryError`` (a program's own ``exit(117)`` becomes 1)
MEMORY_STATUS = 117

_LAUNCHER = r'''
import os, resource, sys
with os.fdopen({code_fd}, 'rb') as _f:
    _src = _f.read().decode('utf-8', 'replace')
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


async def run_python(code: str,
                     *,
                     timeout_s: float = 5.0,
                     memory_mb: int = 512,
                     cpu_s: Optional[int] = None,
                     max_output_chars: int = 4000,
                     max_file_mb: int = 16,
                     max_processes: int = 64,
                     tmp_mb: int = 64,
                     isolation: str = 'auto') -> SandboxResult:
    """Run ``code`` in a sandbox and return what it produced (see the module docstring).

    Raises :class:`IsolationUnavailable` when ``isolation`` cannot be had on this machine."""
    iso = resolve_isolation(isolation)
    if not iso.available:
        raise IsolationUnavailable(iso.detail)
    cpu = int(cpu_s if cpu_s is not None else max(1, int(timeout_s) + 1))
    isolated = iso.kind != 'none'
    code_fd = os.memfd_create('mtflow-code')
    lease: Optional[UidLease] = None
    workdir: Optional[str] = None
    cmd: Optional[SandboxCommand] = None
    proc: Optional[asyncio.subprocess.Process] = None
    killed = False
    try:
        os.write(code_fd, code.encode('utf-8', 'surrogatepass'))
        os.lseek(code_fd, 0, os.SEEK_SET)
        launcher = _LAUNCHER.format(code_fd=code_fd, memory=memory_mb * 1024 * 1024, cpu=cpu,
                                    fsize=max_file_mb * 1024 * 1024, nproc=max_processes if isolated else None,
                                    mem_status=MEMORY_STATUS)
        python_argv = [current_interpreter().executable, '-I', '-S', '-u', '-c', launcher]
        if isolated:
            lease = UidLease()
            cmd = build_command(iso.kind, lease.uid, tmp_mb, python_argv)
        else:
            workdir = tempfile.mkdtemp(prefix='mtflow-py-')
            cmd = SandboxCommand(python_argv, {}, cwd=workdir)
        proc = await asyncio.create_subprocess_exec(
            *cmd.argv, env=cmd.env, cwd=cmd.cwd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True, pass_fds=(code_fd, ))
        os.close(code_fd)
        code_fd = -1
        limit = max(0, int(max_output_chars))
        chunks: list = []
        size = 0
        flooded = False

        async def read_all() -> None:
            nonlocal size, flooded, killed
            assert proc is not None and proc.stdout is not None
            while True:
                chunk = await proc.stdout.read(65536)
                if not chunk:
                    break
                if size < limit * 4 + 4096:
                    chunks.append(chunk)
                size += len(chunk)
                if size > limit * 16 + 65536:  # far beyond what we keep: stop the producer
                    flooded = killed = True
                    _kill_tree(proc, isolated)
                    break
            await _wait_or_force(proc)

        timed_out = False
        try:
            await asyncio.wait_for(read_all(), timeout_s)
        except asyncio.TimeoutError:
            timed_out = killed = True
            _kill_tree(proc, isolated)
            await _wait_or_force(proc)
        text = b''.join(chunks).decode('utf-8', errors='replace')
        truncated = flooded or len(text) > limit
        if truncated:
            text = text[:limit] + f'\n... [output truncated: {size} bytes in total, {limit} characters shown]'
        returncode = None if timed_out else proc.returncode
        sig = None if (timed_out or flooded) else _signal_of(returncode, iso.kind)
        return SandboxResult(text, returncode, timed_out, truncated, sig, flooded, memory_mb, timeout_s, iso.kind,
                             lease.uid if lease else None)
    finally:
        # every path, cancellation included: nothing the call started survives it
        if code_fd >= 0:
            os.close(code_fd)
        if proc is not None:
            if proc.returncode is None:
                killed = True
                _kill_tree(proc, isolated)
            if not isolated:
                _kill_tree(proc, isolated)  # the rest of the process group (detached ones escape)
            try:
                await _wait_or_force(proc)
                await _close_pipe(proc)
            except asyncio.CancelledError:
                pass
        if lease is not None:
            if killed:
                wait_uid_gone(lease.uid)  # PID 1 is gone; its namespace's other processes go right after
            lease.release()
        if cmd is not None and cmd.scratch:
            shutil.rmtree(cmd.scratch, ignore_errors=True)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


async def _wait_or_force(proc: 'asyncio.subprocess.Process') -> None:
    """Wait for the outer process; SIGKILL its whole group if it has not exited within 5 s."""
    if proc.returncode is not None:
        return
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), 5.0)
    except asyncio.TimeoutError:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        await proc.wait()


async def _close_pipe(proc: 'asyncio.subprocess.Process') -> None:
    """Drain and close the output pipe of a killed run (else its transport outlives the loop)."""
    if proc.stdout is not None and not proc.stdout.at_eof():
        try:
            await asyncio.wait_for(_drain(proc.stdout), 2.0)
        except asyncio.TimeoutError:  # a writer outside the process group (isolation: none) holds it
            transport = getattr(proc, '_transport', None)
            if transport is not None:
                transport.close()


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass


def _kill_tree(proc: 'asyncio.subprocess.Process', isolated: bool) -> None:
    """Kill the sandbox: SIGKILL its PID 1 (whose death kills everything else in the namespace;
    the outer bwrap/unshare reaps it and exits), or, when that is not known yet (or the run is
    not isolated), the process group of the outer process."""
    init = namespace_init(proc.pid) if isolated and proc.returncode is None else None
    try:
        if init is not None:
            os.kill(init, signal.SIGKILL)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---- the tool ------------------------------------------------------------------------------------
class SandboxWarning(UserWarning):
    """A ``python`` tool configured to run model code without isolation."""


#: option -> (type, minimum) for the ``python`` tool's YAML ``options``
PYTHON_OPTIONS: Dict[str, Any] = {
    'timeout_s': ((int, float), 0.001), 'memory_mb': (int, 16), 'cpu_s': (int, 1), 'max_output_chars': (int, 0),
    'max_file_mb': (int, 1), 'max_processes': (int, 1), 'tmp_mb': (int, 1), 'isolation': (str, None),
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
    requested = opts.get('isolation', 'auto')
    iso = resolve_isolation(requested)
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
            result = await run_python(code, **opts)
        except IsolationUnavailable as exc:
            raise ToolError('refused', f'python tool refused to run the code: {exc}') from None
        if result.error_kind:
            head = result.headline()
            raise ToolError(result.error_kind, head + ('\n' + result.output if result.output else ''))
        return result.as_observation()

    python.isolation = iso  # type: ignore[attr-defined]
    return python
