"""SIGTERM stops a run whatever user code is blocking (YAML tools were fixed before: their threads
are daemons, ``tests/declarative/test_observation_bounds.py``): a Python scheduler's sync ``step``
that never returns, a sync ``rollout_fn`` that never returns (a plain callable class, whose calls
the async driver runs in its own threads) and a ``Backend``'s batch call that never returns
(behind the dynamic batcher), in lockstep and async modes. What finished is written, the stuck
request is in ``interrupted.jsonl``, the exit status is 143; the engine's threads held the
process (its step and rollout pools were not daemons, and the stream joined them)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import jsonl_lines, stop_by_sigterm

ROOT = Path(__file__).resolve().parents[1]

USER = '''
import os
import threading

from mtflow import Scheduler
from mtflow.backends import Backend, build_output


def hang(name):
    """Say it started, then never return."""
    open(os.path.join(os.environ['MTFLOW_TEST_DIR'], name), 'w').close()
    threading.Event().wait()


def turn_of(request):
    return 1 + sum(1 for m in request.messages if m['role'] == 'assistant')


class Plain(Scheduler):
    """b ends at turn 1, a at turn 2."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= (1 if infer_request.uuid == 'b' else 2)

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'go on'})
        return {'infer_request': infer_request}


class HangingStep(Plain):
    def step(self, infer_request, response_choice, current_turn):
        if infer_request.uuid == 'a':
            hang('a-started')
        return super().step(infer_request, response_choice, current_turn)


class HangingModel:
    """A plain rollout_fn class: a's second turn never comes back."""

    def __init__(self, model=None):
        pass

    def __call__(self, requests, request_config=None):
        if any(r.uuid == 'a' and turn_of(r) == 2 for r in requests):
            hang('a-started')
        return [build_output('ok', [1, 2], 'stop') for _ in requests]


class HangingBackend(Backend):
    """A Backend (batched by the dynamic batcher in async mode): a's second turn never comes back."""

    def __init__(self, model=None):
        super().__init__()

    def generate(self, requests, options):
        if any(r.uuid == 'a' and turn_of(r) == 2 for r in requests):
            hang('a-started')
        return [build_output('ok', [1, 2], 'stop') for _ in requests]
'''

CASES = {  # what hangs: (scheduler, backend)
    'step': ('user.py:HangingStep', 'scripted\nbackend_options: {outputs: [ok], cycle: true}'),
    'model': ('user.py:Plain', 'user:HangingModel'),
    'backend': ('user.py:Plain', 'user:HangingBackend'),
}


def _start(project: Path, mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f'{ROOT}{os.pathsep}{project}', MTFLOW_TEST_DIR=str(project))
    env.pop('MTFLOW_DEBUG', None)
    return subprocess.Popen([sys.executable, '-m', 'mtflow', 'run', 'run.yaml', '-q', '--mode', mode,
                             '--flush-every', '1'], cwd=project, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize('mode', ['async', 'lockstep'])
@pytest.mark.parametrize('what', sorted(CASES))
def test_sigterm_stops_a_run_whose_user_call_never_returns(tmp_path, what, mode):
    if what == 'backend' and mode == 'lockstep':
        pytest.skip('in lockstep a Backend is called in the driver thread, as the plain callable is (the model case)')
    scheduler, backend = CASES[what]
    (tmp_path / 'user.py').write_text(USER)
    (tmp_path / 'data.jsonl').write_text(''.join(json.dumps({'uuid': u, 'prompt': 'go'}) + '\n' for u in 'ab'))
    (tmp_path / 'run.yaml').write_text(f'scheduler: {scheduler}\nbackend: {backend}\ndataset: data.jsonl\n'
                                       'out: out\nmax_turns: 3\nbatch_size: 2\n')
    proc = _start(tmp_path, mode)
    deadline = time.monotonic() + 120
    out = tmp_path / 'out'
    while not ((tmp_path / 'a-started').exists() and jsonl_lines(out / 'trajectories.jsonl')):  # a hangs, b is written
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, 'the call never started'
        time.sleep(0.05)
    err = stop_by_sigterm(proc, f'its {what} hung ({mode})')
    assert proc.returncode == 143, err
    assert 'Traceback' not in err, err
    assert [t['uuid'] for t in jsonl_lines(out / 'trajectories.jsonl')] == ['b']
    assert [t['uuid'] for t in jsonl_lines(out / 'interrupted.jsonl')] == ['a']
    assert json.loads((out / 'run.json').read_text())['attempts'][-1]['status'] == 'interrupted'
    assert json.loads((out / 'summary.json').read_text())['status'] == 'interrupted'
    if (what, mode) != ('model', 'lockstep'):  # there the call runs in the main thread, which the signal unwound
        assert "mtflow: leaving 1 call(s) that did not return (mtflow-" in err
