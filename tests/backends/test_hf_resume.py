"""Interruptible generation on the HF backend (``HFBackend(resumable=True)``,
``mtflow/backends/hf_resume.py``): each single-request call generates in chunks of a few tokens
through the dynamic batcher; a trainer thread updates the weights version after every few
chunks, the stream (``on_update='resume'``) cuts each generation in flight between chunks and
continues it from the exact ids it had, appended to the prompt. A chunk boundary is a fresh
prefill, so logprobs agree with an uncut run to float rounding, not bit for bit."""
from __future__ import annotations


import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')

from mtflow import Executor, RequestConfig  # noqa: E402
from mtflow.backends import BackendError  # noqa: E402
from mtflow.backends.hf import HFBackend  # noqa: E402
from mtflow.engine.resume import is_resumable  # noqa: E402
from tests.backends.resume_util import after_steps, check_resumed, cut_midway, stream_with_updates  # noqa: E402
from tests.helpers import SaysLower, req  # noqa: E402
from tests.tiny_model import make_model, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.hf
CONFIG = RequestConfig(temperature=0, max_tokens=16, logprobs=True)
UPDATES, STEP = 4, 6  # an update after every 6 chunk calls



@pytest.fixture(scope='module')
def hf():
    tok = make_tokenizer()
    return HFBackend(make_model(tok, seed=3), tok, resumable=True, resume_chunk=4)


def _requests():
    return [req(f'r{i}', {'role': 'user', 'content': f'guess {i}'}) for i in range(4)]


def _stream(hf, updates):
    with hf.async_rollout_fn() as rollout:
        calls = {'n': 0}
        inner = rollout._generate_chunks

        def counting(chunks, options):
            calls['n'] += 1
            return inner(chunks, options)

        rollout.batcher.batch_fn = counting
        ex = Executor(SaysLower(), rollout, CONFIG, max_turns=2)
        reqs = _requests()
        return stream_with_updates(ex, [reqs[:2], reqs[2:]], updates, after_steps(lambda: calls['n'], STEP), 4)


def test_chunked_generation_equals_the_plain_one(hf):
    chunked, _ = _stream(hf, 0)
    plain = HFBackend(hf.model, hf.tokenizer)
    with plain.async_rollout_fn() as batcher:
        ref = Executor(SaysLower(), batcher, CONFIG, max_turns=2, mode='async').run(_requests())
    for i, out in enumerate(ref.outputs):
        got = chunked[f'r{i}']
        assert got.response_token_ids == out.response_token_ids
        assert got.messages == out.messages
        for a, b in zip(got.rollout_logprobs, out.rollout_logprobs):
            assert a == pytest.approx(b, abs=1e-4)


def test_resume_between_chunks_equals_an_uninterrupted_run(hf):
    ref, ref_stream = _stream(hf, 0)
    assert ref_stream.stats['resumed_generations'] == 0
    mine, stream = _stream(hf, UPDATES)
    assert stream.stats['resumed_generations'] > 0
    assert check_resumed(ref, mine, turns=2, logprob_abs=1e-4) > 0


def test_a_cut_call_hands_back_its_whole_chunks(hf):
    with hf.async_rollout_fn() as rollout:
        assert is_resumable(rollout)
        r = req('c', {'role': 'user', 'content': 'guess 2'})
        done = {'n': 0}
        inner = rollout._generate_chunks

        def counting(chunks, options):
            out = inner(chunks, options)
            done['n'] += 1
            return out

        rollout.batcher.batch_fn = counting

        partial = cut_midway(lambda: rollout([r], CONFIG), lambda: done['n'] >= 2)
        assert rollout.backend.prompter.find_record(r)[0] is None, 'a cut call commits no turn'
    full = HFBackend(hf.model, hf.tokenizer)([req('c', {'role': 'user', 'content': 'guess 2'})], CONFIG)[0]
    got, want = partial.response.choices[0], full.response.choices[0]
    n = len(got.token_ids)
    assert n % 4 == 0 and 8 <= n < len(want.token_ids)  # whole chunks: at least the two that were done
    assert got.token_ids == want.token_ids[:n]


def test_resume_chunk_is_checked(hf):
    with pytest.raises(BackendError, match='resume_chunk must be a positive int'):
        HFBackend(hf.model, hf.tokenizer, resumable=True, resume_chunk=0)
    assert not is_resumable(HFBackend(hf.model, hf.tokenizer).async_rollout_fn())
