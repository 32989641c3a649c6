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

The package, in the order a call goes through it: :mod:`.python_tool` (the tool and its options),
:mod:`.supervise` (:func:`run_python`: one program, its output and its teardown), :mod:`.pool`
(sandboxes started ahead), :mod:`.process` (the launcher and the process tree), :mod:`.result`
(what a run produced and how it is accounted).
"""
from mtflow.tools.sandbox.pool import SandboxPool
from mtflow.tools.sandbox.process import Sandbox, SandboxSpec
from mtflow.tools.sandbox.python_tool import (DEFAULT_WARM_POOL, PYTHON_OPTIONS, SandboxWarning, check_python_options,
                                              make_python_tool, python_option_problems)
from mtflow.tools.sandbox.result import MEMORY_STATUS, SandboxResult
from mtflow.tools.sandbox.supervise import run_python

__all__ = ['MEMORY_STATUS', 'SandboxResult', 'SandboxSpec', 'Sandbox', 'SandboxPool', 'run_python', 'SandboxWarning',
           'DEFAULT_WARM_POOL', 'PYTHON_OPTIONS', 'check_python_options', 'python_option_problems', 'make_python_tool']
