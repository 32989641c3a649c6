"""The OpenAI-compatible backend against a real HTTP server on 127.0.0.1 that generates with a
real tiny model (``chat_server.py``): same outputs as the model called directly, continuation
through ``continue_final_message``, the connection limit, retries with backoff, timeouts."""
import pytest

pytest.importorskip('httpx')
torch = pytest.importorskip('torch')
pytest.importorskip('transformers')

from mtflow import Executor, RequestConfig, RolloutInferRequest, Scheduler  # noqa: E402
from mtflow.backends import BackendError, make_backend  # noqa: E402
from mtflow.backends.base import sampling_options  # noqa: E402
from mtflow.core.seeds import sampling_seed  # noqa: E402
from mtflow.backends.hf import HFBackend  # noqa: E402
from mtflow.backends.openai_server import OpenAIBackend, build_body, parse_choice  # noqa: E402
from tests.backends.chat_server import ChatServer  # noqa: E402
from tests.tiny_model import make_model, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.hf
CONFIG = dict(temperature=0, max_tokens=8, logprobs=True)


@pytest.fixture(scope='module')
def hf():
    tok = make_tokenizer()
    return HFBackend(make_model(tok, seed=3), tok)


@pytest.fixture
def server(hf):
    with ChatServer(hf) as s:
        yield s


def _client(server, **kw):
    kw.setdefault('backoff', 0.01)
    return OpenAIBackend(base_url=server.base_url, **kw)


def _req(uuid, *messages, **kw):
    messages = messages or ({'role': 'user', 'content': f'guess a number {uuid}'}, )
    return RolloutInferRequest(messages=[dict(m) for m in messages], uuid=uuid, **kw)


def _c(out):
    return out.response.choices[0]


def test_outputs_match_the_model_called_directly(server, hf):
    requests = [_req('a'), _req('b'), _req('c')]
    with _client(server) as client:
        got = client(requests, RequestConfig(**CONFIG))
        assert client.served_model == 'tiny-qwen2', 'the model name came from GET /v1/models'
    want = hf(requests, RequestConfig(**CONFIG))
    for g, w in zip(got, want):
        assert _c(g).message.content == _c(w).message.content
        assert _c(g).token_ids == _c(w).token_ids and len(_c(g).token_ids) == 8
        assert _c(g).finish_reason == 'length'
        assert [i['logprob'] for i in _c(g).logprobs['content']] == pytest.approx(
            [i['logprob'] for i in _c(w).logprobs['content']], abs=1e-5)
        assert g.response.usage.completion_tokens == 8
        assert g.response.prompt_token_ids == w.response.prompt_token_ids
    body = server.bodies[0]
    assert body['return_token_ids'] is True and body['logprobs'] is True and body['max_tokens'] == 8
    assert 'continue_final_message' not in body


def test_continuation_goes_through_continue_final_message(server, hf):
    history = ({'role': 'user', 'content': 'guess'}, {'role': 'assistant', 'content': 'I guess'})
    with _client(server) as client:
        got = client([_req('c', *history)], RequestConfig(**CONFIG))[0]
    want = hf([_req('c', *history)], RequestConfig(**CONFIG))[0]
    assert _c(got).token_ids == _c(want).token_ids
    assert server.bodies[-1]['continue_final_message'] is True
    assert server.bodies[-1]['add_generation_prompt'] is False
    assert server.bodies[-1]['messages'][-1] == {'role': 'assistant', 'content': 'I guess'}


def test_placeholder_assistant_is_not_sent(server):
    with _client(server) as client:
        client([_req('p', {'role': 'user', 'content': 'q'}, {'role': 'assistant', 'content': None})],
               RequestConfig(**CONFIG))
    assert server.bodies[-1]['messages'] == [{'role': 'user', 'content': 'q'}]
    assert 'continue_final_message' not in server.bodies[-1]


class _TwoTurns(Scheduler):

    def check_finished(self, infer_request, response_choice, current_turn):
        return False

    def step(self, infer_request, response_choice, current_turn):
        if current_turn == 1:
            infer_request.messages.append({'role': 'user', 'content': 'lower'})
        else:
            infer_request.messages[-1]['content'] += ' and'
        ids = response_choice.token_ids
        return {'infer_request': infer_request, 'response_token_ids': ids, 'response_loss_mask': [1] * len(ids)}


def test_multi_turn_rollout_through_the_server(server):
    with _client(server, model='tiny-qwen2') as client:
        result = Executor(_TwoTurns(), client, RequestConfig(temperature=1.0, max_tokens=4, logprobs=True, seed=0),
                          max_turns=3).run([_req('a'), _req('b')])
    assert result.ok and result.finish_reasons == ['max_turns', 'max_turns']
    for out in result.outputs:
        # turn 3 continues turn 2's message, so its ids extend that segment (the contract)
        assert [len(s) for s in out.response_token_ids] == [4, 8]
        assert [len(s) for s in out.rollout_logprobs] == [4, 8]
    assert [b.get('continue_final_message', False) for b in server.bodies] == [False, False, False, False, True, True]
    first = [sampling_seed(0, _req(uuid)) for uuid in 'ab']  # each request of a call: a seed of its own
    assert sorted(b['seed'] for b in server.bodies[:2]) == sorted(first) and first[0] != first[1]
    assert result.trace.path('b').endswith('tool_step -> continuing -> finished(max_turns)')


