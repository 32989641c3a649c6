"""Crash-safe ``mtflow run`` end to end: a subprocess on the scripted backend is killed (SIGKILL,
SIGINT, SIGTERM) at chosen points of a multi-batch run, then ``--resume`` must give exactly the
files of an uninterrupted run. Kill points are deterministic: the test scheduler stops inside the
step of a named request and turn, writes a marker file, and waits there to be killed."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mtflow.cli import main
from tests.helpers import jsonl_lines, run_contents

ROOT = Path(__file__).resolve().parents[1]

SCHEDULER = '''
import os
import time

from mtflow import Scheduler


def _pause(point):
    """Stop here (and tell the test) when MTFLOW_TEST_PAUSE names this point: a marker file in
    the MTFLOW_TEST_PAUSED directory, then wait for a signal."""
    if point in os.environ.get('MTFLOW_TEST_PAUSE', '').split(','):
        with open(os.path.join(os.environ['MTFLOW_TEST_PAUSED'], point.replace(':', '-')), 'w') as f:
            f.write(point)
        while True:
            time.sleep(0.02)


class Plays(Scheduler):
    """Request i plays data_dict['turns'] turns; each step is one tool call."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= int(infer_request.data_dict['turns'])

    def step(self, infer_request, response_choice, current_turn):
        _pause(f'{infer_request.uuid}:{current_turn}')
        infer_request.messages.append({'role': 'user', 'content': f'observation {current_turn}'})
        ids = response_choice.token_ids or []
        return {'infer_request': infer_request, 'response_token_ids': ids, 'response_loss_mask': [1] * len(ids),
                'rollout_infos': {'steps': current_turn}, 'trace_info': {'tool_calls': 1}}

    def on_request_finished(self, infer_request, reason, turn):
        if reason == 'interrupted':
            _pause('cleanup')
