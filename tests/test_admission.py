"""Admission control (``mtflow/engine/admission.py``): one bound over tool/sandbox calls in flight
across all tools and over environment sessions open, with queues instead of failures, in lockstep,
async mode and streams. The peaks are observed independently of the gates: the tool calls by a
counter around the runner's call of the tool itself, the sessions by the environment's own count
of resets not yet closed."""
from __future__ import annotations

import json
import threading

import pytest

from mtflow import Admission, Executor
from mtflow.declarative import load_scheduler
from mtflow.declarative.gym import GuessNumberEnv
from mtflow.tools import isolation
from mtflow.tools.runner import ToolRunner
from tests.helpers import Counter, out, req


class _Peak:
    def __init__(self) -> None:
        self.now = self.peak = 0
        self.lock = threading.Lock()

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


@pytest.fixture
def running_calls(monkeypatch):
    """The tool calls actually running at once (entered the tool, not yet returned)."""
    peak = _Peak()
    real = ToolRunner._run

    async def counted(self, tool, kwargs):
        peak.enter()
        try:
            return await real(self, tool, kwargs)
        finally:
            peak.leave()

    monkeypatch.setattr(ToolRunner, '_run', counted)
    return peak


@pytest.fixture
def sandboxed():
    if isolation.probe('bwrap') and isolation.probe('unshare'):
        pytest.skip(f'no isolation here: {isolation.probe("bwrap")}; {isolation.probe("unshare")}')


def _calls(n: int, sleep: float) -> str:
    code = f'import time; time.sleep({sleep}); print("ok")'
    return '\n'.join('<tool_call>\n' + json.dumps({'name': 'python', 'arguments': {'code': code}}) + '\n</tool_call>'
                     for _ in range(n))


def _python_scheduler():
    return load_scheduler({'name': 'adm_python', 'parser': 'hermes', 'max_turns': 3,
                           'tools': [{'name': 'python', 'max_concurrency': 6, 'options': {'timeout_s': 60}}],
                           'observation': {'mode': 'message', 'role': 'tool', 'template': '{result}'}})


@pytest.mark.parametrize('mode', ['lockstep', 'async'])
def test_tool_calls_in_flight_never_exceed_the_bound_and_none_fails(sandboxed, running_calls, mode):
    # 6 requests x 3 calls each, twice: 18 calls want to run at once; each tool allows 6, the run 3
    model = Counter(lambda r, n: out(_calls(3, 0.3) if n <= 2 else 'done'))
    scheduler = _python_scheduler()
    admission = Admission(tool_calls=3)
    try:
        result = Executor(scheduler, model, mode=mode, admission=admission, on_error='return').run(
            [req(f'r{i}') for i in range(6)])
    finally:
        scheduler.close()
    assert result.failures == []
    infos = [o.rollout_infos for o in result.outputs]
    assert all(i['tool_calls'] == 6 and i['tool_errors'] == 0 for i in infos), infos
    assert running_calls.peak == 3  # the bound binds, and holds
    figures = admission.summary()['tool_calls']
    assert figures['limit'] == 3 and figures['peak'] == 3 and figures['entered'] == 36 and figures['in_flight'] == 0
    assert figures['queued'] > 0 and figures['queued_s'] > 0


def test_without_a_bound_the_same_calls_run_wider(sandboxed, running_calls):
    model = Counter(lambda r, n: out(_calls(3, 0.3) if n == 1 else 'done'))
    scheduler = _python_scheduler()
    admission = Admission()
    try:
        result = Executor(scheduler, model, admission=admission).run([req(f'r{i}') for i in range(4)])
    finally:
        scheduler.close()
    assert result.failures == []
    assert running_calls.peak == 6  # only the tool's own max_concurrency
    assert admission.summary()['tool_calls'] == {'limit': None, 'peak': 6, 'entered': 12, 'in_flight': 0,
                                                 'queued': 0, 'queued_s': 0.0}


