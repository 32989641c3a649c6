"""Each turn against the context budget in ``trace show`` (the summary's per-turn table and one
request's detail) and on the HTML page: the prompt tokens plus the ``max_tokens`` sent against
the context length, the cut ``max_tokens``, and the total response budget used and left. A run
without a budget shows none of it."""
from __future__ import annotations

import io

from rich.console import Console

from mtflow import ContextBudget, Executor, RequestConfig
from mtflow.backends.scripted import ScriptedBackend
from mtflow.viewer.html import render_html
from mtflow.viewer.model import request_views
from mtflow.viewer.terminal import detail_renderable, format_trace

from tests.context.helpers import GrowingObservations, Recording, count_words, requests

REPLY = {'content': ' '.join(['w'] * 30), 'token_ids': list(range(30))}  # 30 words, 30 ids


def _run(budget):
    backend = Recording(ScriptedBackend(outputs=[REPLY], cycle=True, honor_max_tokens=True))
    result = Executor(GrowingObservations(max_turns=8), backend, RequestConfig(max_tokens=40), context=budget,
                      ).run(requests(2))
    return result, backend


def _budget():
    return ContextBudget(context_length=1000, total_response_tokens=150, policy='drop_observations',
                         keep_last_turns=1, count_tokens=count_words)


def _detail(trace, uuid):
    buf = io.StringIO()
    view = {v.uuid: v for v in request_views(trace)}[uuid]
    Console(file=buf, width=200, no_color=True).print(detail_renderable(view, None))
    return buf.getvalue()


def test_trace_show_puts_each_turn_against_the_budget():
    result, backend = _run(_budget())
    assert result.finish_reasons == ['length_total', 'length_total']
    sent = [(p, m) for u, p, m in backend.prompts if u == 'r0']
    # 10 words of task, then 30 of reply and 200 of observation a turn; the fifth max_tokens is cut to
    # the 30 tokens left of 150
    assert sent == [(10, 40), (240, 40), (470, 40), (700, 40), (930, 30)]
    text = format_trace(result.trace)
    assert 'tokens against the context budget per turn' in text
    rows = [line.split() for line in text.splitlines() if ' / 1000 (' in line]
    assert len(rows) == 5
    used = 0
    for turn, ((prompt, max_tokens), row) in enumerate(zip(sent, rows), start=1):
        line = ' '.join(row)
        figure = f'{prompt} + {max_tokens} = {prompt + max_tokens} / 1000 ({round(100 * (prompt + max_tokens) / 1000)}%)'
        assert line.startswith(f'{turn} 2 {figure}'), line
        assert line.endswith(f'{150 - used} / 150'), line  # the least left of the total response budget
        used += min(30, max_tokens)  # the reply has 30 tokens
    assert '(max_tokens cut from 40) r0 2' in ' '.join(rows[-1])  # both requests were cut at turn 5
    detail = _detail(result.trace, 'r1')
    assert 'tokens against the context budget' in detail
    assert '930 + 30 = 960 / 1000 (96%) (max_tokens cut from 40)  120 / 150 used, 30 left' in detail
    assert '10 + 40 = 50 / 1000 (5%)' in detail and '0 / 150 used, 150 left' in detail


def test_a_compacted_turn_shows_the_compacted_prompt():
    budget = ContextBudget(context_length=1000, policy='drop_observations', keep_last_turns=1, count_tokens=count_words)
    backend = Recording(ScriptedBackend(outputs=[{'content': 'I will look further', 'token_ids': [1, 2, 3, 4]}],
                                        cycle=True))
    result = Executor(GrowingObservations(max_turns=8), backend, RequestConfig(max_tokens=50),
                      context=budget).run(requests(1))
    [event] = [e for e in result.trace.events if e.src == 'compacting']
    after = event.extra['compaction']['prompt_tokens_after']
    detail = _detail(result.trace, 'r0')
    rows = {int(line.split()[0]): line.split(None, 1)[1].strip() for line in detail.splitlines()
            if ' / 1000 (' in line and line.split()[0].isdigit()}
    assert sorted(rows) == list(range(1, 9))
    assert [int(rows[t].split()[0]) for t in sorted(rows)] == [p for _, p, _ in backend.prompts]
    assert rows[6].startswith(f'{after} + 50 = {after + 50} / 1000')  # turn 6 was sent compacted
    assert 'used' not in detail.split('tokens against the context budget')[1]  # no total budget: no column


def test_html_lists_each_request_against_the_budget():
    result, _ = _run(_budget())
    page = render_html(result.trace)
    assert 'Tokens against the context budget' in page and 'Requests under a budget (2)' in page
    assert '<td>50, 280, 510, 740, 960</td>' in page
    assert '<td>930 + 30 = 960 / 1000 (96%) (max_tokens cut from 40)</td>' in page
    assert '<td>120 / 150 used, 30 left</td>' in page


def test_a_run_without_a_budget_shows_nothing_of_it():
    result, _ = _run(None)
    assert not any(e.extra and 'context' in e.extra for e in result.trace.events)
    text = format_trace(result.trace)
    assert 'context budget' not in text and ' / 1000' not in text
    assert 'context budget' not in _detail(result.trace, 'r0')
    assert 'against the context budget' not in render_html(result.trace)
