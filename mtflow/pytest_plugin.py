"""mtflow's pytest plugin (registered through the ``pytest11`` entry point ``mtflow``).

While a test runs, every :class:`mtflow.Executor` run it makes publishes its trace (see
:func:`mtflow.core.trace.add_listener`); the plugin keeps them for that test only, and:

* the ``mtflow_trace`` fixture gives them to the test to assert on::

      def test_agent(mtflow_trace):
          Executor(MyScheduler(), rollout_fn, max_turns=2).run(requests)
          mtflow_trace.assert_path('r3', 'generating -> tool_step -> generating -> finished(max_turns)')

* when the test fails, the terminal timeline of the requests involved (those the failure text
  names, else the ones that errored, else all, at most ``MAX_REQUESTS``) is added to the failure
  report as a section ``mtflow trace``; a passing test adds nothing;
* ``--mtflow-trace-dir DIR`` also writes, per failing test, the HTML page and the trace JSONL;
* the ``mtflow_check_tokens`` fixture runs the token conformance checks
  (``mtflow.backends.conformance``, what ``mtflow check-tokens`` runs) on a backend of yours and
  fails the test with the table of checks unless every one passed::

      def test_my_template(mtflow_check_tokens):
          mtflow_check_tokens(HFBackend(model, tokenizer), template='my_template.jinja')

* the ``mtflow_replay`` fixture replays a stored run directory against the environment under
  test and fails with the diff unless the runs are identical (``docs/replay.md``)::

      def test_env_unchanged(mtflow_replay):
          mtflow_replay('tests/data/replay_example/run')  # its own config, found next to it

It costs nothing in a session that runs no executor: the listener only appends to a list, and the
viewer is imported only to format a failure.
"""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence

import pytest

from mtflow.core.errors import UserError
from mtflow.core.trace import Trace, add_listener, remove_listener

#: At most this many requests are printed under a failure (the HTML page has them all).
MAX_REQUESTS = 40
_STASH = pytest.StashKey['TraceCapture']()


class TraceCapture:
    """The traces of the executor runs made during one test, oldest first."""

    def __init__(self) -> None:
        self.runs: List[Trace] = []

    def __call__(self, trace: Trace) -> None:  # the listener
        self.runs.append(trace)

    def __len__(self) -> int:
        return len(self.runs)

    def __bool__(self) -> bool:
        return bool(self.runs)

    @property
    def last(self) -> Trace:
        """The most recent run's trace."""
        if not self.runs:
            raise LookupError('no mtflow executor run has finished in this test yet')
        return self.runs[-1]

    @property
    def trace(self) -> Trace:
        """Every run's events in one trace (uuids repeated across runs are then merged: use
        :attr:`runs` to tell such runs apart)."""
        return Trace.merge(self.runs)

    def run_of(self, uuid: str) -> Trace:
        """The latest run that has request ``uuid``."""
        for run in reversed(self.runs):
            if any(e.uuid == uuid for e in run.events):
                return run
        known = sorted({e.uuid for run in self.runs for e in run.events})
        raise KeyError(f'no request {uuid!r} in the {len(self.runs)} run(s) of this test; '
                       f'requests: {", ".join(known[:20])}{" ..." if len(known) > 20 else ""}')

    def path(self, uuid: str) -> str:
        """``'pending -> generating -> ... -> finished(reason)'`` (latest run with that request)."""
        return self.run_of(uuid).path(uuid)

    def states(self, uuid: str) -> List[str]:
        return self.run_of(uuid).states(uuid)

    def finish_reason(self, uuid: str) -> Optional[str]:
        return self.run_of(uuid).finish_reason(uuid)

    def assert_path(self, uuid: str, expected: str) -> None:
        """Assert request ``uuid``'s path; ``expected`` may leave out the leading ``pending ->``."""
        actual = self.path(uuid)
        shown = actual
        if not expected.startswith('pending') and actual.startswith('pending -> '):
            shown = actual[len('pending -> '):]
        if ' '.join(expected.split()) != shown:
            raise AssertionError(f'request {uuid} went\n  {shown}\nexpected\n  {expected}')

    def format(self, uuids: Optional[Sequence[str]] = None, color: bool = False) -> str:
        """The terminal timeline and summary of these requests (all when ``None``)."""
        return _format_trace(self.trace, uuids, color=color)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup('mtflow')
    group.addoption('--mtflow-trace-dir', metavar='DIR', default=None,
                    help='write the HTML trace page (and the trace JSONL) of each failing test that ran mtflow into DIR')


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Iterator[None]:
    capture = TraceCapture()
    item.stash[_STASH] = capture
    add_listener(capture)
    try:
        yield
    finally:
        remove_listener(capture)
        capture.runs = []  # the reports are made: do not hold every test's traces for the whole session


