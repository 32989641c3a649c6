"""Interruptible generation on the vLLM backend's async engine (``VLLMBackend(resumable=True)``,
``mtflow/backends/vllm_resume.py``), against ``fake_vllm.FakeAsyncLLM`` (``AsyncLLM``'s
signatures, a tiny model generating greedily, one cumulative output per token at a set pace):
a trainer thread updates the weights mid-generation, the stream (``on_update='resume'``) cuts
each generation in flight (the backend aborts its engine request) and continues it from the
exact ids it had, appended to the token prompt. The real engine is checked by the opt-in
``test_vllm_real_resume.py``."""
from __future__ import annotations

import time

import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')

from mtflow import Executor, RequestConfig  # noqa: E402
from mtflow.backends import BackendError  # noqa: E402
from mtflow.backends.vllm_engine import VLLMBackend  # noqa: E402
from mtflow.engine.resume import is_resumable  # noqa: E402
from tests.backends.fake_vllm import FakeAsyncLLM, FakeLLM, SamplingParams  # noqa: E402
from tests.backends.resume_util import after_steps, check_resumed, cut_midway, stream_with_updates  # noqa: E402
from tests.helpers import SaysLower, req  # noqa: E402
from tests.tiny_model import make_model, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.hf
CONFIG = RequestConfig(temperature=0, max_tokens=16, logprobs=True)
UPDATES, STEP = 4, 10  # an update after every 10 tokens the engine yields



@pytest.fixture(scope='module')
def tiny():
    tok = make_tokenizer()
    return make_model(tok, seed=4), tok


class _Counting(FakeAsyncLLM):
    """Counts the outputs it yields: the trainer updates after every ``STEP`` of them, so that the
    updates land mid-generation however loaded the machine is."""

    yielded = 0

    async def generate(self, *args, **kwargs):
        async for out in super().generate(*args, **kwargs):
            self.yielded += 1
            yield out


def _stream(tiny, updates):
    engine = _Counting(*tiny, delay_per_token={'mtflow': 0.01})
    with VLLMBackend(engine, sampling_params_cls=SamplingParams, resumable=True) as backend:
        ex = Executor(SaysLower(), backend.async_rollout_fn(), CONFIG, max_turns=2)
        reqs = [req(f'r{i}', {'role': 'user', 'content': f'guess {i}'}) for i in range(4)]
        got, stream = stream_with_updates(ex, [reqs[i:i + 2] for i in range(0, 4, 2)], updates,
                                          after_steps(lambda: engine.yielded, STEP), 4)
    return got, stream, engine


@pytest.mark.slow  # ~7-12 s: the stand-in recomputes the tiny model for every token
def test_resume_on_the_async_engine_equals_an_uninterrupted_run(tiny):
    ref, ref_stream, _ = _stream(tiny, 0)
    assert ref_stream.stats['resumed_generations'] == 0
    mine, stream, engine = _stream(tiny, UPDATES)
    assert stream.stats['resumed_generations'] > 0
    assert 1 <= len(engine.aborted) <= stream.stats['resumed_generations']  # the cut requests were aborted
    resumed_prompts = [q['prompt']['prompt_token_ids'] for q in engine.requests]
    assert check_resumed(ref, mine, turns=2) > 0
    assert len(resumed_prompts) > 8  # 4 requests x 2 turns, and the resumed calls on top


def test_a_cut_call_aborts_its_engine_request_and_hands_back_the_ids_so_far(tiny):
    engine = _Counting(*tiny, delay_per_token={'mtflow': 0.02})
    with VLLMBackend(engine, sampling_params_cls=SamplingParams, resumable=True) as backend:
        assert is_resumable(backend.async_rollout_fn())
        r = req('c', {'role': 'user', 'content': 'guess 3'})

        partial = cut_midway(lambda: backend.acall([r], CONFIG), lambda: engine.yielded >= 4)
        assert backend.prompter.find_record(r)[0] is None, 'a cut call commits no turn'
        deadline = time.monotonic() + 5  # the abort runs on the backend's loop after the cut
        while not engine.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
    full = VLLMBackend(FakeLLM(*tiny), sampling_params_cls=SamplingParams)([req('c', {'role': 'user', 'content': 'guess 3'})],
                                                                           CONFIG)[0]
    got, want = partial.response.choices[0], full.response.choices[0]
    n = len(got.token_ids)
    assert 0 < n < len(want.token_ids)
    assert got.token_ids == want.token_ids[:n]
    assert [i['logprob'] for i in got.logprobs['content']] == [i['logprob'] for i in want.logprobs['content']][:n]
    assert engine.aborted == [engine.requests[0]['request_id']]


def test_resumable_needs_the_async_engine(tiny):
    with pytest.raises(BackendError, match='resumable=True needs the async engine'):
        VLLMBackend(FakeLLM(*tiny), sampling_params_cls=SamplingParams, resumable=True)
    with VLLMBackend(FakeAsyncLLM(*tiny), sampling_params_cls=SamplingParams) as plain:
        assert not is_resumable(plain.async_rollout_fn())
