"""Context budgets with the scripted backend: the check before every turn (``context_full`` at
the right turn, no prompt over the context) and the total response budget (``length_total``,
``max_tokens`` cut to what is left, every cut in the trace)."""
from __future__ import annotations

import pytest

from mtflow import ContextBudget, Executor, RequestConfig
from mtflow.backends.scripted import ScriptedBackend
from mtflow.engine.context import ContextError

from tests.context.helpers import OBS_WORDS, GrowingObservations, Recording, count_words, requests

REPLY = {'content': 'I will look further', 'token_ids': [11, 12, 13, 14]}  # 4 words, 4 ids


def _run(budget, n=2, max_turns=8, mode='lockstep', reply=REPLY, max_tokens=50):
    backend = Recording(ScriptedBackend(outputs=[reply], cycle=True))
    ex = Executor(GrowingObservations(max_turns=max_turns), backend, RequestConfig(max_tokens=max_tokens),
                  context=budget, mode=mode)
    return ex.run(requests(n)), backend


@pytest.mark.parametrize('mode', ['lockstep', 'async'])
def test_stop_finishes_context_full_at_the_right_turn(mode):
    budget = ContextBudget(context_length=1000, count_tokens=count_words)
    result, backend = _run(budget, mode=mode)
    head = 10  # system (5 words) + task (5 words)
    per_turn = len(REPLY['content'].split()) + OBS_WORDS
    # the prompt of turn t is head + (t-1)*per_turn; it must stay <= 1000 - 50
    last_fitting = max(t for t in range(1, 20) if head + (t - 1) * per_turn <= 950)
    assert result.finish_reasons == ['context_full', 'context_full']
    assert [o.rollout_infos['num_turns'] for o in result.outputs] == [last_fitting] * 2
    assert max(p for _, p, _ in backend.prompts) <= 950
    assert len(backend.prompts) == 2 * last_fitting
    events = [e for e in result.trace.events if e.uuid == 'r0']
    compact = [e for e in events if e.trigger == 'compact']
    assert len(compact) == 1 and compact[0].src == 'tool_step' and compact[0].dst == 'compacting'
    counts = compact[0].extra['context']
    assert counts['why'] == 'context_full' and counts['prompt_tokens'] == head + last_fitting * per_turn
    assert counts['prompt_limit'] == 950 and counts['context_length'] == 1000
    assert events[-1].src == 'compacting' and events[-1].reason == 'context_full'


def test_first_prompt_over_the_budget_finishes_before_any_call():
    budget = ContextBudget(context_length=60, prompt_budget=5, count_tokens=count_words)
    result, backend = _run(budget, max_tokens=10)
    assert result.finish_reasons == ['context_full'] * 2
    assert backend.prompts == []
    assert [e.src for e in result.trace.events if e.uuid == 'r0'] == ['pending', 'compacting']


@pytest.mark.parametrize('mode', ['lockstep', 'async'])
def test_total_budget_cuts_the_last_max_tokens(mode):
    reply = {'content': ' '.join(['w'] * 30), 'token_ids': list(range(30))}
    budget = ContextBudget(total_response_tokens=100, count_tokens=count_words)
    backend = Recording(ScriptedBackend(outputs=[reply], cycle=True, honor_max_tokens=True))
    ex = Executor(GrowingObservations(max_turns=8, words=3), backend, RequestConfig(max_tokens=40),
                  context=budget, mode=mode)
    result = ex.run(requests(1))
    out = result.outputs[0]
    sampled = [ids for _, ids in backend.outputs]
    assert sum(len(s) for s in sampled) <= 100
    assert sum(len(s) for s in sampled) == 100  # 30 + 30 + 30 + the last 10
    assert [m for _, _, m in backend.prompts] == [40, 40, 40, 10]
    assert result.finish_reasons == ['length_total']
    assert out.rollout_infos['num_turns'] == 4
    cut = [e for e in result.trace.events if e.extra and 'max_tokens_asked' in (e.extra.get('context') or {})]
    assert len(cut) == 1 and cut[0].dst == 'generating'
    assert cut[0].extra['context'] == {'used_response_tokens': 90, 'total_response_tokens': 100, 'max_tokens': 10,
                                       'max_tokens_asked': 40}
    last = result.trace.events[-1]
    assert (last.src, last.reason, last.tokens) == ('generating', 'length_total', 10)