@pytest.fixture
def mtflow_trace(request: pytest.FixtureRequest) -> TraceCapture:
    """The traces of the mtflow executor runs this test makes (:class:`TraceCapture`)."""
    capture = request.node.stash.get(_STASH, None)
    if capture is None:  # the protocol hook did not run (another plugin drives the test)
        capture = TraceCapture()
        add_listener(capture)
        request.addfinalizer(lambda: remove_listener(capture))
    return capture


@pytest.fixture
def mtflow_check_tokens() -> Any:
    """``check(backend, template=None, **kw) -> TemplateReport``: run the token conformance
    checks on ``backend`` (``template``: ``None``/``'model'``, a bundled name or a Jinja file; ``kw``
    as :func:`mtflow.backends.conformance.check_tokens`) and raise ``AssertionError`` with the
    table of checks and what failed unless every check passed (a run that checks nothing fails)."""

    def check(backend: Any, template: Optional[str] = None, **kw: Any) -> Any:
        from mtflow.backends import conformance  # lazy: the plugin loads in every pytest session

        name, text = conformance.resolve_template(template)
        report = conformance.check_tokens(backend, template=text, template_name=name, **kw)
        if not report.ok:
            from rich.console import Console

            console = Console(width=100, record=True, file=io.StringIO())
            console.print(conformance.format_report(report))
            problems = '\n'.join(f'  {p}' for p in report.problems[:20])
            raise AssertionError(f'token conformance failed for template {name}:\n{console.export_text()}{problems}')
        return report

    return check


@pytest.fixture
def mtflow_replay(tmp_path: Path) -> Any:
    """``replay(run_dir, config=None, *, tools='live', fields=None) -> dict``: replay a stored run
    directory (``mtflow replay``: its recorded model outputs) against ``config`` (the environment,
    tools, scheduler and reward under test; default: the run's own config, found relative to the
    run directory first, so a run committed with its config finds it anywhere), compare the new run
    with the stored one (``mtflow diff``), and raise ``AssertionError`` with the diff (each request
    that differs, its first differing turn and fields, the totals) unless they are identical.
    Returns the diff's totals. ``tools='recorded'`` serves tool and environment results from the
    record; ``fields`` limits what is compared (``mtflow diff --fields``). ``docs/replay.md``
    shows an environment's regression test built on it."""
    count = [0]

    def replay(run_dir: Any, config: Any = None, *, tools: str = 'live',
               fields: Optional[Sequence[str]] = None) -> Any:
        count[0] += 1
        out = tmp_path / f'mtflow-replay-{count[0]}'
        argv = ['replay', str(run_dir)] + ([str(config)] if config is not None else []) + [
            '--out', str(out), '-q', '--tools', tools]
        code, _ = _command(argv)
        if code != 0:
            raise AssertionError(f'mtflow {" ".join(argv)} failed (exit {code})')
        base, only = ['diff', str(run_dir), str(out)], (['--fields', *fields] if fields else [])
        code, shown = _command(base + ['--json'] + only)
        lines = [json.loads(line) for line in shown.splitlines() if line.strip()]
        if code not in (0, 1) or not lines or 'totals' not in lines[-1]:
            raise AssertionError(f'mtflow {" ".join(base)} failed (exit {code}): {shown.strip()}')
        if code == 1:
            _, text = _command(base + ['--max-shown', '20'] + only)
            raise AssertionError(f'the replay of {run_dir} against {config or "its own config"} differs '
                                 f'(new run: {out}):\n{text.rstrip()}')
        return lines[-1]['totals']

    return replay


