"""The built-in ``python`` tool: runs model-written code in a separate, limited process.

Why a subprocess and not ``exec``: model code can loop forever, allocate all memory, write files,
read the environment (API keys) or crash the interpreter. Here it runs as ``python -I -S`` with

- a wall-clock timeout (the whole process group is killed), and a CPU-time limit (``RLIMIT_CPU``);
- an address-space limit (``RLIMIT_AS``: allocations beyond it raise ``MemoryError``), a file-size
  limit (``RLIMIT_FSIZE``) and a limit on open files;
- a fresh temporary working directory, deleted afterwards;
- an empty environment (no ``PATH``, no ``HOME``, no secrets);
- stdout and stderr captured together, truncated to ``max_output_chars``; reading stops (and the
  process is killed) once far more than that has been produced.

The limits are set by a small launcher inside the child (``resource.setrlimit``) rather than a
``preexec_fn``, which is unsafe in a threaded parent. This is a resource sandbox, not a security
boundary against a hostile user: the child can still read world-readable files and use the
network. Use a container for that.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, Optional

_LAUNCHER = r'''
import resource, sys
def _limit(kind, value):
    if value is None:
        return
    soft, hard = resource.getrlimit(kind)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(kind, (value, value if hard == resource.RLIM_INFINITY else hard))
_limit(resource.RLIMIT_AS, {memory})
_limit(resource.RLIMIT_CPU, {cpu})
_limit(resource.RLIMIT_FSIZE, {fsize})
_limit(resource.RLIMIT_NOFILE, 64)
del _limit, resource
with open('main.py', encoding='utf-8') as _f:
    _src = _f.read()
del _f
try:
    exec(compile(_src, 'main.py', 'exec'), {{'__name__': '__main__', '__builtins__': __builtins__}})
except BaseException as _e:  # show the traceback from main.py on, without this launcher's frame
    if isinstance(_e, SystemExit):
        raise
    import traceback
    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    sys.exit(1)
'''


@dataclass
class SandboxResult:
    """What one run produced: merged output (truncated), exit code, and why it stopped."""
    output: str
    returncode: Optional[int]
    timed_out: bool = False
    truncated: bool = False

    def as_observation(self) -> str:
        """The text the model sees."""
        text = self.output
        if self.timed_out:
            text += ('\n' if text else '') + 'TimeoutError: execution timed out'
        elif self.returncode not in (0, None):
            text += ('\n' if text and not text.endswith('\n') else '') + f'(exit status {self.returncode})'
        return text


async def run_python(code: str,
                     *,
                     timeout_s: float = 5.0,
                     memory_mb: int = 512,
                     cpu_s: Optional[int] = None,
                     max_output_chars: int = 4000,
                     max_file_mb: int = 16) -> SandboxResult:
    """Run ``code`` in a limited subprocess and return its output (see the module docstring)."""
    workdir = tempfile.mkdtemp(prefix='mtflow-py-')
    try:
        with open(os.path.join(workdir, 'main.py'), 'w', encoding='utf-8') as f:
            f.write(code)
        cpu = int(cpu_s if cpu_s is not None else max(1, int(timeout_s) + 1))
        launcher = _LAUNCHER.format(memory=memory_mb * 1024 * 1024, cpu=cpu, fsize=max_file_mb * 1024 * 1024)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, '-I', '-S', '-u', '-c', launcher,
            cwd=workdir,
            env={},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
        limit = max(0, int(max_output_chars))
        chunks: list = []
        size = 0
        overflow = False

        async def read_all() -> None:
            nonlocal size, overflow
            assert proc.stdout is not None
            while True:
                chunk = await proc.stdout.read(65536)
                if not chunk:
                    break
                if size < limit * 4 + 4096:
                    chunks.append(chunk)
                size += len(chunk)
                if size > limit * 16 + 65536:  # far beyond what we keep: stop the producer
                    overflow = True
                    _kill(proc)
                    break
            await proc.wait()

        timed_out = False
        try:
            await asyncio.wait_for(read_all(), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            _kill(proc)
            await proc.wait()
        text = b''.join(chunks).decode('utf-8', errors='replace')
        truncated = overflow or len(text) > limit
        if truncated:
            text = text[:limit] + f'\n... [output truncated: {size} bytes in total, {limit} characters shown]'
        return SandboxResult(text, None if timed_out else proc.returncode, timed_out, truncated)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill(proc: 'asyncio.subprocess.Process') -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


#: option -> (type, minimum) for the ``python`` tool's YAML ``options``
PYTHON_OPTIONS: Dict[str, Any] = {
    'timeout_s': ((int, float), 0.001), 'memory_mb': (int, 16), 'cpu_s': (int, 1), 'max_output_chars': (int, 0),
    'max_file_mb': (int, 1),
}


def check_python_options(options: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` checked (names, types, ranges); ``ValueError`` says what is wrong, so that
    ``mtflow validate`` reports it instead of every call failing at run time."""
    unknown = set(options) - set(PYTHON_OPTIONS)
    if unknown:
        raise ValueError(f'python tool: unknown option(s) {sorted(unknown)} (allowed: {sorted(PYTHON_OPTIONS)})')
    for key, value in options.items():
        types, minimum = PYTHON_OPTIONS[key]
        if value is None and key == 'cpu_s':
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            kind = 'a number' if types == (int, float) else 'an integer'
            raise ValueError(f'python tool: option {key!r} must be {kind}, got {value!r}')
        if minimum is not None and value < minimum:
            raise ValueError(f'python tool: option {key!r} must be at least {minimum:g}, got {value!r}')
    return dict(options)


async def python(code: str) -> str:
    """Run Python code in a sandbox and return what it prints (stdout and stderr).

    Args:
        code: a complete Python program; use print() to show results.
    """
    return (await run_python(code)).as_observation()
