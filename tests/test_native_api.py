"""The native API: the executor generates the first turn itself, runs async steps concurrently,
reports every finish, returns traces, and works from inside a running event loop."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import mtflow
from mtflow import Scheduler, StateGraph
from mtflow.core import trace as trace_mod
from tests.helpers import Counter, out, req


class Env(Scheduler):
    """Async steps that wait for each other: they can only all finish if they run concurrently."""

    def __init__(self, n: int, **kw):
        super().__init__(**kw)
        self.n = n
        self.started = []
        self.finished = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.all_in = None

    async def on_trajectory_start(self, requests):
        self.started = [r.uuid for r in requests]
        for r in requests:
            r.messages.insert(0, {'role': 'system', 'content': 'env ready'})

    async def step(self, infer_request, response_choice, current_turn):
        if self.all_in is None:
            self.all_in = asyncio.Event()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if self.in_flight == self.n:
            self.all_in.set()
        await asyncio.wait_for(self.all_in.wait(), timeout=5)
        self.in_flight -= 1
        if self.in_flight == 0:
            self.all_in = None
        infer_request.messages.append({'role': 'user', 'content': f'obs {current_turn}'})
        return {'infer_request': infer_request, 'trace_info': {'tool_calls': 1}}

    def on_request_finished(self, infer_request, reason, turn):
        self.finished.append((infer_request.uuid, reason, turn))


def test_first_turn_generated_by_the_executor_and_async_steps_concurrent():
    sched = Env(n=4, max_turns=3)
    rollout = Counter(lambda r, n: out(f'{r.uuid}:{n}', [n], [-.5]))
    result = mtflow.Executor(sched, rollout).run([req(f'r{i}') for i in range(4)])
    assert sched.started == ['r0', 'r1', 'r2', 'r3']
    assert sched.max_in_flight == 4
    assert len(rollout.calls) == 4 and rollout.calls[0] == ['r0', 'r1', 'r2', 'r3'] and rollout.calls[-1] == []
    o = result.outputs[0]
    assert o.messages[0] == {'role': 'system', 'content': 'env ready'}
    assert o.messages[-1]['content'] == 'r0:3' and o.rollout_infos['num_turns'] == 3
    assert sorted(sched.finished) == [(f'r{i}', 'max_turns', 3) for i in range(4)]
    steps = [e for e in result.trace if e.src == 'tool_step']
    assert len(steps) == 8 and all(e.extra == {'tool_calls': 1} and e.duration_s >= 0 for e in steps)
    tokens = [e.tokens for e in result.trace.for_request('r0') if e.trigger in ('run_step', 'finish')]
    assert tokens == [1, 1, 1]


def test_on_request_finished_runs_on_error_paths_too():

    class Breaks(Env):

        async def step(self, infer_request, response_choice, current_turn):
            raise RuntimeError('boom')

    sched = Breaks(n=1)
    result = mtflow.Executor(sched, Counter(lambda r, n: out('x')), on_error='return').run([req('a')])
    assert sched.finished == [('a', 'error', 1)]
    assert result.failures[0].phase == 'step'


def test_arun_inside_a_running_event_loop_and_executor_reuse():
    ex = mtflow.Executor(Env(n=2, max_turns=2), Counter(lambda r, n: out('x', [1])))

    async def main():
        return await ex.arun([req('a'), req('b')])

    first = asyncio.run(main())
    second = ex.run([req('c'), req('d')])
    assert first.finish_reasons == second.finish_reasons == ['max_turns', 'max_turns']
    assert second.trace.uuids() == ['c', 'd']


def test_async_rollout_fn_is_awaited():

    async def rollout(requests, config):
        await asyncio.sleep(0)
        return [out('y', [2]) for _ in requests]

    result = mtflow.Executor(Env(n=1, max_turns=2), rollout).run([req('a')])
    assert result.outputs[0].response_token_ids == [[2]]


def test_trace_listeners_receive_every_run():
    seen = []
    trace_mod.add_listener(seen.append)
    try:
        mtflow.Executor(Env(n=1, max_turns=1), Counter(lambda r, n: out('x'))).run([req('a')])
    finally:
        trace_mod.remove_listener(seen.append)
    assert len(seen) == 1 and seen[0].path('a') == 'pending -> generating -> finished(max_turns)'


def test_trace_round_trips_through_jsonl(tmp_path):
    result = mtflow.Executor(Env(n=2, max_turns=2), Counter(lambda r, n: out('x', [1, 2]))).run([req('a'), req('b')])
    path = tmp_path / 'trace.jsonl'
    result.trace.write_jsonl(path)
    assert mtflow.Trace.read_jsonl(path) == result.trace


def test_the_graph_is_declared_once_and_drawn_from_the_declaration():
    graph = StateGraph(('done_by_hook', 'stop_rule:final_answer'))
    assert ('tool_step', 'continue_message', 'continuing') in graph.edges()
    assert ('finished', 'generate', 'generating') not in graph.edges()
    text = graph.mermaid()
    assert 'stateDiagram-v2' in text and 'generating --> tool_step: run_step' in text
    assert 'stop_rule:final_answer' in text


def test_import_mtflow_stays_light():
    code = ('import sys, mtflow; heavy = [m for m in ("torch", "transformers", "vllm", "swift") if m in sys.modules];'
            'print(heavy)')
    assert subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          check=True).stdout.strip() == '[]'
