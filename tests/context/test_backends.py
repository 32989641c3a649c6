"""Budgets read from the model: the HF backend reports its config's ``max_position_embeddings``,
the vLLM backend its engine's ``max_model_len`` (``tests/backends/fake_vllm.py`` stands in for
vLLM); an unset ``context_length`` takes it, and a larger one is an error when the executor is
built. Async mode gives the same outputs as lockstep with compaction on."""
from __future__ import annotations

import pytest

pytest.importorskip('transformers')

from mtflow import ContextBudget, Executor, RequestConfig  # noqa: E402
from mtflow.backends.hf import HFBackend  # noqa: E402
from mtflow.backends.scripted import ScriptedBackend  # noqa: E402
from mtflow.backends.vllm_engine import VLLMBackend  # noqa: E402
from mtflow.engine.context import ContextError  # noqa: E402

from tests.backends.fake_vllm import FakeAsyncLLM, FakeLLM, SamplingParams  # noqa: E402
from tests.context.helpers import GrowingNoLengthStop, GrowingObservations, Recording, count_words, requests  # noqa: E402
from tests.tiny_model import make_model, make_tokenizer  # noqa: E402

GREEDY = RequestConfig(max_tokens=8, temperature=0)


@pytest.fixture(scope='module')
def tiny():
    tok = make_tokenizer()
    return make_model(tok, max_position_embeddings=384), tok


def test_hf_reports_its_context_and_the_budget_uses_it(tiny):
    model, tok = tiny
    backend = HFBackend(model, tok)
    assert backend.context_length == 384
    recording = Recording(backend, counter=backend.count_prompt_tokens)
    result = Executor(GrowingNoLengthStop(max_turns=12, words=30), recording, GREEDY,
                      context=ContextBudget(count_tokens=backend.count_prompt_tokens)).run(requests(1))
    assert result.finish_reasons == ['context_full']
    assert max(p for _, p, _ in recording.prompts) <= 384 - 8
    compact = [e for e in result.trace.events if e.trigger == 'compact'][0]
    assert compact.extra['context']['context_length'] == 384
    assert compact.extra['context']['prompt_tokens'] > 384 - 8
    with pytest.raises(ContextError, match=r'context_length=1024 is larger than the model\'s context \(384 tokens'):
        Executor(GrowingObservations(), backend, GREEDY, context=ContextBudget(context_length=1024))


@pytest.mark.parametrize('engine', ['llm', 'async'])
def test_vllm_reports_max_model_len(tiny, engine):
    model, tok = tiny
    fake = FakeLLM(model, tok, max_model_len=256) if engine == 'llm' else FakeAsyncLLM(model, tok, max_model_len=256)
    backend = VLLMBackend(fake, sampling_params_cls=SamplingParams)
    try:
        assert backend.context_length == 256
        with pytest.raises(ContextError, match=r'context_length=512 is larger than the model\'s context \(256'):
            Executor(GrowingObservations(), backend, GREEDY, context=ContextBudget(context_length=512))
        ex = Executor(GrowingObservations(), backend, GREEDY, context=ContextBudget(context_length=200))
        assert ex.settings.context.context_length == 200
        assert Executor(GrowingObservations(), backend, GREEDY,
                        context=ContextBudget()).settings.context.context_length == 256
    finally:
        backend.close()


def test_a_backend_without_a_context_length_takes_the_budgets():
    backend = ScriptedBackend(outputs=['x'])
    ex = Executor(GrowingObservations(), backend, GREEDY,
                  context=ContextBudget(context_length=100, count_tokens=count_words))
    assert ex.settings.context.context_length == 100


def _comparable(output):
    d = output.model_dump()
    d['response'] = d['response']['choices']  # the response id and creation time differ per call
    return d


@pytest.mark.parametrize('policy', ['drop_observations', 'summarize', 'stop'])
def test_async_mode_gives_the_lockstep_outputs_with_compaction(policy):
    outputs = {}
    for mode in ('lockstep', 'async'):
        backend = ScriptedBackend(outputs=[{'content': 'I will look further', 'token_ids': [1, 2, 3, 4]}], cycle=True)
        budget = ContextBudget(context_length=1000, policy=policy, keep_last_turns=1, count_tokens=count_words)
        result = Executor(GrowingObservations(max_turns=8), backend, RequestConfig(max_tokens=50), context=budget,
                          mode=mode).run(requests(3))
        outputs[mode] = ([_comparable(o) for o in result.outputs], result.finish_reasons,
                         sorted((e.uuid, e.turn, e.src, e.dst, e.trigger, e.reason) for e in result.trace.events))
    assert outputs['async'] == outputs['lockstep']
