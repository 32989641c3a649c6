"""The progress figures (issue 40): the ETA does not undershoot the time left (lockstep batches
whose tails are narrow, a call that runs long, an async tail at one request's pace), it is marked
a lower bound before it knows a turn's length, and the turn count never passes its bound (a
compaction's summary call is no turn), through ``mtflow run`` in both modes.

The estimates run on a clock the test moves (no wall time); ``benchmarks/eta.py`` measures them
on real runs under a changing load (``docs/benchmarks.md``)."""
from __future__ import annotations

import json
import textwrap
from typing import Any, List

import pytest

from mtflow.run.eta import Eta
from mtflow.run.progress import RunProgress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _lockstep_run(turns_per_request: List[int], batch_size: int, max_turns: int, step_s: float, call_s: Any):
    """Plays a lockstep run on the fake clock: ``call_s(live, turn)`` is a call's length, each live
    request's step ``step_s`` (in order, as a sync scheduler's); yields ``(eta, time left)`` at
    every moment an estimate is shown (before each call, half-way through it, after it)."""
    clock = Clock()
    eta = Eta(len(turns_per_request), max_turns, lockstep=True, batch_size=batch_size, clock=clock)
    shown: List[tuple] = []
    finished = 0
    for b in range(0, len(turns_per_request), batch_size):
        batch = turns_per_request[b:b + batch_size]
        eta.batch_started(len(batch))
        for turn in range(1, max_turns + 1):
            live = [n for n in batch if n >= turn]
            if not live:
                break
            if turn > 1:
                clock.now += step_s * len(live)
            eta.call_started()
            length = call_s(len(live), turn)
            clock.now += length / 2
            shown.append((clock.now, eta.seconds_left(None, finished), eta.lower_bound))
            clock.now += length / 2
            eta.call_done(len(live))
            finished += sum(1 for n in batch if n == turn)
            shown.append((clock.now, eta.seconds_left(None, finished), eta.lower_bound))
    end = clock.now
    return [(estimate, end - t, lower) for t, estimate, lower in shown if end - t > 0]


@pytest.mark.parametrize('step_s', [0.0, 0.5])
def test_a_lockstep_eta_does_not_undershoot_batch_tails_or_the_next_batch(step_s):
    """Requests stop at 1 to 6 turns: each batch's last turns are narrow (1 or 2 live requests),
    and the next batch's first turns wide; a call costs 1 s plus 0.25 s per live request."""
    turns = [1 + (7 * i) % 6 for i in range(40)]
    shown = _lockstep_run(turns, batch_size=16, max_turns=6, step_s=step_s, call_s=lambda live, turn: 1 + 0.25 * live)
    total = shown[0][1]
    known = [(e, left) for e, left, lower in shown if not lower]
    assert known and all(e >= 0.8 * left for e, left in known if left < 0.9 * total), \
        [(round(e, 1), round(left, 1)) for e, left in known if e < 0.8 * left]


def test_a_call_that_runs_long_raises_the_eta_while_it_runs():
    clock = Clock()
    eta = Eta(8, 6, lockstep=True, batch_size=8, clock=clock)
    eta.batch_started(8)
    for _ in range(2):
        eta.call_started()
        clock.now += 1.0
        eta.call_done()
        clock.now += 0.5
    eta.call_started()
    before = eta.seconds_left(None, 0)
    clock.now += 10.0  # the machine got slow: this call has run 10 s where the others took 1
    during = eta.seconds_left(None, 0)
    assert during > before + 9 * 3, 'every turn left is now expected to take at least as long'


def test_before_a_turn_is_known_the_eta_is_a_lower_bound_and_says_so():
    clock = Clock()
    p = RunProgress('off', total=4, max_turns=3, lockstep=True, batch_size=4)
    p.eta.clock = clock
    p.start()
    p.on_batch(4)
    p.on_call()
    clock.now += 30.0  # the first call still runs
    assert p.figures()['eta_is_lower_bound'] and 'ETA >' in p.text()
    p.on_turn(4)
    clock.now += 1.0
    p.on_call()  # a step phase measured: a turn's length is known
    clock.now += 1.0
    p.on_turn(4)
    assert not p.figures()['eta_is_lower_bound'] and 'ETA >' not in p.text() and 'ETA ?' not in p.text()


def test_an_async_tail_goes_at_one_requests_pace():
    """Many requests early (a high rate), then one request left with 5 turns to go, each 2 s
    apart: the recent rate alone would say a fraction of that."""
    clock = Clock()
    eta = Eta(20, 6, lockstep=False, clock=clock)
    for k in range(19):  # 19 requests of 1 turn each, fast, all at once
        clock.now += 0.05
        eta.turn_done(f'q{k}')
        eta.request_done(f'q{k}')
    clock.now += 2.0
    eta.turn_done('last')  # its first turn; 5 more may follow, 2 s apart
    clock.now += 2.0
    eta.turn_done('last')
    left = 4 * 2.0
    assert eta.seconds_left(turns_left=4, finished=19) >= 0.8 * left


