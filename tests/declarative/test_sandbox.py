"""The ``python`` tool's limits: timeout (process group killed), memory (RLIMIT_AS), output size,
empty environment, fresh temporary working directory."""
from __future__ import annotations

import asyncio
import os

from mtflow.tools import make_builtin
from mtflow.tools.sandbox import run_python


def run(code, **kw):
    return asyncio.run(run_python(code, **kw))


def test_runs_code_and_captures_stdout_and_stderr():
    r = run('import sys\nprint("out")\nprint("err", file=sys.stderr)\n')
    assert r.returncode == 0 and r.output == 'out\nerr\n' and not r.timed_out


def test_exception_shows_traceback_and_exit_status():
    r = run('print(1)\n1/0\n')
    obs = r.as_observation()
    assert r.returncode == 1 and 'ZeroDivisionError: division by zero' in obs and obs.endswith('(exit status 1)')
    assert 'File "main.py", line 2' in obs


def test_timeout_kills_the_process_group():
    r = run('import subprocess, sys, time\n'
            'subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])\n'
            'print("started", flush=True)\nwhile True: pass\n', timeout_s=1)
    assert r.timed_out and r.returncode is None
    assert r.output.startswith('started')
    assert r.as_observation().endswith('TimeoutError: execution timed out')


def test_memory_limit():
    r = run('x = bytearray(400 * 1024 * 1024)\nprint("allocated")', memory_mb=128)
    assert 'MemoryError' in r.output and 'allocated' not in r.output and r.returncode != 0


def test_output_is_truncated_and_a_flood_is_stopped():
    r = run('print("x" * 10000)', max_output_chars=100)
    assert r.truncated and r.output.startswith('x' * 100)
    assert '[output truncated: 10001 bytes in total, 100 characters shown]' in r.output
    flood = run('while True: print("y" * 1000)', max_output_chars=100, timeout_s=20)
    assert flood.truncated and not flood.timed_out  # killed for its output, long before the timeout


def test_empty_environment_and_temporary_workdir():
    os.environ['MTFLOW_SECRET_TEST'] = 'secret'
    try:
        r = run('import os\nprint(sorted(k for k in os.environ if k != "LC_CTYPE"))\nprint(os.getcwd())\n'
                'open("f.txt", "w").write("x")\nprint(os.listdir("."))')
    finally:
        del os.environ['MTFLOW_SECRET_TEST']
    env_line, cwd, listing = r.output.splitlines()
    assert env_line == '[]'
    assert os.path.basename(cwd).startswith('mtflow-py-') and not os.path.exists(cwd)  # removed afterwards
    assert listing == "['main.py', 'f.txt']" or listing == "['f.txt', 'main.py']"


def test_builtin_python_tool_with_options():
    tool = make_builtin('python', {'timeout_s': 1, 'max_output_chars': 5})
    obs = asyncio.run(tool(code='print("hello world")'))
    assert obs.startswith('hello\n... [output truncated')