'''

#: turns each prompt plays: batches of 4 finish requests at different turns
TURNS = [2, 1, 3, 2, 1, 3, 2, 1, 3, 1, 2, 2]


@pytest.fixture(scope='module')
def project(tmp_path_factory):
    d = tmp_path_factory.mktemp('resume')
    (d / 'sched.py').write_text(SCHEDULER)
    prompts = [{'uuid': f'p{i}', 'prompt': f'play {i}', 'turns': n} for i, n in enumerate(TURNS)]
    (d / 'prompts.jsonl').write_text(''.join(json.dumps(p) + '\n' for p in prompts))
    # keyed by uuid and turn: every request's outputs are the same whatever ran before it
    script = [{'uuid': f'p{i}', 'turn': t, 'content': f'p{i} says {t}', 'token_ids': [i, t, 7],
               'logprobs': [-0.5, -0.25, -0.125]} for i in range(len(TURNS)) for t in range(1, 5)]
    (d / 'script.jsonl').write_text(''.join(json.dumps(s) + '\n' for s in script))
    (d / 'run.yaml').write_text(textwrap.dedent('''\
        scheduler: sched.py:Plays
        backend: scripted
        model: script.jsonl
        dataset: prompts.jsonl
        out: out
        max_turns: 4
        batch_size: 4
        request_config: {logprobs: true}
        '''))
    return d


@pytest.fixture(scope='module')
def baseline(project):
    """The files of an uninterrupted run."""
    out = project / 'baseline'
    assert _run(project, ['--out', str(out)]).returncode == 0
    return run_contents(out)


def _env(extra=None):
    env = dict(os.environ)
    env['PYTHONPATH'] = str(ROOT) + os.pathsep + env.get('PYTHONPATH', '')
    env.pop('MTFLOW_TEST_PAUSE', None)
    env.update(extra or {})
    return env


def _cmd(project, args):
    return [sys.executable, '-m', 'mtflow', 'run', str(project / 'run.yaml'), '-q'] + list(args)


def _run(project, args, **extra):
    return subprocess.run(_cmd(project, args), cwd=project, env=_env(extra), capture_output=True, text=True,
                          timeout=300)


def _start(project, args, points, tmp_path):
    """Start a run that stops at each of ``points`` ('uuid:turn': inside that step; 'cleanup':
    finishing a request as interrupted)."""
    return subprocess.Popen(_cmd(project, args), cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env({'MTFLOW_TEST_PAUSE': ','.join(points),
                                                 'MTFLOW_TEST_PAUSED': str(tmp_path)}))


def _wait_for(proc, point, tmp_path):
    """Wait until the run is held at ``point``."""
    marker = tmp_path / point.replace(':', '-')
    deadline = time.monotonic() + 180
    while not marker.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f'the run ended (rc {proc.returncode}) before reaching {point}: {err[-2000:]}')
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f'the run did not reach {point} within 180 s')
        time.sleep(0.02)
    marker.unlink()
    return proc


def _start_paused(project, args, point, tmp_path):
    return _wait_for(_start(project, args, [point], tmp_path), point, tmp_path)


def _kill(proc):
    proc.kill()
    proc.communicate(timeout=60)


def _finish(proc, sig):
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f'the run did not stop after {signal.Signals(sig).name}: {err[-2000:]}')
    return proc.returncode, err


def _consistent_on_disk(out):
    """The invariant a kill may never break: the two files agree on which requests are done."""
    done = {t['uuid'] for t in jsonl_lines(out / 'trajectories.jsonl')}
    finished = {e['uuid'] for e in jsonl_lines(out / 'trace.jsonl') if e['to'] == 'finished'}
    traced = {e['uuid'] for e in jsonl_lines(out / 'trace.jsonl')}
    assert done == finished == traced, (done, finished, traced)
    return done


def test_the_baseline_run(baseline):
    trajectories, events = baseline
    assert sorted(trajectories, key=lambda u: int(u[1:])) == [f'p{i}' for i in range(12)]
    for uuid, t in trajectories.items():
        i = int(uuid[1:])
        assert t['index'] == i and t['num_turns'] == TURNS[i] and t['finish_reason'] == 'check_finished'
        assert t['response_token_ids'] == [[i, turn, 7] for turn in range(1, TURNS[i] + 1)]
        assert events[uuid][-1]['to'] == 'finished' and all(e['index'] == i for e in events[uuid])


FIRST_EIGHT = {f'p{i}' for i in range(8)}


def _between(done, must, may=frozenset()):
    """``must <= done <= must | may``: requests that finish in the same turn as the paused step
    may be handled before or after it (the executor's order within a turn is not the test's)."""
    assert must <= done <= must | may, (sorted(done), sorted(must), sorted(may))
    return done


@pytest.mark.parametrize('point, flush_every, must, may', [
    ('p0:1', 1, set(), {'p1'}),  # the very first step: at most p1 (one turn) has finished
    ('p5:1', 1, {'p0', 'p1', 'p2', 'p3', 'p4'}, {'p7'}),  # p4 finished in this batch: on disk before it ends
    ('p10:1', 4, FIRST_EIGHT, set()),  # groups of 4: p9 had finished, but its group was still in memory
])
def test_sigkill_then_resume_equals_an_uninterrupted_run(project, baseline, tmp_path, point, flush_every, must, may):
    out = tmp_path / 'out'
    _kill(_start_paused(project, ['--out', str(out), '--flush-every', str(flush_every), '--flush-interval', '1000'],
                        point, tmp_path))
    done_at_kill = _between(_consistent_on_disk(out), must, may)
    assert not (out / 'summary.json').exists()
    res = _run(project, ['--out', str(out), '--resume'])
    assert res.returncode == 0, res.stderr
    assert run_contents(out) == baseline
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['status'] == 'complete' and summary['written'] == 12 and summary['remaining'] == 0
    assert summary['resumed_from'] == len(done_at_kill) and summary['attempts'] == 2
    assert summary['turns']['histogram'] == {'1': 4, '2': 5, '3': 3}, 'the summary covers both attempts'
    assert summary['tool_calls'] == sum(n - 1 for n in TURNS)


def test_killed_twice_then_a_torn_last_line(project, baseline, tmp_path):
    out = tmp_path / 'out'
    args = ['--out', str(out), '--flush-every', '1', '--flush-interval', '1000']
    _kill(_start_paused(project, args, 'p2:1', tmp_path))
    assert _consistent_on_disk(out) == {'p1'}
    # the second attempt's first batch is p0, p2, p3, p4 (p1 is done); it is killed in the next one
    _kill(_start_paused(project, args + ['--resume'], 'p6:1', tmp_path))
    done = _between(_consistent_on_disk(out), {'p0', 'p1', 'p2', 'p3', 'p4'}, {'p7'})
    # what a kill in the middle of a write leaves: half a line at the end of a file
    with open(out / 'trace.jsonl', 'a') as f:
        f.write('{"uuid": "p6", "index": 6, "rank": 0, "turn": 1, "from": "generat')
    with open(out / 'trajectories.jsonl', 'a') as f:
        f.write('{"uuid": "p6", "index": 6, "finish_reason": "check_fin')
    res = subprocess.run([a for a in _cmd(project, ['--out', str(out), '--resume']) if a != '-q'] + ['--no-progress'],
                         cwd=project, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert 'resuming' in res.stderr and f'{len(done)} of 12 requests already written' in res.stderr, res.stderr
    assert 'dropped a torn last line of trajectories.jsonl' in res.stderr
    assert 'dropped a torn last line of trace.jsonl' in res.stderr
    assert 'status' in res.stdout and 'complete' in res.stdout
    assert run_contents(out) == baseline
    info = json.loads((out / 'run.json').read_text())
    assert [a['status'] for a in info['attempts']] == ['running', 'running', 'complete'], 'two were killed'
    assert [a['done_at_start'] for a in info['attempts']] == [0, 1, len(done)]


@pytest.mark.parametrize('sig, code', [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_cleanly_and_resume_finishes(project, baseline, tmp_path, sig, code):
    out = tmp_path / 'out'
    proc = _start_paused(project, ['--out', str(out)], 'p5:1', tmp_path)  # default groups: held in memory
    rc, err = _finish(proc, sig)
    assert rc == code, err
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['status'] == 'interrupted'
    done = _between(_consistent_on_disk(out), {'p0', 'p1', 'p2', 'p3', 'p4'}, {'p7'})  # all finished is on disk
    cut = {t['uuid']: t for t in jsonl_lines(out / 'interrupted.jsonl')}
    assert set(cut) | done == FIRST_EIGHT and not set(cut) & done, 'the batch in flight: finished or interrupted'
    assert all(t['finish_reason'] == 'interrupted' and t['trace'][-1]['to'] == 'finished' for t in cut.values())
    assert summary['written'] == len(done) and summary['interrupted'] == len(cut)
    assert summary['remaining'] == 12 - len(done)
    info = json.loads((out / 'run.json').read_text())
    assert info['attempts'][-1]['status'] == 'interrupted' and info['attempts'][-1]['written'] == len(done)
    res = _run(project, ['--out', str(out), '--resume'])
    assert res.returncode == 0, res.stderr
    assert run_contents(out) == baseline
    assert not (out / 'interrupted.jsonl').exists(), 'the interrupted requests ran again'


def test_a_second_ctrl_c_exits_at_once(project, baseline, tmp_path):
    out = tmp_path / 'out'
    proc = _start(project, ['--out', str(out), '--flush-every', '1'], ['p5:1', 'cleanup'], tmp_path)
    _wait_for(proc, 'p5:1', tmp_path)
    proc.send_signal(signal.SIGINT)  # the first: p5..p7 start finishing as interrupted...
    _wait_for(proc, 'cleanup', tmp_path)  # ...and the test scheduler holds the run there
    rc, err = _finish(proc, signal.SIGINT)
    assert rc == 130 and 'again: exiting now' in err, err
    assert not (out / 'summary.json').exists(), 'it did not wait to write a summary'
    _between(_consistent_on_disk(out), {'p0', 'p1', 'p2', 'p3', 'p4'}, {'p7'})
    res = _run(project, ['--out', str(out), '--resume'])
    assert res.returncode == 0, res.stderr
    assert run_contents(out) == baseline


def _snapshot(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_a_rerun_without_resume_is_refused_and_touches_nothing(project, tmp_path):
    out = tmp_path / 'out'
    _kill(_start_paused(project, ['--out', str(out), '--flush-every', '1'], 'p5:1', tmp_path))
    before = _snapshot(out)
    n = len(jsonl_lines(out / 'trajectories.jsonl'))
    res = _run(project, ['--out', str(out)])
    assert res.returncode == 2 and res.stderr.count('\n') == 1, res.stderr
    assert f'{out} already holds a run ({n} trajectories): pass --resume to continue it, or --overwrite' in res.stderr
    assert _snapshot(out) == before


def test_resume_with_a_changed_config_is_refused(project, tmp_path):
    out = tmp_path / 'out'
    _kill(_start_paused(project, ['--out', str(out), '--flush-every', '1'], 'p5:1', tmp_path))
    before = _snapshot(out)
    res = _run(project, ['--out', str(out), '--resume', '--max-turns', '3'])
    assert res.returncode == 2 and res.stderr.count('\n') == 1, res.stderr
    assert 'the run was started with another config or dataset (config.max_turns: 4 -> 3)' in res.stderr
    assert 'resume with the original ones, or pass --overwrite' in res.stderr
    changed = project / 'prompts2.jsonl'
    changed.write_text((project / 'prompts.jsonl').read_text().replace('play 3', 'play three'))
    res = _run(project, ['--out', str(out), '--resume', '--dataset', str(changed)])
    assert res.returncode == 2 and 'files.dataset: "sha256:' in res.stderr, res.stderr
    assert _snapshot(out) == before
    res = _run(project, ['--out', str(out), '--resume', '--batch-size', '3'])
    assert res.returncode == 0, 'batch_size is not part of the fingerprint: ' + res.stderr


def test_overwrite_moves_the_old_run_aside(project, baseline, tmp_path):
    out = tmp_path / 'out'
    _kill(_start_paused(project, ['--out', str(out), '--flush-every', '1'], 'p5:1', tmp_path))
    before = _snapshot(out)
    res = _run(project, ['--out', str(out), '--overwrite'])
    assert res.returncode == 0, res.stderr
    assert run_contents(out) == baseline
    aside = [p for p in tmp_path.iterdir() if p.name.startswith('out.old-')]
    assert len(aside) == 1 and _snapshot(aside[0]) == {k: v for k, v in before.items() if k != 'run.lock'}
    res = _run(project, ['--out', str(out), '--overwrite', '--delete-old'])
    assert res.returncode == 0, res.stderr
    assert run_contents(out) == baseline
    assert len([p for p in tmp_path.iterdir() if p.name.startswith('out.old-')]) == 1, 'deleted, not moved'


def test_flag_mistakes_are_one_line(project, tmp_path, capsys):
    cfg = str(project / 'run.yaml')
    assert main(['run', cfg, '--out', str(tmp_path / 'o'), '--resume', '--overwrite']) == 2
    assert '--resume and --overwrite exclude each other' in capsys.readouterr().err
    assert main(['run', cfg, '--out', str(tmp_path / 'o'), '--delete-old']) == 2
    assert '--delete-old goes with --overwrite' in capsys.readouterr().err
    assert not (tmp_path / 'o').exists()


def test_a_backend_that_cannot_start_leaves_no_run_behind(project, tmp_path, capsys):
    out = tmp_path / 'o'
    assert main(['run', str(project / 'run.yaml'), '-q', '--out', str(out), '--model', 'nothere.jsonl']) == 2
    assert 'file not found' in capsys.readouterr().err
    assert not out.exists(), 'the next run is not refused'


def test_resume_of_a_complete_run_runs_nothing(project, baseline, tmp_path, capsys):
    out = tmp_path / 'out'
    assert main(['run', str(project / 'run.yaml'), '-q', '--out', str(out)]) == 0
    before = (out / 'trajectories.jsonl').read_bytes()
    assert main(['run', str(project / 'run.yaml'), '--no-progress', '--out', str(out), '--resume']) == 0
    captured = capsys.readouterr()
    assert '12 of 12 requests already written' in captured.err
    assert (out / 'trajectories.jsonl').read_bytes() == before
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['status'] == 'complete' and summary['rollout_fn_calls'] == 0 and summary['attempts'] == 2
    assert summary['written'] == 12 and summary['finish_reasons'] == {'check_finished': 12}


def test_the_last_progress_line_after_a_signal_counts_only_the_requests_written(project, tmp_path):
    """Issue 40: after Ctrl-C the last line said ``done: 4/8 requests`` when 2 were written (the
    requests cut short were counted); now it counts what is on disk and names the others."""
    out = tmp_path / 'out'
    cmd = [sys.executable, '-m', 'mtflow', 'run', str(project / 'run.yaml'), '--out', str(out),
           '--progress-every', '600']  # stdout is a pipe: log lines, the last one at the stop
    proc = subprocess.Popen(cmd, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env({'MTFLOW_TEST_PAUSE': 'p5:1', 'MTFLOW_TEST_PAUSED': str(tmp_path)}))
    _wait_for(proc, 'p5:1', tmp_path)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    written = len(_consistent_on_disk(out))
    cut = len(jsonl_lines(out / 'interrupted.jsonl'))
    assert written and cut, 'the stop came with requests in flight'
    last = [line for line in stdout.splitlines() if line.startswith('mtflow: done: ')][-1]
    assert last.startswith(f'mtflow: done: {written}/12 requests ({cut} interrupted), '), last
    assert f'interrupted: {written} of 12 requests are written' in stderr
