"""Token-by-token streaming through the gateway, in every wire format: the first chunk reaches the
client while the backend is still generating (the backend waits, mid-reply, on an event the
test sets only after that chunk arrived), the streamed text equals the text a non-streaming call
gets, the reasoning goes out as reasoning, and what could still turn out to be a tool call or a
think tag is held back until it is known."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import anthropic
import httpx
import pytest

from mtflow import RequestConfig
from mtflow.gateway import Gateway
from mtflow.declarative.parsers import get_parser
from mtflow.gateway.streaming import Pump, SafeText, call_starts, safe_text
from mtflow.gateway.thinking import Thinking
from mtflow.gateway.wire import Call, Reply, split_calls
from tests.gateway.helpers import ADD_TOOL, CALLS_ADD, TIMEOUT_S, assert_tokens_exact, lines, scripted

openai = pytest.importorskip('openai')

REPLY = '<think>Two and three.</think>The sum of two and three is five, as counted.'


class Held:
    """A scripted model that streams its first piece, then waits for ``go`` before the rest: a
    turn whose last token cannot be generated before the test says so."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.backend = scripted(REPLY)
        self.waited = []
        stream = self.backend.stream_text

        def held(request, text, tokens, sink):
            cut = len('<think>Two')
            sink(text[:cut])
            self.waited.append(self.go.wait(TIMEOUT_S))  # the last token waits for the test
            stream(request, text, tokens, lambda grown: len(grown) > cut and sink(grown))  # on from the cut

        self.backend.stream_text = held


def _chat(client: openai.OpenAI, held: Held) -> tuple:
    chunks = client.chat.completions.create(model='m', messages=[{'role': 'user', 'content': 'Add.'}], stream=True)
    reasoning, content = [], []
    for chunk in chunks:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        piece = getattr(delta, 'reasoning_content', None) or (delta.model_extra or {}).get('reasoning_content')
        if piece or delta.content:
            if not held.go.is_set():
                assert not held.waited  # the backend has not generated the rest: this chunk came first
                held.go.set()
            reasoning.append(piece or '')
            content.append(delta.content or '')
    return ''.join(reasoning), ''.join(content)


def _messages(client: anthropic.Anthropic, held: Held) -> tuple:
    reasoning, content = [], []
    with client.messages.stream(model='m', max_tokens=64, messages=[{'role': 'user', 'content': 'Add.'}]) as events:
        for event in events:
            if event.type != 'content_block_delta':
                continue
            if not held.go.is_set():
                assert not held.waited
                held.go.set()
            if event.delta.type == 'thinking_delta':
                reasoning.append(event.delta.thinking)
            elif event.delta.type == 'text_delta':
                content.append(event.delta.text)
    return ''.join(reasoning), ''.join(content)


def _responses(client: openai.OpenAI, held: Held) -> tuple:
    reasoning, content = [], []
    with client.responses.stream(model='m', input='Add.') as events:
        for event in events:
            if event.type not in ('response.reasoning_text.delta', 'response.output_text.delta'):
                continue
            if not held.go.is_set():
                assert not held.waited
                held.go.set()
            (reasoning if event.type == 'response.reasoning_text.delta' else content).append(event.delta)
        final = events.get_final_response()
    assert [o.type for o in final.output] == ['reasoning', 'message']
    return ''.join(reasoning), ''.join(content)


@pytest.mark.parametrize('api', ['chat', 'messages', 'responses'])
def test_the_first_chunk_arrives_before_the_last_token_is_generated(tmp_path, api):
    held = Held()
    with Gateway(held.backend, tmp_path / 'run', request_config=RequestConfig(max_tokens=64)) as gw:
        if api == 'messages':
            client = anthropic.Anthropic(base_url=gw.base_url('s', 'anthropic'), api_key='unused', max_retries=0,
                                         timeout=TIMEOUT_S)
            streamed = _messages(client, held)
        else:
            client = openai.OpenAI(base_url=gw.base_url('s'), api_key='unused', max_retries=0, timeout=TIMEOUT_S)
            streamed = (_chat if api == 'chat' else _responses)(client, held)
        gw.finish('s', reward=1.0)
    assert held.waited == [True]  # the backend was let go by the test, after the first chunk
    assert streamed == ('Two and three.', 'The sum of two and three is five, as counted.')
    assert_tokens_exact(tmp_path / 'run', segments=1)