def test_the_connection_limit_holds(server):
    server.delay = 0.2
    with _client(server, max_connections=2) as client:
        client([_req(str(i)) for i in range(6)], RequestConfig(**CONFIG))
    assert server.max_in_flight == 2


def test_requests_run_concurrently(server):
    server.delay = 0.2
    with _client(server, max_connections=16) as client:
        client([_req(str(i)) for i in range(6)], RequestConfig(**CONFIG))
    assert server.max_in_flight >= 3, 'the requests of one call overlap on the server'


def test_429_and_5xx_are_retried(server):
    server.fail_next = [503, 429, 500]
    with _client(server) as client:
        out = client([_req('a')], RequestConfig(**CONFIG))[0]
        assert client.retries == 3
    assert len(_c(out).token_ids) == 8
    assert len(server.bodies) == 4


def test_retry_after_is_honoured_and_retries_run_out(server):
    server.fail_next = [503] * 5
    server.retry_after = '0'
    with _client(server, max_retries=2) as client:
        with pytest.raises(BackendError, match=r"request 'a'.*failed after 3 attempt\(s\): HTTP 503: injected 503"):
            client([_req('a')], RequestConfig(**CONFIG))
    assert len(server.bodies) == 3


def test_client_errors_are_not_retried(server):
    server.fail_next = [400]
    with _client(server) as client:
        with pytest.raises(BackendError, match=r"request 'a'.*answered HTTP 400: injected 400"):
            client([_req('a')], RequestConfig(**CONFIG))
        assert client.retries == 0


def test_an_unknown_model_is_a_clear_error(server):
    with _client(server, model='gpt-9') as client:
        with pytest.raises(BackendError, match=r"HTTP 404: model 'gpt-9' does not exist"):
            client([_req('a')], RequestConfig(**CONFIG))


def test_timeouts_are_retried_then_reported(server):
    server.delay = 1.0
    with _client(server, timeout=0.2, max_retries=1) as client:
        with pytest.raises(BackendError, match=r'failed after 2 attempt\(s\): timed out after 0.2 s'):
            client([_req('a')], RequestConfig(**CONFIG))


def test_a_server_that_is_down(hf):
    with ChatServer(hf) as s:
        url = s.base_url
    client = OpenAIBackend(base_url=url, model='m', max_retries=1, backoff=0.01)
    with pytest.raises(BackendError, match=r'failed after 2 attempt\(s\): Connect'):
        client([_req('a')], RequestConfig(**CONFIG))
    client.close()
    client.close()


def test_flavors_send_what_their_server_understands():
    options = sampling_options(RequestConfig(max_tokens=5, top_k=20, min_p=0.1, temperature=0.5, stop=['x'], seed=1), 8)
    cont = _req('r', {'role': 'user', 'content': 'q'}, {'role': 'assistant', 'content': 'a'},
                tools=[{'type': 'function', 'function': {'name': 'f'}}])
    vllm = build_body(cont, options, 'm', 'vllm')
    assert vllm['top_k'] == 20 and vllm['min_p'] == 0.1 and vllm['return_token_ids'] is True
    assert vllm['continue_final_message'] is True and vllm['add_generation_prompt'] is False
    assert vllm['tools'][0]['function']['name'] == 'f' and vllm['stop'] == ['x'] and vllm['seed'] == 1
    swift = build_body(_req('r'), options, 'm', 'swift')
    assert swift['return_details'] is True and 'return_token_ids' not in swift and 'min_p' not in swift
    assert build_body(_req('r'), options, 'm', 'vllm', seed=4)['seed'] == 4, "the request's own seed"
    plain = build_body(_req('r'), options, 'm', 'openai', extra_body={'user': 'me'})
    assert not {'top_k', 'min_p', 'return_token_ids', 'return_details'} & set(plain) and plain['user'] == 'me'
    with pytest.raises(BackendError, match="flavor 'openai'"):
        build_body(cont, options, 'm', 'openai')


def test_token_ids_from_token_id_logprob_strings():
    data = {'choices': [{'message': {'content': 'hi'}, 'finish_reason': 'tool_calls',
                         'logprobs': {'content': [{'token': 'token_id:5', 'logprob': -1.0},
                                                  {'token': 'token_id:9', 'logprob': -2.0}]}}]}
    choice = _c(parse_choice(data, 'request x'))
    assert choice.token_ids == [5, 9] and choice.finish_reason == 'stop'
    with pytest.raises(BackendError, match='request x: the server answered without choices'):
        parse_choice({'error': 'nope'}, 'request x')


def test_make_backend_builds_it_by_name(server):
    backend = make_backend('openai', model='tiny-qwen2', base_url=server.base_url, max_connections=4)
    try:
        assert isinstance(backend, OpenAIBackend) and backend.max_connections == 4
    finally:
        backend.close()
    with pytest.raises(BackendError, match='flavor must be one of'):
        make_backend('openai', flavor='tgi')


def test_an_unknown_http_client_is_named_at_construction():
    with pytest.raises(BackendError, match="http_client must be auto, httpx or aiohttp, not 'curl'"):
        OpenAIBackend(model='m', base_url='http://127.0.0.1:9/v1', http_client='curl')
