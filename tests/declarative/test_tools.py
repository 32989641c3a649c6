"""The calculator (AST, never eval), schema derivation, and the concurrent runner: errors become
results, per-tool limits hold, timeouts fire, results come back in call order."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from mtflow.tools import Tool, ToolRunner, check_arguments, tool_from_callable, truncate
from mtflow.tools.calculator import CalculatorError, calculator, evaluate
from tests.tiny_model import make_tokenizer


@pytest.mark.parametrize('expr,value', [('2 + 3 * 4', '14'), ('(2 + 3) * 4 / 5', '4'), ('0.1 + 0.2', '0.3'),
                                        ('2 ^ 10', '1024'), ('-7 // 2', '-4'), ('sqrt(16) + abs(-1)', '5'),
                                        ('10 % 3', '1'), ('round(pi, 2)', '3.14')])
def test_calculator_values(expr, value):
    assert calculator(expr) == value


@pytest.mark.parametrize('expr,msg', [('__import__("os").system("echo hi")', 'unsupported syntax'),
                                      ('open("/etc/passwd")', 'unsupported syntax'), ('1/0', 'division by zero'),
                                      ('9**9**9', 'exponent'), ('x + 1', 'unsupported syntax'),
                                      ('(1).__class__', 'unsupported syntax'), ('2 +', 'invalid expression'),
                                      ('"a" * 3', 'not a number'), ('1' * 600, 'longer than')])
def test_calculator_rejects(expr, msg):
    with pytest.raises(CalculatorError, match=msg):
        evaluate(expr)


def test_schema_from_signature_and_docstring():
    def lookup(city: str, days: int = 1, metric: bool = True) -> str:
        """Weather forecast.

        Args:
            city: the city name
            days: how many days
        """
        return city

    t = tool_from_callable(lookup)
    assert t.description == 'Weather forecast.'
    assert t.parameters == {'type': 'object', 'required': ['city'], 'properties': {
        'city': {'type': 'string', 'description': 'the city name'},
        'days': {'type': 'integer', 'description': 'how many days', 'default': 1},
        'metric': {'type': 'boolean', 'default': True}}}


def test_check_arguments():
    t = tool_from_callable(calculator)
    assert check_arguments(t, '1+1') == {'expression': '1+1'}  # ReAct plain input
    with pytest.raises(ValueError, match='missing required'):
        check_arguments(t, {})
    with pytest.raises(ValueError, match='unknown argument'):
        check_arguments(t, {'expression': '1', 'x': 2})
    with pytest.raises(ValueError, match='must be of type string'):
        check_arguments(t, {'expression': 5})


def run(coro):
    return asyncio.run(coro)


def test_runner_turns_every_failure_into_a_result():
    def boom(x: int) -> str:
        raise RuntimeError('kaput')

    async def slow(x: int) -> str:
        await asyncio.sleep(5)
        return 'late'

    runner = ToolRunner([tool_from_callable(boom), tool_from_callable(slow, timeout_s=0.05),
                         tool_from_callable(calculator)])
    results = run(runner.call_all([('boom', {'x': 1}), ('slow', {'x': 1}), ('nope', {}), ('calculator', {'y': 1}),
                                   ('calculator', {'expression': '1/0'}), ('calculator', {'expression': '6*7'})]))
    kinds = [(r.ok, r.error_kind) for r in results]
    assert kinds == [(False, 'exception'), (False, 'timeout'), (False, 'unknown_tool'), (False, 'bad_arguments'),
                     (False, 'exception'), (True, '')]
    assert 'RuntimeError: kaput' in results[0].error
    assert 'timed out after 0.05 s' in results[1].error
    assert 'available: boom, slow, calculator' in results[2].error
    assert 'division by zero' in results[4].error
    assert results[5].output == '42'
    runner.close()


def test_runner_per_tool_concurrency_limit_and_call_order():
    active = {'now': 0, 'max': 0}
    lock = threading.Lock()

    def work(i: int) -> str:
        with lock:
            active['now'] += 1
            active['max'] = max(active['max'], active['now'])
        time.sleep(0.02)
        with lock:
            active['now'] -= 1
        return f'r{i}'

    runner = ToolRunner([tool_from_callable(work, max_concurrency=3)], max_threads=16)
    results = run(runner.call_all([('work', {'i': i}) for i in range(12)]))
    assert [r.output for r in results] == [f'r{i}' for i in range(12)]
    assert active['max'] == 3
    # a second event loop (the executor makes one per run) gets working semaphores too
    results = run(runner.call_all([('work', {'i': i}) for i in range(4)]))
    assert all(r.ok for r in results)
    runner.close()


def test_runner_async_tools_overlap():
    seen = []

    async def wait(i: int) -> int:
        seen.append(('start', i))
        await asyncio.sleep(0.01)
        seen.append(('end', i))
        return i

    runner = ToolRunner([tool_from_callable(wait)])
    results = run(runner.call_all([('wait', {'i': i}) for i in range(5)]))
    assert [r.output for r in results] == ['0', '1', '2', '3', '4']  # non-strings as JSON text
    assert [kind for kind, _ in seen[:5]] == ['start'] * 5  # all started before any finished


def test_truncate_chars_and_tokens():
    text = 'abcdefghij' * 10
    assert truncate(text, 10, 'right').startswith('abcdefghij\n[... 90 characters truncated]')
    assert truncate(text, 10, 'left').endswith('\nabcdefghij')
    assert truncate('short', 10) == 'short'
    tok = make_tokenizer()
    long = 'The quick brown fox jumps over the lazy dog. ' * 10
    cut = truncate(long, 5, 'right', tok)
    head, marker = cut.split('\n')
    assert tok.encode(head, add_special_tokens=False) == tok.encode(long, add_special_tokens=False)[:5]
    n = len(tok.encode(long, add_special_tokens=False))
    assert marker == f'[... {n - 5} tokens truncated]'


def test_a_sync_tool_and_a_tool_that_swallows_its_cancellation_both_time_out():
    """The one deadline (core.calls.within) serves tool calls: a sync tool in its thread past the
    limit is a 'timeout' result (the thread finishes on its own), and an async tool that catches
    the cancellation and goes on is given up after the unwind grace, still a 'timeout'."""
    release = threading.Event()

    def stuck(x: int) -> str:
        release.wait(5)
        return 'late'

    async def stubborn(x: int) -> str:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            await asyncio.sleep(5)  # ignores the cancel; within() stops waiting after UNWIND_GRACE_S
        return 'late'

    runner = ToolRunner([tool_from_callable(stuck, timeout_s=0.05), tool_from_callable(stubborn, timeout_s=0.05)])
    try:
        results = run(runner.call_all([('stuck', {'x': 1}), ('stubborn', {'x': 1})]))
    finally:
        release.set()
        runner.close()
    assert [(r.ok, r.error_kind) for r in results] == [(False, 'timeout'), (False, 'timeout')]
    assert all('timed out after 0.05 s' in r.error for r in results)