def test_streamed_text_equals_the_text_a_plain_call_gets(tmp_path):
    """Reasoning, text and a tool call, each API streamed and not: the same reasoning, content and
    calls; the streamed content never showed a piece of the call's markup."""
    reply = '<think>I add.</think>' + CALLS_ADD
    tools = [ADD_TOOL]
    with Gateway(scripted(reply), tmp_path / 'run', request_config=RequestConfig(max_tokens=64)) as gw:
        client = openai.OpenAI(base_url=gw.base_url('plain'), api_key='unused', max_retries=0, timeout=TIMEOUT_S)
        message = client.chat.completions.create(model='m', messages=[{'role': 'user', 'content': 'Add.'}],
                                                 tools=tools).choices[0].message
        client = openai.OpenAI(base_url=gw.base_url('streamed'), api_key='unused', max_retries=0, timeout=TIMEOUT_S)
        chunks = list(client.chat.completions.create(model='m', messages=[{'role': 'user', 'content': 'Add.'}],
                                                     tools=tools, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = ''.join(d.content or '' for d in deltas)
    reasoning = ''.join((d.model_extra or {}).get('reasoning_content') or '' for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert (reasoning, content) == ((message.model_extra or {})['reasoning_content'], message.content)
    assert (reasoning, content) == ('I add.', 'I will add them.')
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert not any('<' in (d.content or '') for d in deltas)


def test_the_hf_backend_streams_token_by_token_and_the_text_is_the_plain_text(tmp_path):
    """A real model (tiny, random) through a streamer: several content chunks, whose text is the
    text the same session gets without streaming (each request samples from its own seed)."""
    pytest.importorskip('torch')
    from mtflow.backends.hf import HFBackend
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    model = make_model(tok, max_position_embeddings=2048)
    messages = [{'role': 'user', 'content': 'Say something.'}]
    texts = []
    for stream in (False, True):
        backend = HFBackend(model, tok, seed=0)
        with Gateway(backend, tmp_path / f'run-{stream}', request_config=RequestConfig(max_tokens=24)) as gw:
            client = openai.OpenAI(base_url=gw.base_url('ep'), api_key='unused', max_retries=0, timeout=TIMEOUT_S)
            if stream:
                chunks = client.chat.completions.create(model='m', messages=messages, stream=True)
                texts.append([c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content])
            else:
                texts.append([client.chat.completions.create(model='m', messages=messages).choices[0].message.content])
            gw.finish('ep')
        assert_tokens_exact(tmp_path / f'run-{stream}', segments=1)
    plain, pieces = texts
    assert ''.join(pieces) == plain[0] and len(pieces) > 2


def _safe(text: str, parser: str = 'hermes', thinking: str = 'think', tools: bool = True) -> tuple:
    return SafeText(Thinking(thinking), ('<tool_call>', ) if parser else None, parser is not None, tools)(text)


def test_what_is_held_back_until_it_is_known():
    assert _safe('Hello <too') == ('', 'Hello')  # a call's start, half written; and the space before it
    assert _safe('Hello <tool_call>\n{"na') == ('', 'Hello')  # a call: everything after waits for the end
    assert _safe('<thi') == ('', '')
    assert _safe('<think>plan</th') == ('plan', '')
    assert _safe('<think>plan</think>So') == ('plan', 'So')
    assert _safe('caf\ufffd') == ('', 'caf')  # the rest of a character is still to come
    assert _safe('Hi', parser=None) == ('', 'Hi')
    assert _safe('<think>a</think>b', thinking='none') == ('', '<think>a</think>b')
    # a parser whose call starts are unknown holds the whole content of a call that offers tools
    assert SafeText(Thinking('think'), None, True, True)('<think>a</think>text') == ('a', '')
    assert SafeText(Thinking('think'), ('<tool_call>', ), True, True, stops=['STOP'])('done STOP more') == ('', 'done')


class _Writer:
    def start(self):
        return [b'start']

    def reasoning(self, delta):
        return [f'r:{delta}'.encode()]

    def content(self, delta):
        return [f'c:{delta}'.encode()]

    def end(self, reply):
        return [b'end']


def test_a_pump_sends_prefixes_of_the_whole_reply_and_says_when_it_could_not():
    pump = Pump(_Writer(), SafeText(Thinking('think'), ('<tool_call>', ), True, True))
    events = pump.update('<think>ab') + pump.update('<think>abc</think>He') + pump.update('<think>abc</think>Hello <t')
    reply = Reply('<think>abc</think>Hello <tool_call>x</tool_call>', 'Hello', [('id', 'add', {})], 'stop', 1, 1, 1,
                  'abc')
    events += pump.finish(reply)
    assert events == [b'start', b'r:ab', b'r:c', b'c:He', b'c:llo', b'end'] and not pump.diverged
    again = Pump(_Writer(), SafeText(Thinking('think'), ('<tool_call>', ), True, True))
    again.update('<think>Two')
    assert again.update('<think>T') == [] and not again.diverged  # a stream started over: nothing new yet
    assert again.update('<think>Two and') == [b'r: and'] and not again.diverged
    other = Pump(_Writer(), SafeText(Thinking('none'), None, False, False))
    other.update('abc')
    assert other.finish(Reply('xyz', 'xyz', [], 'stop', 1, 1, 1)) == [b'end'] and other.diverged


@pytest.mark.parametrize('name', ['hermes', 'qwen3_coder', 'glm45', 'kimi_k2', 'minimax_m2', 'deepseek_v32'])
@pytest.mark.parametrize('head', ['I will add.\n', ''])
def test_each_formats_call_is_held_and_the_text_before_it_streams(name, head):
    """Token by token, a stream of a reply in each tag format sends the text before the call as it
    comes and the same content as the whole reply (no block wrapper left behind), never text it
    has to take back."""
    parser = get_parser(name)
    text = head + parser.render_calls([('add', {'a': 2, 'b': 3})])
    content, calls = split_calls(text, parser, 1, 's', [ADD_TOOL])
    assert content == head.strip() and [(n, a) for _, n, a in calls] == [('add', {'a': 2, 'b': 3})]
    pump, sent = Pump(_Writer(), SafeText(Thinking('none'), call_starts(parser), True, True)), []
    for k in range(1, len(text) + 1):
        sent += pump.update(text[:k])
    assert b''.join(e[2:] for e in sent if e.startswith(b'c:')).decode() == content
    pump.finish(Reply(text, content, calls, 'stop', 1, 1, 1))
    assert not pump.diverged


def test_a_mistral_reply_that_starts_as_a_json_call_is_held_and_other_text_streams():
    parser = get_parser('mistral')
    call = Call(messages=[], tools=[ADD_TOOL], sampling={}, api='openai')
    safe = safe_text(call, Thinking('none'), parser)
    bare = '[{"name": "add", "arguments": {"a": 2, "b": 3}}]'  # the marker skipped with the special tokens
    assert [safe(bare[:k]) for k in (1, 10, len(bare))] == [('', '')] * 3
    assert split_calls(bare, parser, 1, 's')[0] == ''  # what the whole reply gives: nothing sent was wrong
    assert safe('Sure. [1] is a list') == ('', 'Sure. [1] is a list')


def test_a_qwen3_coder_call_without_its_tool_call_tag_is_held_too():
    text = 'I will add.\n<function=add>\n<parameter=a>\n2\n</parameter>\n</function>'
    safe = SafeText(Thinking('none'), call_starts(get_parser('qwen3_coder')), True, True)
    assert safe(text) == ('', 'I will add.') == ('', split_calls(text, get_parser('qwen3_coder'), 1, 's')[0])


def test_think_tags_follow_a_template_that_opens_the_thinking():
    class Tok:
        chat_template = 'x'

        def apply_chat_template(self, messages, **kw):
            return '<|im_start|>assistant\n<think>\n'

    thinking = Thinking('auto', tokenizer=Tok())
    assert thinking.split('plan</think>answer') == ('plan', 'answer')
    assert thinking.split('still thinking') == ('still thinking', '')
    assert thinking.split('still thinking', continued=True) == ('', 'still thinking')
    assert Thinking('auto').split('plain text') == ('', 'plain text')
    with pytest.raises(ValueError, match='gateway.reasoning'):
        Thinking('deepseek')


def _streamed(gw: Gateway, session: str, on_first=None) -> list:
    """The content pieces of one streaming chat call (``on_first`` called at the first)."""
    client = openai.OpenAI(base_url=gw.base_url(session), api_key='unused', max_retries=0, timeout=TIMEOUT_S)
    pieces = []
    for chunk in client.chat.completions.create(model='m', messages=[{'role': 'user', 'content': 'guess a word'}],
                                                stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            if not pieces and on_first is not None:
                on_first()
            pieces.append(chunk.choices[0].delta.content)
    gw.finish(session)
    return pieces


def _answered(run_dir) -> str:
    """The model's whole answer, as the trajectory keeps it (what a plain call returns here)."""
    [line] = lines(run_dir)
    return line['messages'][-1]['content']


def test_vllms_async_engine_streams_through_the_gateway(tmp_path):
    """The vLLM backend's async engine (a stand-in with AsyncLLM's signatures generating with a tiny
    model, one cumulative output per token): content reaches the client while the last token is
    held back in the engine."""
    pytest.importorskip('torch')
    from mtflow.backends.vllm_engine import VLLMBackend
    from tests.backends.fake_vllm import FakeAsyncLLM, SamplingParams
    from tests.tiny_model import make_tokenizer

    import torch

    from tests.backends.chat_server import ToyLM

    tok = make_tokenizer()
    toy = ToyLM(tok)

    def words(input_ids):  # a "model" whose next token is ToyLM's: whole words (a tiny random one writes newlines)
        logits = torch.zeros((1, input_ids.shape[1], len(tok)))
        logits[0, -1, toy.step(input_ids[0].tolist())[0]] = 10.0
        return SimpleNamespace(logits=logits)

    gate = threading.Event()
    firsts = []
    engine = FakeAsyncLLM(words, tok, hold={'held': gate})
    with VLLMBackend(engine, sampling_params_cls=SamplingParams) as backend, \
            Gateway(backend, tmp_path / 'run', request_config=RequestConfig(max_tokens=12)) as gw:
        streamed = _streamed(gw, 'held', lambda: (firsts.append(list(engine.finished_order)), gate.set()))
    assert firsts == [[]]  # the stream had not finished when the first chunk reached the client
    assert ''.join(streamed) == _answered(tmp_path / 'run') and len(streamed) > 1
    assert_tokens_exact(tmp_path / 'run', segments=1)


def test_an_openai_compatible_server_streams_through_the_gateway(tmp_path):
    """mtflow's openai backend in front of a streaming server (token prompts, exact ids): the
    gateway's streaming call makes it stream, and hands each piece on as it comes."""
    pytest.importorskip('torch')
    from mtflow.backends.openai_server import OpenAIBackend
    from tests.backends.chat_server import ChatServer, ToyLM
    from tests.tiny_model import make_tokenizer

    tok = make_tokenizer()
    with ChatServer(None, lm=ToyLM(tok)) as server:
        server.stream_delay = 0.01
        with OpenAIBackend('tiny-qwen2', server.base_url, tokenizer=tok, backoff=0.01) as backend, \
                Gateway(backend, tmp_path / 'run', request_config=RequestConfig(max_tokens=10)) as gw:
            streamed = _streamed(gw, 'streamed')
        streams = list(server.streams)
    assert len(streams) == 1 and streams[0]['outcome'] == 'finished'
    assert ''.join(streamed) == _answered(tmp_path / 'run') and len(streamed) > 2
    assert_tokens_exact(tmp_path / 'run', segments=1)
