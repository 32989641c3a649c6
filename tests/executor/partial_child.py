"""One fresh process of ``tests/executor/test_partial_exit.py``: partial rollouts through the
public path (``Executor(mode='async')`` with the scripted backend, behind its dynamic batcher and
as a plain synchronous ``rollout_fn``), printing what the parent checks as one JSON line.

An ``atexit`` handler registered before mtflow is imported runs last (``atexit`` is LIFO): it
records how many generations are still inside the engine when the interpreter is about to
finalize (a daemon thread killed there, with torch on its stack, aborts the process)."""
import atexit
import json
import sys
import threading
import time

ACTIVE = [0]


@atexit.register
def _at_exit():  # runs after mtflow's own exit handlers
    sys.stdout.write(json.dumps({'active_at_exit': ACTIVE[0]}) + '\n')
    sys.stdout.flush()


import mtflow  # noqa: E402
from mtflow.backends.scripted import ScriptedBackend  # noqa: E402


class Slow(ScriptedBackend):
    """The scripted backend, with a generation that takes ``delay_s`` inside the engine."""

    def __init__(self, delay_s, **kw):
        super().__init__(**kw)
        self.delay_s = delay_s
        self.lock = threading.Lock()

    def generate(self, requests, options):
        with self.lock:
            ACTIVE[0] += 1
        try:
            time.sleep(self.delay_s)
            return super().generate(requests, options)
        finally:
            with self.lock:
                ACTIVE[0] -= 1


class Turns(mtflow.Scheduler):
    """Request ``qN`` finishes after ``N % 3 + 1`` turns; the others go on with a user message."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= int(infer_request.uuid[1:]) % 3 + 1

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'go on'})
        return {'infer_request': infer_request}


def requests(n):
    return [mtflow.RolloutInferRequest(messages=[{'role': 'user', 'content': f'q{i}'}], uuid=f'q{i}')
            for i in range(n)]


def main():
    seed = int(sys.argv[1])
    report = {'runs': []}
    for concurrency, budget, n in ((1, 3, 8), (4, 5, 16), (16, 7 + seed % 5, 32), (64, 48, 96)):
        for kind in ('batcher', 'sync'):
            backend = Slow(0.001 if kind == 'sync' else 0.0, outputs=['I guess 5'], cycle=True)
            rollout = backend.async_rollout_fn(max_wait_s=0.001) if kind == 'batcher' else backend
            ex = mtflow.Executor(Turns(max_turns=5), rollout, mode='async', max_concurrency=concurrency)
            part = ex.run(requests(n), until=mtflow.Until(finished=budget))
            rest = ex.run(part.unfinished)
            busy = [t.name for t in threading.enumerate() if t.name.startswith('mtflow-rollout')]
            report['runs'].append({'kind': kind, 'concurrency': concurrency, 'budget': budget, 'requests': n,
                                   'finished': sum(o is not None for o in part.outputs),
                                   'unfinished': len(part.unfinished), 'rest_ok': rest.ok,
                                   'rest_finished': sum(o is not None for o in rest.outputs),
                                   'rollout_threads_left': busy})
    # the last run leaves a batch running in the batcher's daemon thread when the script ends
    slow = Slow(0.3, outputs=['I guess 5'], cycle=True)
    ex = mtflow.Executor(Turns(max_turns=5), slow.async_rollout_fn(max_wait_s=0.001), mode='async',
                         max_concurrency=8)
    last = ex.run(requests(16), until=mtflow.Until(seconds=0.1))
    report['last_unfinished'] = len(last.unfinished)
    print(json.dumps(report), flush=True)


if __name__ == '__main__':
    main()