# ---- environment sessions ------------------------------------------------------------------------
class CountingGuess(GuessNumberEnv):
    """``guess_number`` that counts its sessions open (reset, not yet closed) across instances."""
    peak = _Peak()

    def reset(self, infer_request):
        CountingGuess.peak.enter()
        return super().reset(infer_request)

    def close(self):
        CountingGuess.peak.leave()
        super().close()


@pytest.fixture
def sessions():
    CountingGuess.peak = _Peak()
    return CountingGuess.peak


def _env_scheduler():
    return load_scheduler({'name': 'adm_env', 'max_turns': 4,
                           'env': {'impl': 'tests.test_admission:CountingGuess', 'kwargs': {'max_guesses': 3}}})


def _guesser():
    return Counter(lambda r, n: out(str(40 + n)))


def test_async_mode_starts_requests_as_sessions_free_up(sessions):
    scheduler = _env_scheduler()
    admission = Admission(env_sessions=3)
    result = Executor(scheduler, _guesser(), mode='async', admission=admission, on_error='return').run(
        [req(f'g{i}', {'role': 'system', 'content': 'Play.'}) for i in range(10)])
    assert result.failures == [] and len(result.outputs) == 10
    assert all(r.startswith('stop_rule:env') for r in result.finish_reasons), result.finish_reasons
    assert sessions.peak == 3 and sessions.now == 0
    figures = admission.summary()['env_sessions']
    assert figures['peak'] == 3 and figures['entered'] == 10 and figures['in_flight'] == 0
    assert figures['queued'] == 7 and figures['queued_s'] > 0
    # the reset's opening reached every request, also those that waited for a session
    assert all(o.messages[1]['content'].startswith('I am thinking of a number') for o in result.outputs)


def test_a_stream_pulls_requests_within_the_session_bound(sessions):
    scheduler = _env_scheduler()
    admission = Admission(env_sessions=4)
    executor = Executor(scheduler, _guesser(), admission=admission, on_error='return')
    source = [[req(f's{i}a'), req(f's{i}b')] for i in range(5)]  # groups of 2
    groups = list(executor.stream(iter(source), max_concurrency=16))
    assert len(groups) == 5 and all(not g.failures for g in groups)
    assert sessions.peak == 4 and sessions.now == 0
    assert admission.summary()['env_sessions']['peak'] == 4


def test_a_stream_group_larger_than_the_bound_is_an_error(sessions):
    executor = Executor(_env_scheduler(), _guesser(), admission=Admission(env_sessions=2), on_error='return')
    with pytest.raises(ValueError, match='larger than admission.env_sessions'):
        list(executor.stream(iter([[req('a'), req('b'), req('c')]])))


def test_lockstep_runs_a_batch_within_the_bound_and_refuses_a_larger_one(sessions):
    admission = Admission(env_sessions=3)
    executor = Executor(_env_scheduler(), _guesser(), admission=admission)
    result = executor.run([req(f'l{i}') for i in range(3)])
    assert result.failures == [] and sessions.peak == 3
    with pytest.raises(ValueError, match=r"admission.env_sessions is 3 but this lockstep batch has 4 requests.*"
                                         r"mode='async'"):
        executor.run([req(f'm{i}') for i in range(4)])


def test_a_scheduler_without_an_environment_is_not_held_back():
    scheduler = load_scheduler({'name': 'plain', 'max_turns': 1})
    result = Executor(scheduler, _guesser(), admission={'env_sessions': 1}).run([req('a'), req('b')])
    assert result.failures == []


def test_bad_bounds_are_rejected():
    with pytest.raises(ValueError, match='admission.tool_calls must be a positive int'):
        Admission(tool_calls=0)
    with pytest.raises(ValueError, match='unknown key'):
        Executor(_env_scheduler(), _guesser(), admission={'sessions': 2})


# ---- mtflow run: the run config's admission block ----------------------------------------------
def _cli_run(tmp_path, monkeypatch, scheduler_yaml: str, script_line: dict, extra: str):
    from mtflow.cli import main as cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / 'sched.yaml').write_text(scheduler_yaml)
    (tmp_path / 'script.jsonl').write_text(json.dumps(script_line) + '\n')
    (tmp_path / 'run.yaml').write_text('scheduler: sched.yaml\nbackend: scripted\nmodel: script.jsonl\n'
                                       'backend_options: {cycle: true}\nout: out\nmax_turns: 2\nbatch_size: 8\n'
                                       + extra)
    assert cli(['run', 'run.yaml', '--no-progress']) == 0
    return json.loads((tmp_path / 'out' / 'summary.json').read_text())


