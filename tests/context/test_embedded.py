"""The issue's "done means" run with the embedded model (SmolLM2-135M, ``HFBackend('embedded')``):
a scheduler whose observations grow the prompt by ~200 tokens a turn, a context of 600 tokens,
``max_tokens=8``, greedy, one request. With ``stop`` no prompt ever exceeds the context and the
request finishes ``context_full`` at the right turn; with ``drop_observations`` and
``summarize`` it reaches its turn limit with every prompt inside the budget, and every segment
passes the exact-id check. Each prompt's size is taken three ways and must agree: the backend's
count (what the budget checked), the ids the prompter sent, and the token record's segments
(``prompt_ids`` plus the ids and glue of the earlier turns). The same scenario on the scripted
backend is in ``test_budgets.py`` and ``test_compaction.py``.

Sized for a loaded 2-core machine: ~28 s of CPU for the three runs after the model is loaded
(figures in ``docs/benchmarks.md``, "Context budgets with the embedded model")."""
from __future__ import annotations

from typing import Any, List

import pytest

pytest.importorskip('transformers')

from mtflow import ContextBudget, Executor, RequestConfig, RolloutInferRequest  # noqa: E402

from tests.context.helpers import GrowingNoLengthStop, Recording, check_segments_exact, requests  # noqa: E402

CONTEXT = 600
MAX_TOKENS = 8
LIMIT = CONTEXT - MAX_TOKENS  # the most prompt tokens a turn may send
OBS_WORDS = 100  # 'o<turn>' is two SmolLM2 tokens: ~200 tokens of observation a turn
MAX_TURNS = 5
GREEDY = RequestConfig(max_tokens=MAX_TOKENS, temperature=0, logprobs=True)

pytestmark = pytest.mark.slow


@pytest.fixture(scope='module')
def embedded():
    """The embedded backend, with torch on one thread while these tests run: on a shared,
    loaded machine two spinning threads cost ~5x the CPU of one (measured: 12 s against 2.5 s
    for one 440-token turn); greedy outputs do not depend on it beyond float rounding, and the
    assertions below do not depend on the exact words sampled."""
    import torch

    from mtflow.backends.hf import HFBackend
    from mtflow.backends.models import embedded_gguf_path

    try:
        embedded_gguf_path()
    except Exception as exc:  # the package is installed by scripts/setup.sh
        pytest.skip(f'the embedded model is not installed: {exc}')
    threads = torch.get_num_threads()
    try:
        yield HFBackend('embedded', threads=1)  # every call sets it (the default, 'auto', would choose)
    finally:
        torch.set_num_threads(threads)


def _run(backend: Any, policy: str) -> tuple:
    recording = Recording(backend, counter=backend.count_prompt_tokens)
    budget = ContextBudget(context_length=CONTEXT, policy=policy, keep_last_turns=1, summary_max_tokens=8)
    result = Executor(GrowingNoLengthStop(max_turns=MAX_TURNS, words=OBS_WORDS), recording, GREEDY,
                      context=budget).run(requests(1))
    return result, recording


def _record_prompt_sizes(output: Any) -> List[int]:
    """Each turn's prompt length as the token record has it: per segment, its ``prompt_ids``,
    then for each later turn the ids sampled before it and the glue after them."""
    from mtflow.accounting.segments_split import segments_of

    sizes = []
    for seg in segments_of(output):
        assert seg['exact'] is True and seg['prompt_ids'] is not None, seg['segment']
        size = len(seg['prompt_ids'])
        glue = seg['glue_ids'] or []
        for k, ids in enumerate(seg['response_token_ids']):
            sizes.append(size)
            size += len(ids) + (len(glue[k]) if k < len(glue) else 0)
    return sizes


def _turn_prompts(recording: Recording) -> tuple:
    counted = [p for u, p, _ in recording.prompts if ':summary' not in u]
    sent = [len(ids) for u, ids in recording.prompt_ids if ':summary' not in u]
    return counted, sent


def test_stop_finishes_context_full_at_the_right_turn(embedded):
    result, recording = _run(embedded, 'stop')
    assert result.finish_reasons == ['context_full'], result.failures
    out = result.outputs[0]
    counted, sent = _turn_prompts(recording)
    assert counted == sent == _record_prompt_sizes(out)
    assert all(p <= LIMIT for p in sent), sent
    # ~200 tokens a turn: turns 1-3 fit in 592 tokens, turn 4's prompt (~680) does not
    assert out.rollout_infos['num_turns'] == len(sent) == 3
    assert [m for _, _, m in recording.prompts] == [MAX_TOKENS] * 3
    [compact] = [e for e in result.trace.events if e.trigger == 'compact']
    counts = compact.extra['context']
    assert compact.turn == 3 and counts['why'] == 'context_full'
    assert counts['prompt_limit'] == LIMIT and counts['context_length'] == CONTEXT
    # the prompt that did not fit is the final messages' (the one turn 4 would have sent)
    assert counts['prompt_tokens'] > LIMIT
    assert counts['prompt_tokens'] == embedded.count_prompt_tokens(
        RolloutInferRequest(messages=out.messages, uuid='r0'))


@pytest.mark.parametrize('policy', ['drop_observations', 'summarize'])
def test_compaction_reaches_the_turn_limit_with_exact_segments(embedded, policy):
    result, recording = _run(embedded, policy)
    assert result.finish_reasons == ['check_finished'], result.failures
    out = result.outputs[0]
    assert out.rollout_infos['num_turns'] == MAX_TURNS
    counted, sent = _turn_prompts(recording)
    assert counted == sent == _record_prompt_sizes(out)
    assert len(sent) == MAX_TURNS and all(p <= LIMIT for p in sent), sent
    compactions = out.rollout_infos['compactions']
    assert compactions >= 1
    events = [e for e in result.trace.events if e.src == 'compacting']
    assert len(events) == compactions
    for event in events:
        comp = event.extra['compaction']
        assert comp['policy'] == policy and comp['prompt_tokens_before'] > LIMIT >= comp['prompt_tokens_after']
    if policy == 'summarize':
        summaries = [(u, m) for u, _, m in recording.prompts if ':summary' in u]
        assert summaries == [(f'r0:summary-{n}', 8) for n in range(1, compactions + 1)]
    samples = check_segments_exact(out, 'r0', recording)
    assert len(samples) == compactions + 1
    assert [s['turns'][0] for s in samples][0] == 1 and samples[-1]['turns'][1] == MAX_TURNS
