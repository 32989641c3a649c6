"""The vLLM backend's async engine path (``AsyncLLM``: one stream per request) against a stand-in
with ``AsyncLLM``'s signatures that really generates with a tiny model and, like vLLM, belongs to
the first event loop it runs on (``fake_vllm.FakeAsyncLLM``)."""
import asyncio
import threading

import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')

from mtflow import RequestConfig  # noqa: E402
from mtflow.backends import BackendError  # noqa: E402
from mtflow.backends.hf import render_prompt  # noqa: E402
from mtflow.backends.vllm_engine import VLLMBackend  # noqa: E402
from mtflow.core.seeds import sampling_seed  # noqa: E402
from tests.backends.fake_vllm import FakeAsyncLLM, FakeLLM, SamplingParams  # noqa: E402
from tests.helpers import req  # noqa: E402
from tests.tiny_model import make_model, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.hf
GREEDY = RequestConfig(temperature=0, max_tokens=6, logprobs=True)


@pytest.fixture(scope='module')
def tiny():
    tok = make_tokenizer()
    return make_model(tok, seed=4), tok


def _backend(engine):
    return VLLMBackend(engine, sampling_params_cls=SamplingParams)


def _c(o):
    return o.response.choices[0]


def _requests():
    return [req('a'), req('b', {'role': 'user', 'content': 'guess'}, {'role': 'assistant', 'content': 'I guess'}),
            req('c', {'role': 'user', 'content': 'add 2 and 3 please'})]


def test_an_async_engine_is_detected_and_a_lockstep_call_streams_every_request(tiny):
    engine = FakeAsyncLLM(*tiny)
    with _backend(engine) as backend:
        assert backend.is_async and backend.native_async and 'async engine' in backend.describe()
        requests = _requests()
        got = backend(requests, GREEDY)
    want = _backend(FakeLLM(*tiny))(requests, GREEDY)
    for g, w, r in zip(got, want, requests):
        assert _c(g).token_ids == _c(w).token_ids and _c(g).message.content == _c(w).message.content
        assert _c(g).finish_reason == _c(w).finish_reason
        assert [i['logprob'] for i in _c(g).logprobs['content']] == [i['logprob'] for i in _c(w).logprobs['content']]
        assert g.response.prompt_token_ids == render_prompt(tiny[1], r)
    assert [q['prompt']['prompt_token_ids'] for q in engine.requests] == [render_prompt(tiny[1], r) for r in requests]
    assert len({q['request_id'] for q in engine.requests}) == 3, 'every stream has its own request id'
    assert engine.max_in_flight == 3, 'the turn went to the engine as concurrent streams'
    assert backend.stats.calls == 1 and backend.stats.requests == 3


def test_single_request_calls_from_other_loops_finish_in_their_own_time(tiny):
    gate = threading.Event()
    engine = FakeAsyncLLM(*tiny, hold={'slow': gate})
    with _backend(engine) as backend:
        rollout_fn = backend.async_rollout_fn()
        assert rollout_fn == backend.acall, 'a native async backend needs no batcher'

        async def go():
            gate.clear()
            slow = asyncio.ensure_future(rollout_fn([req('slow')], GREEDY))
            fast = await asyncio.wait_for(asyncio.gather(*(rollout_fn([req(f'f{i}')], GREEDY) for i in range(3))),
                                          timeout=120)
            assert not slow.done(), 'the fast ones came back while the slow stream was still running'
            gate.set()
            return [(await slow)[0]] + [f[0] for f in fast]

        outs = asyncio.run(go())  # the caller's loop is not the engine's: the backend hops over
        assert engine.finished_order[-1].startswith('mtflow-slow-')
        assert all(len(_c(o).token_ids) >= 1 for o in outs)
        again = asyncio.run(go())  # a second loop later: same engine, still fine
        assert [_c(o).token_ids for o in again] == [_c(o).token_ids for o in outs]


def test_cancelling_a_call_aborts_its_stream(tiny):
    engine = FakeAsyncLLM(*tiny, delay_per_token={'stuck': 5.0})
    with _backend(engine) as backend:

        async def go():
            task = asyncio.ensure_future(backend.acall([req('stuck')], GREEDY))
            for _ in range(2000):  # until the stream has started on the engine's loop
                if engine.requests:
                    break
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(go())
        for _ in range(500):
            if engine.aborted:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert engine.aborted == [engine.requests[0]['request_id']]


