"""Compaction as a state: ``drop_observations``, ``summarize`` and an ``on_context_full`` hook
reach the turn limit with every prompt inside the budget (scripted backend, and a real tiny
transformers model whose segments pass the exact-id check); a summary that fails or times out
fails only its request, in phase ``compacting``."""
from __future__ import annotations

import time

import pytest

from mtflow import ContextBudget, Executor, RequestConfig
from mtflow.backends.scripted import ScriptedBackend

from tests.context.helpers import GrowingNoLengthStop, GrowingObservations, Recording, check_segments_exact, count_words, requests

REPLY = {'content': 'I will look further', 'token_ids': [11, 12, 13, 14]}


def _scripted(budget, n=2, max_turns=8, mode='lockstep', **kw):
    backend = Recording(ScriptedBackend(outputs=[REPLY], cycle=True))
    ex = Executor(GrowingObservations(max_turns=max_turns), backend, RequestConfig(max_tokens=50), context=budget,
                  mode=mode, **kw)
    return ex.run(requests(n), ), backend


@pytest.mark.parametrize('mode', ['lockstep', 'async'])
def test_drop_observations_reaches_the_turn_limit_inside_the_budget(mode):
    budget = ContextBudget(context_length=1000, policy='drop_observations', keep_last_turns=1,
                           count_tokens=count_words)
    result, backend = _scripted(budget, mode=mode)
    assert result.finish_reasons == ['max_turns', 'max_turns']
    assert max(p for u, p, _ in backend.prompts if ':summary' not in u) <= 950
    out = result.outputs[0]
    assert out.rollout_infos['compactions'] == 1
    [seg] = out.rollout_infos['context_segments']
    assert seg['turns'] == [1, 5] and seg['segment'] == 0
    msgs = out.messages
    assert [m['content'] for m in msgs if m['role'] == 'tool'][:4] == [budget.placeholder] * 4
    assert msgs[0]['role'] == 'system' and msgs[1]['content'].startswith('Task 0')
    moves = [(e.src, e.dst, e.trigger) for e in result.trace.events if e.uuid == 'r0']
    assert ('tool_step', 'compacting', 'compact') in moves and ('compacting', 'generating', 'generate') in moves
    [event] = [e for e in result.trace.events if e.uuid == 'r0' and e.src == 'compacting']
    comp = event.extra['compaction']
    assert comp['policy'] == 'drop_observations' and comp['dropped'] == 4 and comp['segment'] == 1
    assert comp['prompt_tokens_before'] == 10 + 5 * 204 and comp['prompt_tokens_after'] == 10 + 5 * 4 + 4 * 6 + 200


def test_summarize_with_the_run_model_is_its_own_traced_call():
    budget = ContextBudget(context_length=1000, policy='summarize', keep_last_turns=1, count_tokens=count_words)
    result, backend = _scripted(budget, n=1)
    assert result.finish_reasons == ['max_turns']
    assert ('r0:summary-1', 2 + 5 * 4 + 4 * 200 + 4 + 4 * 1 + 4 * 1, 256)[::2] == \
        [(u, m) for u, _, m in backend.prompts if ':summary' in u][0]
    assert max(p for u, p, _ in backend.prompts if ':summary' not in u) <= 950
    out = result.outputs[0]
    summary = [m for m in out.messages if m['role'] == 'user' and m['content'].startswith('Summary of')]
    assert summary and 'I will look further' in summary[0]['content']
    [event] = [e for e in result.trace.events if e.src == 'compacting']
    comp = event.extra['compaction']
    assert comp['summary_uuid'] == 'r0:summary-1' and comp['summary_tokens'] == 4 and comp['summarized_turns'] == 4


def test_a_hook_rewrites_the_messages():
    seen = []

    def keep_task_only(request, budget):
        seen.append((budget.prompt_tokens, budget.prompt_limit, budget.turn))
        return list(request.messages[:2]) + [dict(request.messages[-1], content='(observations elided)')]

    budget = ContextBudget(context_length=1000, policy=keep_task_only, count_tokens=count_words)
    result, _ = _scripted(budget, n=1)
    assert result.finish_reasons == ['max_turns']
    assert seen == [(10 + 5 * 204, 950, 5)]
    [event] = [e for e in result.trace.events if e.src == 'compacting']
    assert event.extra['compaction']['policy'] == 'hook:keep_task_only'


def test_a_failing_summary_fails_only_its_request():
    calls = []

    def summarize(messages):
        calls.append(len(messages))
        if len(calls) == 1:
            raise RuntimeError('summary service down')
        return 'short'

    budget = ContextBudget(context_length=1000, policy='summarize', keep_last_turns=1, summarizer=summarize,
                           count_tokens=count_words)
    result, _ = _scripted(budget, n=2, on_error='return')
    assert sorted(result.finish_reasons) == ['error', 'max_turns']
    [failure] = result.failures
    assert failure.phase == 'compacting' and failure.turn == 5
    assert 'summary service down' in str(failure.error)


def test_a_summary_past_the_deadline_times_out_only_its_request():
    calls = []

    def slow_once(messages):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(2.0)
        return 'short'

    budget = ContextBudget(context_length=1000, policy='summarize', keep_last_turns=1, summarizer=slow_once,
                           count_tokens=count_words)
    result, _ = _scripted(budget, n=2, on_error='return', step_timeout_s=0.5)
    assert sorted(result.finish_reasons) == ['max_turns', 'timeout']
    [failure] = result.failures
    assert failure.phase == 'compacting'


@pytest.mark.parametrize('policy', ['drop_observations', 'summarize'])
def test_compacting_with_a_real_model_keeps_every_segment_exact(policy):
    pytest.importorskip('torch')
    from mtflow.backends.hf import HFBackend
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    backend = Recording(HFBackend(make_model(tok, max_position_embeddings=4096), tok), counter=lambda r: 0)
    backend.counter = backend.inner.count_prompt_tokens
    budget = ContextBudget(context_length=900, policy=policy, keep_last_turns=1, summary_max_tokens=8)
    ex = Executor(GrowingNoLengthStop(max_turns=6, words=60), backend,
                  RequestConfig(max_tokens=8, temperature=0, logprobs=True), context=budget)
    result = ex.run(requests(2))
    assert result.finish_reasons == ['check_finished', 'check_finished'], result.failures
    assert [o.rollout_infos['num_turns'] for o in result.outputs] == [6, 6]
    sent = [p for u, p, _ in backend.prompts if ':summary' not in u]
    assert max(sent) <= 900 - 8
    for k, out in enumerate(result.outputs):
        assert out.rollout_infos['compactions'] >= 1
        samples = check_segments_exact(out, f'r{k}', backend)
        assert len(samples) == out.rollout_infos['compactions'] + 1
