"""A fork's children within ``admission.env_sessions`` (issue 47, item 12): every child holds an
environment session of its own (its parent's, forked), so a prompt's tree holds up to its leaf
budget at once; the drivers start a prompt only when its whole tree fits (async mode, streams),
lockstep batches are refused beyond the bound (``mtflow run`` makes them that small), and a tree
that cannot be bounded (no ``leaves``, or more than the bound) is refused in one line. The peak is
the environment's own count of sessions open (resets and forks not yet closed), independent of
the gates."""
from __future__ import annotations

import json

import pytest

from mtflow import Admission, Executor
from mtflow.declarative import load_scheduler
from tests.helpers import Counter, out, req
from tests.test_admission import CountingGuess, _Peak


class ForkCountingGuess(CountingGuess):
    """Counts a forked copy's session too (it opens one, as a reset does)."""

    def fork(self):
        CountingGuess.peak.enter()
        return super().fork()


@pytest.fixture
def sessions():
    CountingGuess.peak = _Peak()
    return CountingGuess.peak


def _scheduler(leaves=2):
    branch = {'at': {'turn': 2}, 'copies': 2, **({'leaves': leaves} if leaves else {})}
    return load_scheduler({'name': 'adm_branch', 'max_turns': 4, 'branch': branch,
                           'env': {'impl': 'tests.branching.test_admission:ForkCountingGuess',
                                   'kwargs': {'max_guesses': 3}}})


def _guesser():
    return Counter(lambda r, n: out(str(40 + n)))


def test_async_mode_starts_a_prompt_when_its_whole_tree_fits(sessions):
    admission = Admission(env_sessions=2)
    result = Executor(_scheduler(), _guesser(), mode='async', admission=admission, on_error='return').run(
        [req(f'g{i}', {'role': 'system', 'content': 'Play.'}) for i in range(6)])
    assert result.failures == [] and len(result.outputs) == 12 and len(result.trees) == 6
    assert sessions.peak == 2 and sessions.now == 0  # the children used to open theirs past the bound
    figures = admission.summary()['env_sessions']
    assert figures['peak'] == 2 and figures['entered'] == 12 and figures['queued'] == 5


def test_a_stream_admits_groups_by_their_trees(sessions):
    admission = Admission(env_sessions=4)
    executor = Executor(_scheduler(), _guesser(), admission=admission, on_error='return')
    groups = list(executor.stream(iter([[req(f's{i}')] for i in range(5)]), max_concurrency=16))
    assert len(groups) == 5 and all(not g.failures and len(g.uuids) == 2 for g in groups)
    assert sessions.peak == 4 and sessions.now == 0
    with pytest.raises(ValueError, match=r'stream group of 3 requests, each a tree of up to 2 leaves, is larger'):
        list(Executor(_scheduler(), _guesser(), admission=admission).stream(iter([[req('a'), req('b'), req('c')]])))


def test_lockstep_counts_each_prompt_as_its_tree(sessions):
    executor = Executor(_scheduler(), _guesser(), admission=Admission(env_sessions=2))
    result = executor.run([req('l0')])
    assert result.failures == [] and len(result.outputs) == 2 and sessions.peak == 2
    with pytest.raises(ValueError, match=r'lockstep batch has 2 requests, holding environment sessions \(up to 2 '
                                         r'each, a tree of branch.leaves=2 leaves\).*batches of at most 1'):
        executor.run([req('m0'), req('m1')])


def test_a_tree_the_bound_cannot_hold_is_refused():
    with pytest.raises(ValueError, match='branch has no leaves budget: a fork opens a session for each child'):
        Executor(_scheduler(leaves=None), _guesser(), admission=Admission(env_sessions=4))
    with pytest.raises(ValueError, match=r'branch.leaves is 4: a tree holds up to 4 environment sessions at once'):
        Executor(_scheduler(leaves=4), _guesser(), admission=Admission(env_sessions=2))
    Executor(_scheduler(leaves=None), _guesser())  # without a bound: nothing to hold


@pytest.mark.parametrize('mode', ['lockstep', 'async'])
def test_mtflow_run_holds_a_branched_run_within_the_bound(tmp_path, monkeypatch, sessions, mode):
    from mtflow.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / 'sched.yaml').write_text(
        'name: adm\nmax_turns: 4\nbranch: {at: {turn: 2}, copies: 2, leaves: 2}\n'
        'env:\n  impl: tests.branching.test_admission:ForkCountingGuess\n  kwargs: {max_guesses: 3}\n')
    (tmp_path / 'script.jsonl').write_text(json.dumps({'content': '50', 'finish_reason': 'stop'}) + '\n')
    (tmp_path / 'run.yaml').write_text('scheduler: sched.yaml\nbackend: scripted\nmodel: script.jsonl\n'
                                       'backend_options: {cycle: true}\nout: out\nmax_turns: 4\nbatch_size: 8\n'
                                       f'limit: 5\nmode: {mode}\nadmission: {{env_sessions: 2}}\n')
    assert main(['run', 'run.yaml', '-q']) == 0
    summary = json.loads((tmp_path / 'out' / 'summary.json').read_text())
    assert summary['written'] == 10 and summary['prompts_written'] == 5 and summary['errors'] == 0
    assert sessions.peak == 2 and summary['admission']['env_sessions']['peak'] == 2
