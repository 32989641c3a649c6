"""Runs the hypothesis fuzz of ``fuzz_cases.py`` (random YAML documents, alias bombs, random
tool-call strings through every parser and the YAML scheduler) in a child process with a capped
address space and a per-case alarm: errors or error observations, never a crash, a hang or a
memory blow-up."""
from __future__ import annotations

import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEMORY_BYTES = 3 << 30  # the whole fuzz process; a real alias bomb would need far more


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def test_fuzz_yaml_and_tool_calls_in_a_bounded_process():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    proc = subprocess.run([sys.executable, '-m', 'tests.declarative.fuzz_cases'], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900, preexec_fn=_cap_memory)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.split() == ['fuzz_yaml_documents:', 'ok', 'fuzz_parsers:', 'ok', 'fuzz_scheduler_turns:', 'ok']
