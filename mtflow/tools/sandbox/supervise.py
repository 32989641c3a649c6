"""Running one program in a sandbox: feed it, collect its output within the limits, stop it at the
timeout, and tear the sandbox down on every path (cancellation included)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from typing import Any, List, Optional, Sequence, Tuple

from mtflow.tools import seccomp
from mtflow.tools.cgroup import DEFAULT_CPU_CORES
from mtflow.tools.isolation import SHM_MB, IsolationUnavailable, check_site_packages, resolve_isolation
from mtflow.tools.sandbox.budget import Ticket, room
from mtflow.tools.sandbox.pool import SandboxPool
from mtflow.tools.sandbox.process import Sandbox, SandboxSpec, high_fd
from mtflow.tools.sandbox.result import SandboxResult, signal_of

__all__ = ['run_python', 'start_sandbox', 'supervise']


async def run_python(code: str,
                     *,
                     timeout_s: float = 5.0,
                     memory_mb: int = 512,
                     cpu_s: Optional[int] = None,
                     max_output_chars: int = 4000,
                     max_file_mb: int = 16,
                     max_processes: int = 64,
                     tmp_mb: int = 64,
                     shm_mb: int = SHM_MB,
                     cpu_cores: Optional[float] = DEFAULT_CPU_CORES,
                     isolation: str = 'auto',
                     site_packages: Sequence[str] = (),
                     pool: Optional['SandboxPool'] = None) -> SandboxResult:
    """Run ``code`` in a sandbox and return what it produced (see the module docstring). With a
    ``pool`` (:class:`SandboxPool`, started with the same limits) a prepared sandbox is used when
    one is ready.

    Raises :class:`IsolationUnavailable` when ``isolation`` cannot be had on this machine."""
    iso = resolve_isolation(isolation)
    if not iso.available:
        raise IsolationUnavailable(iso.detail)
    cpu = int(cpu_s if cpu_s is not None else max(1, int(timeout_s) + 1))
    spec = SandboxSpec(iso.kind, memory_mb, cpu, max_file_mb, max_processes, tmp_mb,
                       check_site_packages(site_packages), shm_mb, cpu_cores)
    data = code.encode('utf-8', 'surrogatepass')
    for attempt in range(UID_ATTEMPTS):
        sandbox = pool.take() if pool is not None and pool.spec == spec and not attempt else None
        if sandbox is None:
            sandbox = await _start(spec, data, timeout_s) if spec.kind != 'none' else _new_sandbox(spec, data)
        result = await supervise(sandbox, data if sandbox.warm else None, timeout_s, max_output_chars)
        if not sandbox.uid_busy:
            return result
        # its uid ran processes of another container on this kernel; nothing of the program ran
    raise IsolationUnavailable(f'{UID_ATTEMPTS} sandbox uids in a row were in use by processes outside this '
                               'host\'s uid leases (another container on this kernel leasing the same block?)')


#: sandboxes a call starts at most, each on another uid, while it finds its uid in use elsewhere
UID_ATTEMPTS = 4


async def _start(spec: SandboxSpec, data: bytes, timeout_s: float) -> Sandbox:
    """A sandbox of its own for a call, once this user's process limit has room for it (rootless:
    :func:`mtflow.tools.sandbox.budget.room`, waited for up to ``timeout_s``)."""
    ticket = await room(spec.max_processes, timeout_s)
    try:
        return await start_sandbox(spec, data, ticket)
    except BaseException:
        if ticket is not None:
            ticket.release()  # (a sandbox that started, then failed, released it already)
        raise


def _new_sandbox(spec: SandboxSpec, data: bytes, ticket: Optional[Ticket] = None) -> Sandbox:
    """A sandbox started for ``data`` (its program, handed over through a memfd)."""
    code_fd = high_fd(os.memfd_create('mtflow-code'))
    try:
        os.write(code_fd, data)
        os.lseek(code_fd, 0, os.SEEK_SET)
        return Sandbox(spec, code_fd, ticket)
    finally:
        os.close(code_fd)


async def start_sandbox(spec: SandboxSpec, data: bytes, ticket: Optional[Ticket] = None) -> Sandbox:
    """:func:`_new_sandbox` on a spawner thread (:func:`mtflow.tools.seccomp.spawn`), off the event
    loop: a start waits on ``mkdir`` of the cgroups and on the ``exec`` of the outer process, and
    64 concurrent calls would otherwise start one after another on the loop's thread. A call
    cancelled while its sandbox starts tears that sandbox down before the cancellation goes on."""
    fut = seccomp.spawn(lambda: _new_sandbox(spec, data, ticket))
    try:
        return await asyncio.wrap_future(fut)
    except asyncio.CancelledError:
        try:
            started = fut.result()  # a start takes milliseconds; nothing it started may survive the call
        except BaseException:  # cancelled before it ran, or the start failed: nothing to tear down
            raise asyncio.CancelledError from None
        started.discard()
        raise


class CapturedOutput:
    """What the program printed: kept up to a margin beyond what is shown, counted in full. A
    flood (far more than is kept) kills the sandbox, so a chatty program cannot stall the call."""

    def __init__(self) -> None:
        self.limit = 0  # characters shown
        self.chunks: List[bytes] = []
        self.size = 0  # bytes produced, kept or not
        self.flooded = False
        self.keeping = True  # false once the sandbox is killed: what comes after is drained and dropped

    async def pump(self, reader: asyncio.StreamReader, sandbox: Sandbox) -> None:
        """Read until EOF (every writer gone). Reading never stops before that, also after a flood
        or a timeout killed the sandbox: a writer that outlives the kill for a moment must not block
        on a full pipe, or the outer process would never exit (util-linux 2.38's ``unshare`` writes
        ``sigprocmask unblock failed`` when its child was SIGKILLed, and waited on a pipe that a
        flood had filled: issue 52, 5). What comes after the kill is not kept."""
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                return
            if not self.keeping:
                continue
            if self.size < self.limit * 4 + 4096:
                self.chunks.append(chunk)
            self.size += len(chunk)
            if self.size > self.limit * 16 + 65536:  # far beyond what we keep: stop the producer
                self.flooded = True
                self.keeping = False
                sandbox.kill()

    def shown(self) -> Tuple[str, bool]:
        """``(text, truncated)``: the output as the result carries it."""
        text = b''.join(self.chunks).decode('utf-8', errors='replace')
        truncated = self.flooded or len(text) > self.limit
        if truncated:
            text = (text[:self.limit]
                    + f'\n... [output truncated: {self.size} bytes in total, {self.limit} characters shown]')
        return text, truncated


async def supervise(sandbox: Sandbox, stdin_data: Optional[bytes], timeout_s: float,
                    max_output_chars: int) -> SandboxResult:
    """Feed the program (warm sandboxes), collect its output within the limits, and tear the
    sandbox down on every path, cancellation included: nothing the call started survives it."""
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    popen = sandbox.popen
    exited = loop.create_future()
    pidfd = _watch_exit(loop, popen, exited)
    transport = None
    output = CapturedOutput()
    timed_out = False
    pump: Optional['asyncio.Task[None]'] = None
    try:
        reader = asyncio.StreamReader(limit=1 << 20)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), popen.stdout)
        if stdin_data is not None:
            await _feed(loop, popen.stdin, stdin_data)
        output.limit = max(0, int(max_output_chars))
        pump = loop.create_task(output.pump(reader, sandbox))
        try:
            await asyncio.wait_for(_until_done(pump, exited), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            output.keeping = False
            sandbox.kill()
        await _reap(sandbox, exited)
        await _drained(pump, DRAIN_S if sandbox.isolated else 0.0)
        return _result(sandbox, output, timed_out, timeout_s, time.monotonic() - started)
    finally:
        await _tear_down(sandbox, exited, pidfd, transport, killed=timed_out or output.flooded, pump=pump)


async def _until_done(pump: 'asyncio.Task[None]', exited: 'asyncio.Future[None]') -> None:
    """The output's EOF, then the outer process's exit. Both are shielded: a timeout cancels this
    wait, never the reading (which goes on draining) nor the exit future (which the teardown still
    waits on; cancelled, it would raise ``CancelledError`` out of the call, issue 52, 5)."""
    await asyncio.shield(pump)
    await asyncio.shield(exited)


#: how long the output is drained after the outer process exited: with isolation the namespace is
#: empty by then (EOF at once); without it (not waited for), a detached process may hold the pipe
DRAIN_S = 1.0


async def _drained(pump: 'asyncio.Task[None]', within_s: float) -> None:
    if not pump.done():
        try:
            await asyncio.wait_for(asyncio.shield(pump), within_s)
        except asyncio.TimeoutError:
            pump.cancel()


def _result(sandbox: Sandbox, output: CapturedOutput, timed_out: bool, timeout_s: float,
            wall_s: float) -> SandboxResult:
    text, truncated = output.shown()
    returncode = None if timed_out else sandbox.popen.returncode
    sig = None if (timed_out or output.flooded) else signal_of(returncode, sandbox.spec.kind)
    usage = sandbox.usage()
    # a SIGKILL nobody here sent, after at least cpu_s of CPU time (the call's cgroup), or, without
    # a cgroup, of wall time: RLIMIT_CPU's hard limit, reached by a program that caught SIGXCPU
    cpu_used = usage.get('cpu_s', wall_s)
    cpu_limit = sig == signal.SIGKILL and not sandbox.oom_killed() and cpu_used >= sandbox.spec.cpu_s
    return SandboxResult(text, returncode, timed_out, truncated, sig, output.flooded, sandbox.spec.memory_mb, timeout_s,
                         sandbox.spec.kind, sandbox.lease.uid if sandbox.lease else None,
                         pid_namespace=sandbox.pid_namespace(), oom_killed=sandbox.oom_killed(), cpu_limit=cpu_limit,
                         usage=usage)


async def _tear_down(sandbox: Sandbox, exited: 'asyncio.Future[None]', pidfd: Optional[int], transport: Any,
                     killed: bool, pump: Optional['asyncio.Task[None]'] = None) -> None:
    """Kill what still runs, reap it, stop reading, close the pidfd, the pipe transport and the
    pipes, and release the sandbox (its uid waits for the namespace's teardown when it was killed)."""
    loop = asyncio.get_running_loop()
    popen = sandbox.popen
    if popen.poll() is None:
        killed = True
        sandbox.kill()
    elif not sandbox.isolated:
        sandbox.kill()  # the rest of the process group (detached ones escape: isolation none)
    try:
        await _reap(sandbox, exited)
    except asyncio.CancelledError:  # cancelled again while tearing down: finish synchronously
        popen.wait(5)
    if pump is not None and not pump.done():
        pump.cancel()
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
            await asyncio.shield(exited)
    sandbox.popen.wait()

