"""The built-in ``python`` tool: its options, and the tool callable running each call's code in a
sandbox (refused without a working isolation tool, unless the options say ``isolation: none``)."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

from mtflow.core.keys import unknown_key_message
from mtflow.tools.cgroup import DEFAULT_CPU_CORES
from mtflow.tools.isolation import ISOLATION_CHOICES, SHM_MB, IsolationUnavailable, check_site_packages, resolve_isolation
from mtflow.tools.runner import ToolError, ToolOutput
from mtflow.tools.sandbox.pool import SandboxPool
from mtflow.tools.sandbox.process import SandboxSpec
from mtflow.tools.sandbox.supervise import run_python

__all__ = ['refusal', 'SandboxWarning', 'DEFAULT_WARM_POOL', 'PYTHON_OPTIONS', 'python_option_problems',
           'check_python_options', 'make_python_tool']


class SandboxWarning(UserWarning):
    """A ``python`` tool configured to run model code without isolation."""


#: sandboxes the ``python`` tool keeps started ahead of its calls (``warm_pool``; 0: none)
DEFAULT_WARM_POOL = 2

#: option -> (type, minimum) for the ``python`` tool's YAML ``options``
PYTHON_OPTIONS: Dict[str, Any] = {
    'timeout_s': ((int, float), 0.001), 'memory_mb': (int, 16), 'cpu_s': (int, 1), 'max_output_chars': (int, 0),
    'max_file_mb': (int, 1), 'max_processes': (int, 1), 'tmp_mb': (int, 1), 'shm_mb': (int, 1), 'isolation': (str, None),
    'warm_pool': (int, 0), 'site_packages': ((str, list), None), 'cpu_cores': ((int, float), 0.01),
}

#: options whose ``null`` means "none": ``cpu_s`` (``timeout_s + 1``), ``cpu_cores`` (no CPU quota)
NULLABLE_OPTIONS = ('cpu_s', 'cpu_cores')


def python_option_problems(options: Dict[str, Any]) -> List[Tuple[Tuple[Any, ...], str]]:
    """Every problem of ``options`` as ``(loc below options, message)``: an unknown name (with the
    closest known one), a wrong type or range, an ``isolation`` not known, a ``site_packages``
    entry that is not a usable directory, ``shm_mb`` over ``memory_mb``; ``[]`` when they are fine.
    ``mtflow validate`` reports each at its option's own line."""
    problems: List[Tuple[Tuple[Any, ...], str]] = []
    for key, value in options.items():
        if key not in PYTHON_OPTIONS:
            problems.append(((key, ), unknown_key_message(key, PYTHON_OPTIONS)))
            continue
        types, minimum = PYTHON_OPTIONS[key]
        if value is None and key in NULLABLE_OPTIONS:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            kind = ('a number' if types == (int, float) else 'an integer' if types is int else
                    'a path or a list of paths' if key == 'site_packages' else 'a string')
            problems.append(((key, ), f'option {key!r} must be {kind}, got {value!r}'))
        elif minimum is not None and value < minimum:
            problems.append(((key, ), f'option {key!r} must be at least {minimum:g}, got {value!r}'))
        elif key == 'site_packages':
            try:
                check_site_packages([value] if isinstance(value, str) else value)
            except ValueError as exc:
                problems.append(((key, ), f'option \'site_packages\': {exc}'))
        elif key == 'isolation' and value not in ISOLATION_CHOICES:
            problems.append(((key, ), f'option \'isolation\' must be one of {", ".join(ISOLATION_CHOICES)}, '
                                      f'got {value!r}'))
    shm, memory = options.get('shm_mb', SHM_MB), options.get('memory_mb', 512)
    if not any(loc[0] in ('shm_mb', 'memory_mb') for loc, _ in problems) and shm > memory:
        problems.append((('shm_mb' if 'shm_mb' in options else 'memory_mb', ),
                         f'option \'shm_mb\' ({shm}) must not exceed memory_mb ({memory}): /dev/shm is memory '
                         'of the call'))
    return problems


def check_python_options(options: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` checked (:func:`python_option_problems`), with ``site_packages`` resolved;
    ``ValueError`` names every problem."""
    problems = python_option_problems(options)
    if problems:
        raise ValueError('python tool: ' + '; '.join(msg for _, msg in problems))
    if 'site_packages' in options:
        site = options['site_packages']
        options = dict(options, site_packages=check_site_packages([site] if isinstance(site, str) else site))
    return dict(options)


def refusal(detail: str) -> str:
    """The refusal a call gets when no sandbox works here. Only where the isolation tools are
    missing does it name the options (install them, or knowingly run unconfined); a sandbox that is
    installed but refused (uid leases, an unsafe lease directory, no seccomp binding) is a problem
    to fix, and running unconfined is no fix for it."""
    text = f'python tool refused to run the code: no sandbox is available on this machine ({detail})'
    reasons = [part for part in detail.split('; ') if part]
    if reasons and all('not found on PATH' in part for part in reasons):
        text += '; install bubblewrap, or set `isolation: none` in the tool options to run unconfined'
    return text


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
                                       opts.get('max_processes', 64), opts.get('tmp_mb', 64),
                                       opts.get('site_packages', ()), opts.get('shm_mb', SHM_MB),
                                       opts.get('cpu_cores', DEFAULT_CPU_CORES)), warm)
    if requested == 'none':
        warnings.warn('python tool: isolation: none: model-written code runs unconfined, as this user, with '
                      'this machine\'s files, network and processes in reach', SandboxWarning, stacklevel=2)

    async def python(code: str) -> str:
        """Run Python code in a sandbox and return what it prints (stdout and stderr).

        Args:
            code: a complete Python program; use print() to show results.
        """
        if not iso.available:
            raise ToolError('refused', refusal(iso.detail))
        try:
            result = await run_python(code, pool=pool, **opts)
        except IsolationUnavailable as exc:
            raise ToolError('refused', f'python tool refused to run the code: {exc}') from None
        if result.error_kind:
            head = result.headline()
            raise ToolError(result.error_kind, head + ('\n' + result.output if result.output else ''), result.usage)
        return ToolOutput(result.as_observation(), result.usage)

    python.isolation = iso  # type: ignore[attr-defined]
    python.pool = pool  # type: ignore[attr-defined]
    python.close = pool.close if pool is not None else (lambda: None)  # type: ignore[attr-defined]
    return python
