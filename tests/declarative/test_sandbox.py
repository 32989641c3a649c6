"""The ``python`` tool: limits, output, options, the isolation it picks (bubblewrap, else
unshare, else a refusal), and honest accounting: a timeout, a memory error, a non-zero exit or a
killed program is a tool error of that kind in ``rollout_infos``, the trace and the observation.
The adversarial programs are in ``test_sandbox_attacks.py``."""
from __future__ import annotations

import asyncio
import os
import re
import warnings

import pytest

from collections import Counter

from rich.console import Console

from mtflow import Executor
from mtflow.run.tally import tool_error_kinds
from mtflow.cli import main as cli
from mtflow.declarative import load_scheduler
from mtflow.tools import ToolRunner, isolation, make_builtin, tool_from_callable
from mtflow.tools.sandbox import SandboxWarning, make_python_tool, run_python
from mtflow.viewer import request_views, summarize
from mtflow.viewer.html import render_html
from mtflow.viewer.terminal import summary_renderable
from tests.helpers import Scripted, req

from .sandbox_util import require, why_unavailable
from .util import model_out


def run(code, **kw):
    kw.setdefault('timeout_s', 30)  # generous: a loaded 2-core CI machine
    return asyncio.run(run_python(code, **kw))


@pytest.fixture
def isolated():
    """The default isolation (auto) must work here; scripts/test.sh installs bubblewrap."""
    if why_unavailable('bwrap') and why_unavailable('unshare'):
        pytest.skip(f'no isolation here: {why_unavailable("bwrap")}; {why_unavailable("unshare")}')


def test_runs_code_and_captures_stdout_and_stderr(isolated):
    r = run('import sys\nprint("out")\nprint("err", file=sys.stderr)\n')
    assert r.returncode == 0 and r.output == 'out\nerr\n' and not r.timed_out and r.error_kind == ''
    assert r.isolation in ('bwrap', 'unshare')


def test_exception_shows_traceback_and_exit_status(isolated):
    r = run('print(1)\n1/0\n')
    obs = r.as_observation()
    assert r.returncode == 1 and r.error_kind == 'exit'
    assert 'ZeroDivisionError: division by zero' in obs and obs.endswith('(exit status 1)')
    assert 'File "main.py", line 2' in obs


def test_a_program_exit_status_of_the_memory_code_stays_an_exit(isolated):
    assert run('raise SystemExit(117)').error_kind == 'exit'


def test_output_is_truncated(isolated):
    r = run('print("x" * 10000)', max_output_chars=100)
    assert r.truncated and r.output.startswith('x' * 100) and r.error_kind == ''
    assert '[output truncated: 10001 bytes in total, 100 characters shown]' in r.output


def test_private_tmp_working_directory_and_size_cap(isolated):
    r = run('import os\nopen("f.txt", "w").write("x")\nprint(os.getcwd(), sorted(os.listdir(".")))\n'
            'try:\n    open("big", "wb").write(b"0" * (3 * 1024 * 1024))\nexcept OSError as e:\n'
            '    print("full:", e.strerror)', tmp_mb=2)
    assert r.output.splitlines() == ["/tmp ['f.txt', 'main.py']", 'full: No space left on device']


def test_builtin_python_tool_with_options(isolated):
    tool = make_builtin('python', {'timeout_s': 30, 'max_output_chars': 5})
    obs = asyncio.run(tool(code='print("hello world")'))
    assert obs.startswith('hello\n... [output truncated')