def _command(argv: List[str]) -> Any:
    """Run ``mtflow replay`` / ``mtflow diff`` in this process: ``(exit status, stdout)``; a
    user error raises ``AssertionError`` with its one-line message."""
    import argparse

    from mtflow.commands import diff, replay  # lazy: the plugin loads in every pytest session

    parser = argparse.ArgumentParser(prog='mtflow')
    sub = parser.add_subparsers()
    replay.add_parser(sub)
    diff.add_parser(sub)
    shown = io.StringIO()
    try:
        args = parser.parse_args(argv)
        with contextlib.redirect_stdout(shown):
            code = args.func(args)
    except (UserError, FileNotFoundError) as exc:
        raise AssertionError(f'mtflow {" ".join(argv)}: {exc}') from None
    except SystemExit as exc:  # argparse: a usage error
        raise AssertionError(f'mtflow {" ".join(argv)}: bad arguments (exit {exc.code})') from None
    return code, shown.getvalue()


def involved_uuids(capture: TraceCapture, failure_text: str) -> List[str]:
    """The requests a failure is about: those its text names, else those that errored, else all."""
    trace = capture.trace
    uuids = trace.uuids()
    named = [u for u in uuids if re.search(r'(?<![\w#.-])' + re.escape(u) + r'(?![\w-])', failure_text)]
    if named:
        return named
    errored = [u for u in uuids if trace.finish_reason(u) == 'error']
    return errored or uuids


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    capture = item.stash.get(_STASH, None)
    if not capture:
        return
    try:
        _report_failure(item, report, capture)
    except Exception as exc:  # never hide the real failure behind a viewer problem
        report.sections.append(('mtflow trace', f'(could not render the trace: {type(exc).__name__}: {exc})'))


def _report_failure(item: pytest.Item, report: pytest.TestReport, capture: TraceCapture) -> None:
    trace = capture.trace
    uuids = involved_uuids(capture, str(report.longrepr or ''))
    total = len(trace.uuids())
    shown = uuids[:MAX_REQUESTS]
    runs = f'{len(capture.runs)} executor run{"s" if len(capture.runs) != 1 else ""}'
    head = f'{runs}, {total} request{"s" if total != 1 else ""}'
    if len(shown) < total:
        head += f'; showing {len(shown)}'
        if len(uuids) > len(shown):
            head += f' of the {len(uuids)} involved'
    text = head + '\n' + _format_trace(trace, shown)
    out_dir = item.config.getoption('mtflow_trace_dir', None)
    if out_dir:
        html_path = _write_page(Path(out_dir), item.nodeid, report.when, trace)
        text += f'HTML: {html_path}\n'
    report.sections.append((f'mtflow trace ({report.when})', text))


def _format_trace(trace: Trace, uuids: Optional[Sequence[str]], color: bool = False) -> str:
    from mtflow.viewer.terminal import format_trace  # lazy: imports rich, and only a failure needs it

    return format_trace(trace, uuids, color=color)


def _write_page(out_dir: Path, nodeid: str, when: str, trace: Trace) -> Path:
    from mtflow.viewer.html import write_html  # lazy: start-up cost, and only a failure needs it

    out_dir.mkdir(parents=True, exist_ok=True)
    name = re.sub(r'[^\w.-]+', '_', nodeid).strip('_')[:150]
    if when != 'call':
        name += f'.{when}'
    trace.write_jsonl(out_dir / f'{name}.trace.jsonl')
    return write_html(out_dir / f'{name}.html', trace, title=nodeid)
