"""The OpenAI-compatible backend in async mode: single-request calls awaited from the caller's
event loop run concurrently on the backend's own loop, against the local test server."""
import asyncio

import pytest

pytest.importorskip('httpx')
torch = pytest.importorskip('torch')
pytest.importorskip('transformers')

from mtflow import RequestConfig  # noqa: E402
from mtflow.core.seeds import sampling_seed  # noqa: E402
from mtflow.backends.hf import HFBackend  # noqa: E402
from mtflow.backends.openai_server import OpenAIBackend  # noqa: E402
from tests.backends.chat_server import ChatServer  # noqa: E402
from tests.helpers import req  # noqa: E402
from tests.tiny_model import make_model, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.hf
CONFIG = RequestConfig(temperature=0, max_tokens=6, logprobs=True)


@pytest.fixture(scope='module')
def hf():
    tok = make_tokenizer()
    return HFBackend(make_model(tok, seed=3), tok)


def _c(o):
    return o.response.choices[0]


def test_single_request_calls_are_concurrent_http_requests(hf):
    requests = [req(f'r{i}', {'role': 'user', 'content': f'guess {i}'}) for i in range(6)]
    with ChatServer(hf) as server:
        server.delay = 1.0  # every request stays in flight long enough for the others to arrive
        with OpenAIBackend(base_url=server.base_url, backoff=0.01) as client:
            rollout_fn = client.async_rollout_fn()
            assert rollout_fn == client.acall

            async def go():
                return await asyncio.wait_for(asyncio.gather(*(rollout_fn([r], CONFIG) for r in requests)), 120)

            got = asyncio.run(go())
            assert server.max_in_flight == 6, 'all six were served at once'
            assert sum(1 for b in server.bodies if b.get('messages')) == 6
            assert client.stats.calls == 6 and client.stats.requests == 6
            again = asyncio.run(go())  # another event loop: the client lives on its own
    want = hf(requests, CONFIG)
    for g, a, w in zip(got, again, want):
        assert _c(g[0]).token_ids == _c(w).token_ids == _c(a[0]).token_ids


def test_async_calls_send_each_request_its_own_seed(hf):
    with ChatServer(hf) as server, OpenAIBackend(base_url=server.base_url, backoff=0.01) as client:

        async def go():
            return await asyncio.gather(*(client.acall([req(f'g{i}')], RequestConfig(max_tokens=2, seed=5))
                                          for i in range(3)))

        asyncio.run(go())
        seeds = sorted(b['seed'] for b in server.bodies)
    assert seeds == sorted(sampling_seed(5, req(f'g{i}')) for i in range(3)) and len(set(seeds)) == 3