@pytest.mark.parametrize('mode', ['lockstep', 'async'])
def test_mtflow_run_holds_env_sessions_within_the_bound(tmp_path, monkeypatch, sessions, mode, capsys):
    summary = _cli_run(tmp_path, monkeypatch, 'name: adm\nmax_turns: 4\nenv:\n  impl: tests.test_admission:CountingGuess\n'
                       '  kwargs: {max_guesses: 3}\n', {'content': '50', 'finish_reason': 'stop'},
                       f'limit: 10\nmode: {mode}\nadmission: {{env_sessions: 3}}\n')
    assert summary['written'] == 10 and summary['errors'] == 0
    assert sessions.peak == 3 and sessions.now == 0
    block = summary['admission']['env_sessions']
    assert block['limit'] == 3 and block['peak'] == 3 and block['entered'] == 10
    assert 'admission: env sessions' in capsys.readouterr().out


def test_mtflow_run_bounds_the_sandboxed_tool_calls(sandboxed, running_calls, tmp_path, monkeypatch):
    summary = _cli_run(tmp_path, monkeypatch, 'name: adm_py\nparser: hermes\nmax_turns: 2\ntools:\n  - name: python\n'
                       '    options: {timeout_s: 60}\nobservation: {mode: message, role: tool}\n',
                       {'content': _calls(3, 0.2), 'finish_reason': 'stop'}, 'limit: 5\nadmission: {tool_calls: 2}\n')
    assert summary['written'] == 5 and summary['errors'] == 0
    assert (summary['tool_calls'], summary['tool_errors']) == (15, 0)  # turn 2 hits max_turns before its calls
    assert running_calls.peak == 2
    block = summary['admission']['tool_calls']
    assert block['peak'] == 2 and block['queued'] > 0


def test_the_admission_block_is_checked_with_file_line_and_field(tmp_path):
    from mtflow.run.config import RunConfigError, load_run_config

    (tmp_path / 'run.yaml').write_text('scheduler: x.yaml\nbackend: scripted\nadmission: {tool_call: 2}\n')
    with pytest.raises(RunConfigError, match=r'run.yaml:3.*admission.*tool_call'):
        load_run_config(str(tmp_path / 'run.yaml'))


# ---- a real OpenEnv server whose session cap is the bound ----------------------------------------
def test_openenv_sessions_queue_for_the_bound_instead_of_failing():
    """The failure of ``test_client_side_capacity_waits_then_fails_clearly`` (tests/envs): 6
    requests against OpenEnv servers capped at 2 sessions fail past the capacity wait; with
    ``admission: {env_sessions: 2}`` they wait for a session and all succeed."""
    pytest.importorskip('openenv.core', reason="needs the 'openenv' extra (openenv 0.10)")
    from tests.envs.test_openenv import ROOT as REPO, Guesser, config, requests as guess_requests, settled

    names = ['g1-a', 'g2-b', 'g3-c', 'w-d', 'g1-e', 'w-f']
    scheduler = load_scheduler(config(max_sessions=2, capacity_wait_s=0.5), base_dir=str(REPO))
    admission = Admission(env_sessions=2)
    try:
        result = Executor(scheduler, Guesser(), max_turns=6, mode='async', admission=admission,
                          on_error='return').run(guess_requests(names))
        [server] = scheduler.env_factory.servers
        seen = settled(server.url)
    finally:
        scheduler.close()
    assert result.failures == [] and all(r == 'stop_rule:env_done' for r in result.finish_reasons)
    assert seen['resets'] == 6 and seen['closes'] == 6 and seen['open'] == 0
    figures = admission.summary()['env_sessions']
    assert figures['peak'] == 2 and figures['entered'] == 6 and figures['queued'] == 4
