"""A step may end its request (``done``) or start a new exact training segment (``new_segment``),
in every driver, through the one table of handlers; and a stream's source may have nothing yet
(``NOTHING_YET``) without stalling the requests in flight."""
from __future__ import annotations

import threading
import time

import pytest

from mtflow import Executor, Scheduler
from mtflow.accounting.segments_split import segments_of, training_samples
from mtflow.accounting.token_record import RecordAccounting
from mtflow.backends.scripted import ScriptedBackend
from mtflow.engine.stream import NOTHING_YET
from tests.helpers import out, req
from tests.tiny_model import make_tokenizer

MODES = ({}, {'mode': 'async'}, {'mode': 'async', 'max_concurrency': 1})


class EndsAtTurn(Scheduler):
    """Its step ends the request after ``end`` turns with its own reason and a reward."""

    def __init__(self, end: int) -> None:
        super().__init__(max_turns=10)
        self.end = end

    def step(self, infer_request, response_choice, current_turn):
        if current_turn == self.end:
            return {'done': True, 'finish_reason': 'client_finished', 'rollout_infos': {'reward': 0.5},
                    'trace_info': {'why': 'the client said so'}}
        infer_request.messages.append({'role': 'user', 'content': 'go on'})
        return {'infer_request': infer_request}


def rollout(requests, request_config=None):
    return [out('ok', [1, 2]) for _ in requests]


@pytest.mark.parametrize('mode', MODES)
def test_a_step_that_returns_done_finishes_its_request_after_the_applied_turn(mode):
    result = Executor(EndsAtTurn(2), rollout, **mode).run([req('a'), req('b')])
    assert result.ok and result.finish_reasons == ['client_finished'] * 2
    output = result.outputs[0]
    assert output.rollout_infos['reward'] == 0.5 and output.rollout_infos['num_turns'] == 2
    # the contract's accounting: the last turn's ids join as a stop after that turn would join them
    assert output.response_token_ids == [[1, 2]] and output.response_loss_mask == [[1, 1]]
    assert result.trace.states('a') == ['pending', 'generating', 'tool_step', 'generating', 'tool_step', 'finished']
    last = [e for e in result.trace.events if e.uuid == 'a'][-1]
    assert (last.trigger, last.reason, last.extra) == ('finish', 'client_finished', {'why': 'the client said so'})
    assert last.duration_s is not None  # the step's time is on the move out of tool_step


def test_a_done_step_with_a_bad_reason_fails_only_its_request():
    class Bad(Scheduler):
        def step(self, infer_request, response_choice, current_turn):
            if infer_request.uuid == 'a':
                return {'done': True, 'finish_reason': 7}
            return {'done': True}

    result = Executor(Bad(max_turns=3), rollout, on_error='return').run([req('a'), req('b')])
    assert result.finish_reasons == ['error', 'done_by_hook']
    assert result.failures[0].phase == 'step' and 'finish_reason must be a str' in str(result.failures[0].error)


class Rewrites(Scheduler):
    """At turn 2 the conversation is rewritten (a compaction of its own): a new segment."""

    def step(self, infer_request, response_choice, current_turn):
        if current_turn == 2:
            fresh = infer_request.model_copy(update={'messages': [infer_request.messages[0],
                                                                  {'role': 'user', 'content': 'summary so far'}]})
            return {'infer_request': fresh, 'new_segment': {'kind': 'compaction', 'at': 1},
                    'trace_info': {'segment': 'compaction'}}
        infer_request.messages.append({'role': 'user', 'content': 'more'})
        return {'infer_request': infer_request}


@pytest.mark.parametrize('mode', MODES)
def test_new_segment_closes_an_exact_segment_and_the_next_turn_starts_another(mode):
    backend = ScriptedBackend(outputs=['one two', 'three', 'four five six'], cycle=True, tokenizer=make_tokenizer())
    result = Executor(Rewrites(max_turns=4), backend, accounting=RecordAccounting(), **mode).run([req('a')])
    output = result.outputs[0]
    segments = segments_of(output)
    assert [s['turns'] for s in segments] == [[1, 2], [3, 4]]
    assert all(s['exact'] for s in segments)
    assert segments[0]['ended_by'] == {'kind': 'compaction', 'at': 1}
    assert segments[1]['messages'][1]['content'] == 'summary so far'
    samples = training_samples(output, uuid='a', reward=1.0)
    assert [s['reward'] for s in samples] == [1.0, 1.0]
    # each segment's trained ids are exactly what was sampled in its turns, after its own prompt
    for sample in samples:
        assert sample['prompt_ids'] and sum(sample['loss_mask']) > 0
    move = [e for e in result.trace.events if e.src == 'tool_step' and e.turn == 2][0]
    assert move.extra == {'segment': 'compaction'}


def test_new_segment_needs_a_new_request_object():
    class SameObject(Scheduler):
        def step(self, infer_request, response_choice, current_turn):
            infer_request.messages.append({'role': 'user', 'content': 'x'})
            return {'infer_request': infer_request, 'new_segment': True}

    result = Executor(SameObject(max_turns=3), rollout, on_error='return').run([req('a')])
    assert result.finish_reasons == ['error']
    assert result.failures[0].error.field == 'new_segment'


def test_a_stream_source_with_nothing_yet_does_not_stall_the_requests_in_flight():
    pending, done = [], threading.Event()

    class Source:
        def __iter__(self):
            return self

        def __next__(self):
            if pending:
                return pending.pop(0)
            if done.is_set():
                raise StopIteration
            return NOTHING_YET

    class TwoTurns(Scheduler):
        def step(self, infer_request, response_choice, current_turn):
            infer_request.messages.append({'role': 'user', 'content': 'again'})
            return {'infer_request': infer_request}

    pending.append(req('first'))
    stream = Executor(TwoTurns(max_turns=2), rollout).stream(Source())
    groups = [next(stream)]  # the first request ran to its end while the source had nothing more
    pending.append(req('second'))
    stream.poke()
    groups.append(next(stream))
    done.set()
    stream.poke()
    groups += list(stream)
    assert [g.uuids for g in groups] == [['first'], ['second']]
    assert [g.finish_reasons for g in groups] == [['max_turns'], ['max_turns']]


def test_stop_from_another_thread_ends_the_iteration():
    class Waits(Scheduler):
        async def step(self, infer_request, response_choice, current_turn):
            import asyncio
            await asyncio.sleep(0.05)
            infer_request.messages.append({'role': 'user', 'content': 'again'})
            return {'infer_request': infer_request}

    def endless():
        k = 0
        while True:
            k += 1
            yield req(f'r{k}')

    stream = Executor(Waits(max_turns=100), rollout).stream(endless(), max_concurrency=2)
    seen = []

    def consume():
        seen.extend(stream)

    thread = threading.Thread(target=consume)
    thread.start()
    time.sleep(0.2)
    stream.stop(interrupt=True)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert seen and seen[-1].seq == -1 and set(seen[-1].finish_reasons) == {'interrupted'}
