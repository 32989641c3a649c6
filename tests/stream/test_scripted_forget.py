"""A stream over the scripted backend holds only the requests in flight: each final request is
forgotten (``ScriptedBackend.forget``), with the same outputs as a run that keeps everything."""
from __future__ import annotations

from mtflow import Executor, RolloutInferRequest, Scheduler
from mtflow.backends.scripted import ScriptedBackend
from mtflow.engine.stream import forget_fn
from mtflow.run.turn_log import TurnLog


class ThreeTurns(Scheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'again'})
        return {'infer_request': infer_request}


def _script():
    # turn-keyed lines for prompt p1 (its copies p1#k replay them), uuid-keyed lines for p2,
    # unkeyed lines for the rest: every kind of per-request state the backend keeps
    return [{'uuid': 'p1', 'turn': 2, 'content': 'p1 second', 'token_ids': [21]},
            {'uuid': 'p2', 'content': 'p2 first', 'token_ids': [31]},
            {'uuid': 'p2', 'content': 'p2 second', 'token_ids': [32]},
            {'uuid': 'p2', 'content': 'p2 third', 'token_ids': [33]},
            {'content': 'free a', 'token_ids': [1]}, {'content': 'free b', 'token_ids': [2]}]


def _groups(n):
    for i in range(n):
        yield [RolloutInferRequest(messages=[{'role': 'user', 'content': f'p{i}'}], uuid=f'p{i}#{k}',
                                   data_dict={'group': f'p{i}'}) for k in range(3)]


def _texts(output):
    return [m['content'] for m in output.messages if m['role'] == 'assistant']


def test_a_stream_forgets_each_delivered_request_and_its_outputs_do_not_change():
    backend = ScriptedBackend(outputs=_script(), cycle=True)
    ex = Executor(ThreeTurns(max_turns=3), backend)
    got = {}
    for group in ex.stream(_groups(40), max_concurrency=1):  # one at a time: the free lines' order is fixed
        got.update(zip(group.uuids, map(_texts, group.outputs)))
    assert not backend._calls and not backend._copy_pos  # nothing kept once every request is delivered
    # the reference: the same requests in the same order, on a backend that keeps everything
    ref_backend = ScriptedBackend(outputs=_script(), cycle=True)
    requests = [r for g in _groups(40) for r in g]
    ref = Executor(ThreeTurns(max_turns=3), ref_backend, mode='async', max_concurrency=1).run(requests)
    assert len(ref_backend._calls) == 120
    assert got == {r.uuid: _texts(o) for r, o in zip(requests, ref.outputs)}
    assert got['p1#2'][1] == 'p1 second' and got['p2#1'] == ['p2 first', 'p2 second', 'p2 third']


def test_the_backend_holds_only_the_requests_in_flight_and_waiting():
    backend = ScriptedBackend(outputs=_script(), cycle=True)
    ex = Executor(ThreeTurns(max_turns=3), backend)
    held = []
    with ex.stream(_groups(60), max_concurrency=6, buffer=1) as stream:
        for group in stream:
            held.append(len(backend._calls))
            assert group.outputs[0] is not None
    assert len(held) == 60 and max(held) <= 6 + 2 * 3  # in flight, plus a finished group or two not yet taken
    assert not backend._calls


def test_forget_is_found_through_mtflow_runs_wrappers():
    backend = ScriptedBackend(outputs=['x'], cycle=True)
    batcher = backend.async_rollout_fn()
    try:
        wrapped = TurnLog().wrap(batcher)
        assert forget_fn(wrapped) == backend.forget
        assert forget_fn(backend.__call__) == backend.forget
        assert forget_fn(lambda requests, config=None: []) is None
        ex = Executor(ThreeTurns(max_turns=2), wrapped)
        list(ex.stream(_groups(5), max_concurrency=4))
        assert not backend._calls
    finally:
        batcher.close()