def _recorded(monkeypatch) -> List[Any]:
    import mtflow.run.driver as driver

    made: List[Any] = []

    class Recorded(driver.RunProgress):
        def _refresh(self) -> None:
            super()._refresh()
            made.append(self.figures())

    monkeypatch.setattr(driver, 'RunProgress', Recorded)
    return made


@pytest.mark.parametrize('mode', ['lockstep', 'async'])
def test_a_summary_call_is_no_turn_and_the_count_never_passes_its_bound(tmp_path, monkeypatch, capsys, mode):
    """A compaction that summarizes with the run's own model: its call used to count as a turn
    (``turns 5700/5694``)."""
    from mtflow.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / 'script.jsonl').write_text(json.dumps({'content': 'I will look further',
                                                       'token_ids': [11, 12, 13, 14]}) + '\n')
    (tmp_path / 'prompts.jsonl').write_text(''.join(json.dumps({'uuid': f'p{i}', 'prompt': f'Task {i}.'}) + '\n'
                                                    for i in range(3)))
    (tmp_path / 'run.yaml').write_text(textwrap.dedent(f'''\
        scheduler: tests.context.helpers:GrowingObservations
        backend: scripted
        model: script.jsonl
        backend_options: {{cycle: true}}
        dataset: prompts.jsonl
        out: out
        max_turns: 8
        mode: {mode}
        request_config: {{max_tokens: 50}}
        context: {{context_length: 1000, policy: summarize, keep_last_turns: 1, count_tokens: words}}
        '''))
    made = _recorded(monkeypatch)
    assert main(['run', 'run.yaml', '--progress-every', '1000']) == 0
    summary = json.loads((tmp_path / 'out' / 'summary.json').read_text())
    assert summary['context']['compactions'] >= 3, 'every request summarized at least once'
    assert made and all(f['turns'] <= f['turn_bound'] for f in made), [(f['turns'], f['turn_bound']) for f in made]
    assert (made[-1]['turns'], made[-1]['turn_bound']) == (24, 24)
    assert 'done: 3/3 requests, turns 24/24' in capsys.readouterr().out


@pytest.mark.parametrize('mode', ['lockstep', 'async'])
@pytest.mark.parametrize('leaves', [True, False])
def test_a_branched_run_counts_its_leaves_and_stays_inside_its_bound(tmp_path, monkeypatch, capsys, mode, leaves):
    """Forked requests (``docs/branching.md``) are requests to write, and their inherited turns
    count as played: the figures read ``done: 16/4 requests, turns 84/24`` before. With a leaf
    budget the total is known from the start; without one it grows at each fork."""
    from mtflow.cli import main

    root = __import__('pathlib').Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    sched = (root / 'schedulers' / 'guess_branch.yaml').read_text()
    if not leaves:
        sched = sched.replace('  leaves: 4          # exactly 4 leaves per game\n', '')
    (tmp_path / 'sched.yaml').write_text(sched)
    (tmp_path / 'run.yaml').write_text(
        (root / 'configs' / 'scripted_branch.yaml').read_text()
        .replace('schedulers/guess_branch.yaml', 'sched.yaml')
        .replace('scripted_guesses.jsonl', str(root / 'configs' / 'scripted_guesses.jsonl'))
        .replace('out: runs/scripted_branch', f'out: out\nmode: {mode}'))
    made = _recorded(monkeypatch)
    assert main(['run', 'run.yaml', '--progress-every', '1000']) == 0
    written = len((tmp_path / 'out' / 'trajectories.jsonl').read_text().splitlines())
    assert written > 4, 'the games forked'
    assert made and all(f['turns'] <= f['turn_bound'] and f['finished'] <= f['total'] for f in made), \
        [(f['finished'], f['total'], f['turns'], f['turn_bound']) for f in made]
    if leaves:
        assert {f['total'] for f in made} == {16}, 'every leaf counted from the start'
    last = made[-1]
    assert last['finished'] == last['total'] == written and last['turns'] == last['turn_bound']
    assert f'done: {written}/{written} requests, turns {last["turns"]}/{last["turns"]}' in capsys.readouterr().out