def test_total_budget_spent_by_whole_turns_finishes_before_the_next_call():
    reply = {'content': ' '.join(['w'] * 30), 'token_ids': list(range(30))}
    backend = Recording(ScriptedBackend(outputs=[reply], cycle=True, honor_max_tokens=True))
    ex = Executor(GrowingObservations(max_turns=8, words=3), backend, RequestConfig(max_tokens=30),
                  context=ContextBudget(total_response_tokens=90))
    result = ex.run(requests(1))
    assert result.finish_reasons == ['length_total']
    assert [m for _, _, m in backend.prompts] == [30, 30, 30]
    compact, last = result.trace.events[-2:]
    assert (compact.src, compact.dst, compact.extra['context']['why']) == ('tool_step', 'compacting', 'length_total')
    assert (last.src, last.reason) == ('compacting', 'length_total')
    assert result.outputs[0].rollout_infos['num_turns'] == 3


def test_context_larger_than_the_model_is_an_error_at_build_time():
    class Small:
        context_length = 512

        def __call__(self, requests, config):  # pragma: no cover - never called
            raise AssertionError

    with pytest.raises(ContextError, match='context_length=1024 is larger than the model'):
        Executor(GrowingObservations(), Small(), RequestConfig(max_tokens=16),
                 context=ContextBudget(context_length=1024, count_tokens=count_words))


def test_budget_needs_a_counter_and_a_max_tokens():
    backend = ScriptedBackend(outputs=[REPLY])
    with pytest.raises(ContextError, match='cannot count prompt tokens'):
        Executor(GrowingObservations(), lambda r, c: [], RequestConfig(max_tokens=16),
                 context=ContextBudget(context_length=1024))
    with pytest.raises(ContextError, match='needs a per-turn max_tokens'):
        Executor(GrowingObservations(), backend, None, context=ContextBudget(context_length=1024,
                                                                             count_tokens=count_words))
    with pytest.raises(ValueError, match='context.policy must be one of'):
        ContextBudget(policy='shrink')


def test_no_budget_changes_nothing():
    plain, _ = _run(None, max_turns=3)
    assert plain.finish_reasons == ['max_turns', 'max_turns']
    assert not any(e.trigger == 'compact' for e in plain.trace.events)


def test_async_calls_for_different_cuts_run_at_once_with_the_same_outputs():
    """In one lockstep turn, requests whose ``max_tokens`` were cut to different values need one
    call each; with an async ``rollout_fn`` those calls overlap (the turn costs one round trip),
    with a sync one they run one after the other; the outputs are the same."""
    import asyncio

    script = [{'uuid': f'r{k}', 'content': ' '.join(['w'] * (20 + 3 * k)), 'token_ids': list(range(20 + 3 * k))}
              for k in range(4) for _ in range(8)]
    seen = {}
    for kind in ('sync', 'async'):
        backend = ScriptedBackend(outputs=script, honor_max_tokens=True)
        calls, live, peak = [], [0], [0]

        def sync_fn(reqs, config):
            calls.append(config.max_tokens)
            return backend(reqs, config)

        async def async_fn(reqs, config):
            calls.append(config.max_tokens)
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            await asyncio.sleep(0.01)
            live[0] -= 1
            return backend(reqs, config)

        result = Executor(GrowingObservations(max_turns=6, words=1), sync_fn if kind == 'sync' else async_fn,
                          RequestConfig(max_tokens=40), context=ContextBudget(total_response_tokens=100)).run(requests(4))
        seen[kind] = ([(o.messages, o.response_token_ids) for o in result.outputs], result.finish_reasons,
                      result.rollout_fn_calls, sorted(calls))
        if kind == 'async':
            # replies of 20, 23, 26, 29 tokens: turn 4 has 40, 31, 22, 13 left of 100 (four calls at once),
            # turn 5 20 (r0) and 8 (r1; r2 and r3 used theirs up)
            assert peak[0] == 4
    assert seen['sync'] == seen['async']
    assert result.finish_reasons == ['length_total'] * 4
    # turns 1-3 and r0's turn 4 uncut, then the cuts, then the contract's empty call after the last turn
    assert sorted(calls) == sorted([40] * 4 + [31, 22, 13] + [20, 8] + [40])
    assert [o.rollout_infos['num_turns'] for o in result.outputs] == [5, 5, 4, 4]