def test_each_request_of_async_calls_gets_its_own_seed(tiny):
    engine = FakeAsyncLLM(*tiny)
    with _backend(engine) as backend:
        config = RequestConfig(temperature=1.0, max_tokens=2, seed=7)

        async def go():
            return await asyncio.gather(*(backend.acall([req(f'g{i}')], config) for i in range(3)))

        asyncio.run(go())
        seeds = {q['request_id'].split('-')[1]: q['params'].seed for q in engine.requests}
        assert seeds == {f'g{i}': sampling_seed(7, req(f'g{i}')) for i in range(3)}
        assert len(set(seeds.values())) == 3, 'a GRPO group does not sample identically'


def test_async_engine_options_are_checked(tiny):
    with pytest.raises(BackendError, match='token prompts only'):
        VLLMBackend(FakeAsyncLLM(*tiny), sampling_params_cls=SamplingParams, prompt_mode='chat')
    with pytest.raises(BackendError, match='needs an AsyncLLM'):
        VLLMBackend(FakeLLM(*tiny), sampling_params_cls=SamplingParams, engine='async')
    with pytest.raises(BackendError, match="engine must be"):
        VLLMBackend(FakeLLM(*tiny), sampling_params_cls=SamplingParams, engine='fast')
    backend = _backend(FakeAsyncLLM(*tiny))
    backend.close()
    with pytest.raises(BackendError, match='after close'):
        backend([req('a')], GREEDY)
    sync = _backend(FakeLLM(*tiny))
    assert not sync.native_async and not sync.is_async


def test_closing_an_async_engine_cancels_its_output_handler_first_then_shuts_it_down_once():
    """What ``close()`` does to an ``AsyncLLM`` it built (issue 29's clean exit), on a stand-in
    with AsyncLLM's shutdown shape: the output-handler task is cancelled and awaited on the
    engine's loop before the engine stops (vLLM logged ``EngineDeadError`` from it, and asyncio
    "Task was destroyed but it is pending!"), shutdown gets a timeout long enough for the worker to
    exit (vLLM's 5 s default killed it and leaked a shared-memory block), and the engine's own
    ``__del__`` -> ``shutdown()`` is a no-op afterwards."""
    from mtflow.backends.loop_thread import LoopThread
    from mtflow.backends.vllm_engine import SHUTDOWN_TIMEOUT_S, _shutdown_async_engine

    events = []

    class Engine:

        def __init__(self):
            async def handler():
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    events.append('handler cancelled')
                    raise

            self.output_handler = asyncio.get_running_loop().create_task(handler())

        def shutdown(self, timeout=None):
            events.append(('shutdown', timeout, self.output_handler))

    runner = LoopThread('test-shutdown')
    try:
        async def build():
            engine = Engine()
            await asyncio.sleep(0)
            return engine

        engine = runner.run(build())
        runner.run(_shutdown_async_engine(engine, SHUTDOWN_TIMEOUT_S))
    finally:
        runner.stop()
    assert events == ['handler cancelled', ('shutdown', SHUTDOWN_TIMEOUT_S, None)]
    assert SHUTDOWN_TIMEOUT_S >= 30
    engine.shutdown()  # what AsyncLLM.__del__ does at interpreter exit
    assert len(events) == 2, 'the second shutdown does nothing'


def test_the_async_engine_fails_only_the_requests_with_images(tiny):
    """The async engine shows no images: a request that has one fails alone, named, and the call's
    other requests stream as they would without it."""
    from PIL import Image

    requests = _requests()
    requests[1].images = [Image.new('RGB', (8, 8))]
    with _backend(FakeAsyncLLM(*tiny)) as backend:
        got = backend(requests, GREEDY)
    with _backend(FakeAsyncLLM(*tiny)) as backend:
        alone = backend([requests[0], requests[2]], GREEDY)
    assert isinstance(got[1], BackendError) and "request 'b' has 1 image(s)" in str(got[1])
    assert "vllm's async engine" in str(got[1])
    assert [_c(o).token_ids for o in (got[0], got[2])] == [_c(o).token_ids for o in alone]