def _loaded_lockstep(load, batches: int = 4, batch_size: int = 8, max_turns: int = 6, call_s: float = 0.5,
                     step_s: float = 0.05):
    """Every request plays every turn (no slack in the bound); a call costs ``call_s`` and each
    live request's step ``step_s``, both times ``load(now)``. Returns ``(eta, time left, turns
    played, turns in all)`` at each end of a call, on the fake clock."""
    clock = Clock()
    eta = Eta(batches * batch_size, max_turns, lockstep=True, batch_size=batch_size, clock=clock)
    shown, finished, played = [], 0, 0
    for _ in range(batches):
        eta.batch_started(batch_size)
        for turn in range(1, max_turns + 1):
            if turn > 1:
                clock.now += step_s * batch_size * load(clock.now)
            eta.call_started()
            clock.now += call_s * load(clock.now)
            eta.call_done(batch_size)
            played += 1
            if turn == max_turns:
                finished += batch_size
            shown.append((clock.now, eta.seconds_left(None, finished), played))
    end = clock.now
    return [(e, end - t, n, batches * max_turns) for t, e, n in shown if end - t > 0]


def test_a_load_that_keeps_rising_is_carried_on_over_the_time_left():
    """The load rises 4% a second all the run (a turn is 8% longer at its end than at its
    start): every turn left will be longer than the last, and once three of each phase were
    measured (turn 4: the first step phase is turn 2's) the estimate says so (at the last turn's
    speed it said 0.74-0.8 of the time left then)."""
    shown = _loaded_lockstep(lambda t: 1.0 + 0.04 * t)
    late = [(e, left) for e, left, n, total in shown if n >= 4]
    assert late and all(e >= 0.8 * left for e, left in late), [(round(e, 1), round(left, 1)) for e, left in late]
    assert all(e <= 1.5 * left for e, left in late), 'the rise carried on for as long as it lasted, not blown up'


def test_a_flat_load_is_not_extrapolated():
    """Turns of one length: the estimate is the turns left at that length (a little over, as a
    batch's first turn has no step phase), never more."""
    shown = _loaded_lockstep(lambda t: 1.0)
    assert all(left - 1e-9 <= e <= 1.1 * left for e, left, _, _ in shown[1:]), \
        [(round(e, 1), round(left, 1)) for e, left, _, _ in shown]


def test_a_load_that_stepped_up_and_stays_is_a_new_speed_not_a_trend():
    """The load doubles at 5 s and stays: the estimate follows to the new speed and no further (a
    rise carried on from the step, 0.9 s a turn to 1.8 s in one turn, would say several times the
    time left)."""
    shown = _loaded_lockstep(lambda t: 1.0 if t < 5.0 else 2.0)
    after = [(e, left) for e, left, n, _ in shown if n >= 8]  # the step landed in turn 6 and 7
    assert after and all(left - 1e-9 <= e <= 1.15 * left for e, left in after), \
        [(round(e, 1), round(left, 1)) for e, left in after]


def test_noise_is_no_trend():
    from mtflow.run.eta import rise_rate

    assert rise_rate([(0.0, 1.0), (1.0, 1.2), (2.0, 0.9), (3.0, 1.25), (4.0, 1.0), (5.0, 1.1)]) == 0.0
    assert rise_rate([(0.0, 1.0), (1.0, 1.1), (2.0, 1.2), (3.0, 1.3)]) == pytest.approx(0.1 / 1.3)
    assert rise_rate([(0.0, 1.3), (1.0, 1.2), (2.0, 1.1)]) == 0.0, 'a falling load is not carried on'


def test_async_turns_left_go_at_the_live_requests_own_pace():
    """A burst of turns (a window's rate of 40 turns a second) while 8 live requests each take
    2 s a turn: the 80 turns left take 20 s at their pace, not 2 s at the burst's rate."""
    clock = Clock()
    eta = Eta(8, 12, lockstep=False, clock=clock)
    for k in range(8):
        eta.turn_done(f'q{k}')
    clock.now += 2.0
    for k in range(8):
        eta.turn_done(f'q{k}')
        clock.now += 0.025
    assert eta.seconds_left(turns_left=80, finished=0) >= 0.8 * 80 * 2.0 / 8


def test_a_request_not_heard_from_yet_still_counts_as_live():
    """4 requests at a time, a turn each 1 s: when one finishes, the next is in its first turn
    and has told nothing yet; the 40 turns left still go 4 at a time (10 s), not 3 (13 s)."""
    clock = Clock()
    eta = Eta(12, 6, lockstep=False, clock=clock)
    for _ in range(3):
        clock.now += 1.0
        for k in range(4):
            eta.turn_done(f'q{k}')
    eta.request_done('q0')  # q4 starts its first turn
    clock.now += 0.5
    assert 10.0 <= eta.seconds_left(turns_left=40, finished=1) < 40 * 1.0 / 3  # the window's rate says 11.7