@pytest.mark.parametrize('options,message', [
    ({'timeout': 3}, "python tool: unknown key 'timeout'; did you mean 'timeout_s'?"),
    ({'cpu_core': 1}, "unknown key 'cpu_core'; did you mean 'cpu_cores'?"),
    ({'cpu_cores': 0}, "option 'cpu_cores' must be at least 0.01"),
    ({'cpu_cores': 'half'}, "option 'cpu_cores' must be a number"),
    ({'timeout_s': -5}, "option 'timeout_s' must be at least"),
    ({'memory_mb': 'lots'}, "option 'memory_mb' must be an integer, got 'lots'"),
    ({'max_processes': True}, "option 'max_processes' must be an integer"),
    ({'isolation': 'docker'}, "option 'isolation' must be one of auto, bwrap, unshare, none"),
])
def test_bad_options_are_rejected_at_load_time(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_builtin('python', options)


# ---- honest accounting ------------------------------------------------------------------------
def test_failures_are_tool_errors_of_their_kind(isolated):
    # the loop stops on CPU time (1 s), which the machine's load does not stretch; wall clock: 60 s
    tool = tool_from_callable(make_python_tool({'timeout_s': 60, 'cpu_s': 1, 'memory_mb': 128}), 'python')
    runner = ToolRunner([tool])
    programs = ['print(6 * 7)', 'while True: pass', 'x = bytearray(1024 ** 3)', 'print("partial")\n1/0',
                'import os, signal\nos.kill(os.getpid(), signal.SIGKILL)']
    try:
        results = asyncio.run(runner.call_all([('python', {'code': c}) for c in programs]))
    finally:
        runner.close()
    assert [(r.ok, r.error_kind) for r in results] == [(True, ''), (False, 'timeout'), (False, 'memory'),
                                                       (False, 'exit'), (False, 'killed')]
    assert results[0].output == '42\n'
    assert results[1].error.startswith('TimeoutError: CPU time limit exceeded')
    assert results[2].error.startswith('MemoryError: out of memory (limit 128 MB)\n')
    assert results[3].error.startswith('exit status 1\npartial\n') and 'ZeroDivisionError' in results[3].error
    assert results[4].error == 'killed by signal SIGKILL (9)'


def _call(code: str) -> str:
    import json
    return '<tool_call>\n' + json.dumps({'name': 'python', 'arguments': {'code': code}}) + '\n</tool_call>'


def test_error_kinds_reach_rollout_infos_the_trace_and_the_model(isolated):
    config = {'name': 'sandbox_kinds', 'parser': 'hermes', 'max_turns': 6,
              'tools': [{'name': 'python', 'options': {'timeout_s': 60, 'cpu_s': 1, 'memory_mb': 128}}],
              'observation': {'mode': 'message', 'role': 'tool', 'template': '{result}',
                              'error_template': 'Error: {error}'}}
    script = [_call('while True: pass'), _call('x = bytearray(1024 ** 3)'), _call('1/0'),
              _call('import os; os.kill(os.getpid(), 9)'), _call('print("fine")'), 'done']
    scheduler = load_scheduler(config)
    res = Executor(scheduler, Scripted({'a': [model_out(t) for t in script]})).run([req('a')])
    scheduler.close()
    o = res.outputs[0]
    assert o.rollout_infos['tool_calls'] == 5 and o.rollout_infos['tool_errors'] == 4
    assert o.rollout_infos['tool_error_kinds'] == {'timeout': 1, 'memory': 1, 'exit': 1, 'killed': 1}
    steps = [e.extra['calls'][0] for e in res.trace if e.src == 'tool_step']
    assert [(c['ok'], c.get('error_kind')) for c in steps] == [(False, 'timeout'), (False, 'memory'), (False, 'exit'),
                                                                (False, 'killed'), (True, None)]
    # the viewer's summary (terminal and HTML) and mtflow run's summary count the kinds too
    kinds = {'timeout': 1, 'memory': 1, 'exit': 1, 'killed': 1}
    summary = summarize(request_views(res.trace))
    assert summary.tool_error_kinds == kinds and len(summary.tool_errors) == 4
    assert any(te.message.startswith('python: timeout: TimeoutError') for te in summary.tool_errors)
    console = Console(record=True, width=120)
    console.print(summary_renderable(summary))
    assert 'tool error kinds' in console.export_text()
    assert 'tool error kinds' in render_html(res.trace, title='t')
    assert Counter(k for e in res.trace for k in tool_error_kinds(e.extra)) == kinds
    tool_messages = [m['content'] for m in o.messages if m['role'] == 'tool']
    assert tool_messages[0].startswith('Error: TimeoutError: CPU time limit exceeded')
    assert tool_messages[2].startswith('Error: exit status 1\n') and 'ZeroDivisionError' in tool_messages[2]
    assert tool_messages[4] == 'fine\n'


# ---- which isolation, and refusing without one -----------------------------------------------
@pytest.fixture
def no_tools(tmp_path, monkeypatch):
    """A PATH with neither bwrap nor unshare nor setpriv on it."""
    monkeypatch.setenv('PATH', str(tmp_path))
    isolation.forget_probes()
    yield
    monkeypatch.undo()
    isolation.forget_probes()


def test_without_an_isolation_tool_every_call_is_refused(no_tools):
    iso = isolation.resolve_isolation('auto')
    assert not iso.available and 'bwrap (bubblewrap) not found on PATH' in iso.detail
    assert 'unshare (util-linux) not found on PATH' in iso.detail
    runner = ToolRunner([tool_from_callable(make_builtin('python', {}), 'python')])
    try:
        [r] = asyncio.run(runner.call_all([('python', {'code': 'print("must not run")'})]))
    finally:
        runner.close()
    assert (r.ok, r.error_kind) == (False, 'refused')
    assert 'no sandbox is available on this machine' in r.error and 'isolation: none' in r.error
    assert 'bwrap (bubblewrap) not found on PATH' in r.error
    with pytest.raises(isolation.IsolationUnavailable, match='not found on PATH'):
        run('print(1)')


def test_isolation_none_warns_at_load_time_and_runs_unconfined(no_tools):
    with pytest.warns(SandboxWarning, match='isolation: none: model-written code runs unconfined'):
        tool = make_builtin('python', {'isolation': 'none'})
    assert asyncio.run(tool(code='print(1 + 1)')) == '2\n'
    r = run('import os\nprint(sorted(k for k in os.environ if k != "LC_CTYPE"))\nprint(os.getcwd())',
            isolation='none')
    env_line, cwd = r.output.splitlines()
    assert env_line == '[]' and os.path.basename(cwd).startswith('mtflow-py-') and not os.path.exists(cwd)


def test_auto_falls_back_to_unshare_where_bwrap_cannot_create_namespaces(tmp_path, monkeypatch):
    require('unshare')
    fake = tmp_path / 'bwrap'
    fake.write_text('#!/bin/sh\necho "bwrap: No permissions to create new namespace" >&2\nexit 1\n')
    fake.chmod(0o755)
    for name in ('unshare', 'setpriv'):
        (tmp_path / name).symlink_to(f'/usr/bin/{name}')
    monkeypatch.setenv('PATH', str(tmp_path))
    isolation.forget_probes()
    try:
        bwrap_only = isolation.resolve_isolation('bwrap')
        auto = isolation.resolve_isolation('auto')
        r = run('print("in the fallback")')
    finally:
        monkeypatch.undo()
        isolation.forget_probes()
    assert not bwrap_only.available and 'No permissions to create new namespace' in bwrap_only.detail
    assert auto.kind == 'unshare' and r.isolation == 'unshare' and r.output == 'in the fallback\n'


def test_validate_reports_the_isolation_in_use(capsys, tmp_path, monkeypatch, isolated):
    path = tmp_path / 'py.yaml'
    path.write_text('name: py\ntools:\n  - name: python\n  - name: unsafe\n    builtin: python\n'
                    '    options: {isolation: none}\n')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', SandboxWarning)
        assert cli(['validate', str(path)]) == 0
    out = capsys.readouterr().out
    kind = isolation.resolve_isolation('auto').kind
    assert f'{path}: tools[0] (python): isolation {kind} (' in out
    assert f'warning: {path}: tools[1] (unsafe): isolation none (isolation: none)' in out
    monkeypatch.setenv('PATH', str(tmp_path))
    isolation.forget_probes()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', SandboxWarning)
            assert cli(['validate', '-q', str(path)]) == 0  # a valid config on a machine without bwrap
    finally:
        monkeypatch.undo()
        isolation.forget_probes()
    out = capsys.readouterr().out
    assert f'warning: {path}: tools[0] (python): isolation no isolation available' in out
    assert 'every call is refused' in out


def test_mtflow_run_summary_counts_the_kinds(isolated, tmp_path, monkeypatch, capsys):
    import json
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'sched.yaml').write_text('name: py_kinds\nparser: hermes\nmax_turns: 4\ntools:\n  - name: python\n'
                                         '    options: {timeout_s: 60, cpu_s: 1}\n'
                                         'observation: {mode: message, role: tool}\n')
    lines = [{'content': _call(c), 'finish_reason': 'stop'} for c in ('while True: pass', '1/0', 'print(6 * 7)')]
    lines.append({'content': 'The answer is 42.', 'finish_reason': 'stop'})
    (tmp_path / 'script.jsonl').write_text(''.join(json.dumps(line) + '\n' for line in lines))
    (tmp_path / 'run.yaml').write_text('scheduler: sched.yaml\nbackend: scripted\nmodel: script.jsonl\n'
                                       'backend_options: {cycle: true}\nout: out\nmax_turns: 4\nlimit: 1\n')
    assert cli(['run', 'run.yaml']) == 0
    summary = json.loads((tmp_path / 'out' / 'summary.json').read_text())
    assert (summary['tool_calls'], summary['tool_errors']) == (3, 2)
    assert summary['tool_error_kinds'] == {'timeout': 1, 'exit': 1}
    assert 'tool error kinds' in capsys.readouterr().out


def test_validate_reports_the_isolation_of_a_run_configs_scheduler(capsys, tmp_path, isolated):
    (tmp_path / 'sched.yaml').write_text('name: py\ntools:\n  - name: python\n')
    (tmp_path / 'run.yaml').write_text('scheduler: sched.yaml\nbackend: scripted\nmodel: script.jsonl\n')
    (tmp_path / 'script.jsonl').write_text('')  # there (the scripted backend's preflight looks)
    assert cli(['validate', str(tmp_path / 'run.yaml')]) == 0
    out = capsys.readouterr().out
    assert f'{tmp_path / "sched.yaml"}: tools[0] (python): isolation ' in out and 'every call is refused' not in out
