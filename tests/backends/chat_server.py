"""A real OpenAI-compatible chat completions server for tests: stdlib ``http.server`` on
127.0.0.1 (a free port), generating with a real (tiny) transformers model through the HF backend.

It speaks the subset of vLLM's ``/v1/chat/completions`` that mtflow's OpenAI backend uses:
sampling fields, ``tools``, ``logprobs``/``top_logprobs``, ``return_token_ids`` and
``continue_final_message``/``add_generation_prompt`` (a request whose last message is an
assistant message without ``continue_final_message`` is rejected with 400, so the test sees the
client send it). For the retry and concurrency tests it can answer the next requests with given
error statuses (``fail_next``), wait before generating (``delay``), and counts the requests in
flight.

``/v1/completions`` takes token prompts as vLLM's server does (``"prompt": [ids]``, or a string
that it tokenizes) and generates from those ids as they are; with ``return_token_ids`` its
choice carries ``prompt_token_ids`` and ``token_ids``, and logprobs come in the completions
shape (``tokens``, ``token_logprobs``, ``top_logprobs``). ``token_prompts=False`` makes it a
server that rejects token prompts (400), like servers that only accept text.

**Several replicas** (the routing tests): ``prefix_cache=True`` gives the server a simulated
prefix cache, token-level like sglang's radix cache (``cache_block=16`` for vLLM's blocks): it
keeps each served sequence (prompt + completion ids), LRU up to ``cache_tokens``, and reports the
longest cached prefix of each prompt as ``usage.prompt_tokens_details.cached_tokens`` (at most
the prompt less one token, as vLLM). ``kill()`` makes it a crashed server: the listening socket
closes and every open connection, also one in the middle of a request, is dropped without an
answer. Servers given one ``lock`` share one model without generating at once.

With the simulated cache, ``GET /metrics`` (at the server's root, as vLLM's) exports vLLM v1's
counters in Prometheus text format: ``vllm:prefix_cache_queries_total`` (prompt tokens looked up)
and ``vllm:prefix_cache_hits_total`` (the ones found), labelled ``engine`` and ``model_name``;
``report_cached=False`` leaves ``prompt_tokens_details`` out of the replies (vLLM without
``--enable-prompt-tokens-details``), so only the counters tell the hit rate.

**Structured tool calls** (``tool_call_parser='hermes'``, as ``vllm serve --enable-auto-tool-choice
--tool-call-parser hermes``): a chat reply's ``<tool_call>{json}</tool_call>`` blocks are taken out
of ``content`` (``null`` when nothing else is left) and returned as OpenAI ``tool_calls`` (``id``
``chatcmpl-tool-<n>``, ``arguments`` a JSON string), with ``finish_reason: "tool_calls"``; the
reply's ``token_ids`` stay all the ids the model sampled, calls included, as vLLM's do.
``keep_call_text=True`` leaves the blocks in ``content`` too (a server that returns both).

**Reasoning split by the server** (``reasoning_field='reasoning'``, as ``vllm serve --reasoning-parser
qwen3`` answers since vLLM 0.11; ``'reasoning_content'`` as older vLLM and SGLang): the text
before ``</think>`` (a leading ``<think>`` dropped) is the message's reasoning field, ``content``
what follows, before the tool-call parser reads it; a reply without ``</think>`` is all content.

**Context and tokenizer endpoints** (as vLLM's): ``GET /v1/models`` lists ``max_model_len`` (the
model's ``max_position_embeddings``, or ``max_model_len=``); ``POST /tokenize`` (at the server's
root) renders ``messages`` through the tokenizer's chat template (``tools``,
``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``) or takes a
``prompt``, and answers ``count``, ``max_model_len`` and ``tokens``; ``POST /detokenize`` answers
``prompt`` for ``tokens``. ``tokenize=False``: a server without them (404).

**Streaming** (the resumable-generation tests): given ``lm`` (a :class:`ToyLM`, a deterministic
autoregressive model whose next token is a function of the context ids), a request with
``"stream": true`` is answered as vLLM's server does, in SSE chunks (``Transfer-Encoding:
chunked``), one token each, ``stream_delay`` seconds apart: the delta text, ``token_ids`` (with
``return_token_ids``; ``prompt_token_ids`` in the first chunk), logprobs in the endpoint's shape,
a usage chunk (``stream_options.include_usage``) and ``data: [DONE]``. Chat requests are rendered
with the tokenizer's chat template (``continue_final_message``/``add_generation_prompt``
honoured), token prompts are taken as they are. Each stream is logged in ``streams``
(``planned`` and ``sent`` tokens, ``outcome``: ``finished``, ``aborted`` when the client
disconnected before the end, which the server notices at its next write and stops generating,
as vLLM aborts, or ``error``/``dropped`` for the ones ``break_streams`` breaks: ``(k, 'error')``
sends an error event after ``k`` tokens, ``(k, 'drop')`` closes the connection there). Without
``lm`` the server ignores ``stream`` and answers one JSON body (a server that does not stream).
"""
from __future__ import annotations

import json
import re
import socket
import struct
import threading
import time
import zlib
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional

from mtflow import RequestConfig, RolloutInferRequest
from mtflow.backends.base import sampling_options
from mtflow.core.images import from_content_parts


class ChatServer:

    def __init__(self, backend: Any, model_name: str = 'tiny-qwen2', token_prompts: bool = True, *,
                 prefix_cache: bool = False, cache_tokens: Optional[int] = None, cache_block: int = 1,
                 lock: Optional[Any] = None, report_cached: bool = True, lm: Optional['ToyLM'] = None,
                 tool_call_parser: Optional[str] = None, keep_call_text: bool = False,
                 reasoning_field: Optional[str] = None, max_model_len: Optional[int] = None,
                 tokenize: bool = True) -> None:
        if tool_call_parser not in (None, 'hermes'):
            raise ValueError(f'the test server parses hermes tool calls only, not {tool_call_parser!r}')
        self.backend = backend
        self.reasoning_field = reasoning_field
        self.max_model_len = max_model_len if max_model_len is not None else getattr(backend, 'context_length', None)
        self.tokenize_endpoints = tokenize
        self.tokenize_bodies: List[Dict[str, Any]] = []  # what /tokenize and /detokenize were asked
        self.tool_call_parser, self.keep_call_text = tool_call_parser, keep_call_text
        self.tool_call_count = 0
        self.lm = lm
        self.stream_delay = 0.0
        self.break_streams: List[tuple] = []
        self.streams: List[Dict[str, Any]] = []
        self.prefix_cache = prefix_cache
        self.report_cached = report_cached
        self.cache_tokens, self.cache_block = cache_tokens, cache_block
        self.cache: 'OrderedDict[tuple, None]' = OrderedDict()
        self.cached_total = self.prompt_total = 0
        self.dead = False
        self.closed = threading.Event()
        self.token_prompts = token_prompts
        self.model_name = model_name
        self.fail_next: List[int] = []
        self.retry_after: Optional[str] = None
        self.delay = 0.0
        self.bodies: List[Dict[str, Any]] = []
        self.images: List[List[str]] = []  # the image URLs of each chat request that had some
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = lock or threading.Lock()  # one generate at a time (torch on CPU)
        self._count_lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = 'HTTP/1.1'

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def handle(self) -> None:
                try:
                    super().handle()
                except (ConnectionResetError, BrokenPipeError):  # a client that went away (a cut stream)
                    self.close_connection = True

            def _reply(self, status: int, payload: Dict[str, Any], headers: Optional[Dict[str, str]] = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header('Content-Type', 'application/json')
                self.send_header('Content-Length', str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _drop(self) -> None:
                """A crashed server: the connection closes without an answer."""
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def do_GET(self) -> None:
                if server.dead:
                    self._drop()
                    return
                if self.path == '/v1/models':
                    card = {'id': server.model_name, 'object': 'model'}
                    if server.max_model_len is not None:
                        card['max_model_len'] = server.max_model_len
                    self._reply(200, {'object': 'list', 'data': [card]})
                elif self.path == '/metrics' and server.prefix_cache:
                    data = server.metrics_text().encode()
                    self.send_response(200)
                    self.send_header('Content-Type', 'text/plain; version=0.0.4; charset=utf-8')
                    self.send_header('Content-Length', str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self._reply(404, {'error': {'message': f'no route {self.path}'}})

            def do_POST(self) -> None:
                length = int(self.headers.get('Content-Length') or 0)
                body = json.loads(self.rfile.read(length) or b'{}')
                if server.dead:
                    self._drop()
                    return
                if self.path in ('/tokenize', '/detokenize') and server.tokenize_endpoints:
                    server.tokenize_bodies.append(body)
                    self._reply(*server.tokenize(body, self.path == '/detokenize'))
                    return
                if self.path not in ('/v1/chat/completions', '/v1/completions'):
                    self._reply(404, {'error': {'message': f'no route {self.path}'}})
                    return
                with server._count_lock:
                    server.bodies.append(body)
                    status = server.fail_next.pop(0) if server.fail_next else None
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    if status is not None:
                        headers = {'Retry-After': server.retry_after} if server.retry_after else None
                        self._reply(status, {'error': {'message': f'injected {status}'}}, headers)
                        return
                    if server.delay:
                        server.closed.wait(server.delay)  # a closed server stops waiting at once
                    if server.closed.is_set():  # and generates nothing more (no torch at exit)
                        self._drop()
                        return
                    if body.get('stream') and server.lm is not None:
                        server.stream(self, body, self.path == '/v1/chat/completions')
                        return
                    if self.path == '/v1/completions':
                        status, payload = server.complete_text(body)
                    else:
                        status, payload = server.complete(body)
                    if server.dead:  # killed while generating: the answer is lost
                        self._drop()
                        return
                    self._reply(status, payload)
                finally:
                    with server._count_lock:
                        server.in_flight -= 1

        self.httpd = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.base_url = f'http://127.0.0.1:{self.port}/v1'
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def stream(self, handler: Any, body: Dict[str, Any], chat: bool) -> None:
        """Answer ``body`` as an SSE stream of the toy model's tokens (see the module docstring)."""
        status, prompt = self._lm_prompt(body, chat)
        if status != 200:
            handler._reply(status, prompt)
            return
        tokens, finish = self.lm.generate(prompt, int(body.get('max_tokens') or 16))
        entry: Dict[str, Any] = {'planned': len(tokens), 'sent': 0, 'outcome': None, 'prompt_len': len(prompt)}
        with self._count_lock:
            self.streams.append(entry)
            broken = self.break_streams.pop(0) if self.break_streams else None
        handler.send_response(200)
        handler.send_header('Content-Type', 'text/event-stream')
        handler.send_header('Transfer-Encoding', 'chunked')
        handler.end_headers()

        def send(event: Any) -> None:
            data = b'data: ' + (event if isinstance(event, bytes) else json.dumps(event).encode()) + b'\n\n'
            handler.wfile.write(b'%x\r\n%s\r\n' % (len(data), data))

        ids_too, want_lp = bool(body.get('return_token_ids')), (body.get('logprobs') is not None and body.get('logprobs') is not False)
        try:
            if chat:
                send(self._chunk(chat, {'delta': {'role': 'assistant', 'content': ''}, 'finish_reason': None},
                                 prompt if ids_too else None))
            for k, (tid, lp) in enumerate(tokens):
                if broken is not None and k == broken[0]:
                    if broken[1] == 'error':
                        send({'error': {'message': 'injected mid-stream failure', 'type': 'InternalServerError',
                                        'code': 500}})
                        handler.wfile.write(b'0\r\n\r\n')
                    else:
                        handler._drop()
                    entry['outcome'] = 'error' if broken[1] == 'error' else 'dropped'
                    return
                if self.stream_delay:
                    self.closed.wait(self.stream_delay)
                if self.closed.is_set():
                    handler._drop()
                    entry['outcome'] = 'dropped'
                    return
                text = self.lm.text(tid)
                raw: Dict[str, Any] = {'finish_reason': finish if k == len(tokens) - 1 else None}
                if chat:
                    raw['delta'] = {'content': text}
                    raw['logprobs'] = {'content': [{'token': text, 'logprob': lp, 'bytes': list(text.encode()),
                                                    'top_logprobs': []}]} if want_lp else None
                else:
                    raw['text'] = text
                    raw['logprobs'] = {'tokens': [text], 'token_logprobs': [lp], 'top_logprobs': [None],
                                       'text_offset': [0]} if want_lp else None
                if ids_too:
                    raw['token_ids'] = [tid]
                send(self._chunk(chat, raw, prompt if (ids_too and not chat and k == 0) else None))
                entry['sent'] = k + 1
            if (body.get('stream_options') or {}).get('include_usage'):
                n = len(tokens)
                send({'id': 'stream-test', 'object': 'chat.completion.chunk' if chat else 'text_completion',
                      'model': self.model_name, 'choices': [],
                      'usage': {'prompt_tokens': len(prompt), 'completion_tokens': n, 'total_tokens': len(prompt) + n}})
            send(b'[DONE]')
            handler.wfile.write(b'0\r\n\r\n')
            entry['outcome'] = 'finished'
        except OSError:  # the client went away (a cancelled call): stop generating, as vLLM aborts
            entry['outcome'] = 'aborted' if entry['sent'] < len(tokens) else 'finished'  # it had every token
            handler.close_connection = True

    def _chunk(self, chat: bool, raw: Dict[str, Any], prompt: Optional[List[int]]) -> Dict[str, Any]:
        chunk: Dict[str, Any] = {'id': 'stream-test', 'object': 'chat.completion.chunk' if chat else 'text_completion',
                                 'created': int(time.time()), 'model': self.model_name,
                                 'choices': [{'index': 0, **raw}]}
        if prompt is not None:
            if chat:
                chunk['prompt_token_ids'] = prompt
            else:
                chunk['choices'][0]['prompt_token_ids'] = prompt
        return chunk

    def _lm_prompt(self, body: Dict[str, Any], chat: bool) -> tuple:
        """The prompt ids of a streamed request: the chat rendered by the template, or the token prompt."""
        if body.get('model') != self.model_name:
            return 404, {'error': {'message': f"model {body.get('model')!r} does not exist"}}
        if not chat:
            prompt = body.get('prompt')
            if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
                return 400, {'error': {'message': 'the streaming test server takes token prompts only'}}
            return 200, list(prompt)
        messages = body.get('messages') or []
        cont = bool(body.get('continue_final_message'))
        if messages and messages[-1].get('role') == 'assistant' and not cont:
            return 400, {'error': {'message': 'last message is an assistant message; set continue_final_message'}}
        if cont and body.get('add_generation_prompt', True):
            return 400, {'error': {'message': 'continue_final_message needs add_generation_prompt=false'}}
        tok = self.lm.tokenizer
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=not cont,
                                       continue_final_message=cont)
        return 200, tok(text, add_special_tokens=False)['input_ids']

    def complete(self, body: Dict[str, Any]) -> tuple:
        messages = body.get('messages') or []
        if body.get('model') != self.model_name:
            return 404, {'error': {'message': f"model {body.get('model')!r} does not exist"}}
        if not messages:
            return 400, {'error': {'message': 'messages is required'}}
        last_is_assistant = messages[-1].get('role') == 'assistant'
        if last_is_assistant and not body.get('continue_final_message'):
            return 400, {'error': {'message': 'last message is an assistant message; set continue_final_message'}}
        if body.get('continue_final_message') and body.get('add_generation_prompt', True):
            return 400, {'error': {'message': 'continue_final_message needs add_generation_prompt=false'}}
        if any(isinstance(m.get('content'), list) for m in messages):
            # image content parts: the tiny model reads text, so each image is kept here (the
            # tests assert what was sent) and the model sees its <image> placeholder as text
            messages, images = from_content_parts(messages)
            self.images.append(images)
        request = RolloutInferRequest(messages=messages, tools=body.get('tools'),
                                      chat_template_kwargs=body.get('chat_template_kwargs') or {})
        config = _request_config(body, logprobs=bool(body.get('logprobs')), top_logprobs=body.get('top_logprobs'))
        with self._lock:
            out = self.backend([request], config)[0]
        choice = out.response.choices[0]
        usage = out.response.usage
        raw_choice: Dict[str, Any] = {
            'index': 0,
            'message': {'role': 'assistant', 'content': choice.message.content},
            'finish_reason': choice.finish_reason,
            'logprobs': choice.logprobs,
        }
        payload: Dict[str, Any] = {
            'id': 'chatcmpl-test',
            'object': 'chat.completion',
            'created': int(time.time()),
            'model': self.model_name,
            'choices': [raw_choice],
            'usage': {'prompt_tokens': usage.prompt_tokens, 'completion_tokens': usage.completion_tokens,
                      'total_tokens': usage.total_tokens},
        }
        if self.reasoning_field is not None:
            self._split_reasoning(raw_choice['message'])
        if self.tool_call_parser is not None:
            self._structure_calls(raw_choice)
        if body.get('return_token_ids'):
            raw_choice['token_ids'] = choice.token_ids
            payload['prompt_token_ids'] = out.response.prompt_token_ids
        self._note_cache(out.response.prompt_token_ids or [], choice.token_ids or [], payload['usage'])
        return 200, payload

    def _split_reasoning(self, message: Dict[str, Any]) -> None:
        """A reasoning parser of a vLLM server (see the module docstring)."""
        text = message.get('content') or ''
        if '</think>' in text:
            thought, _, rest = text.partition('</think>')
            message[self.reasoning_field] = thought[len('<think>'):] if thought.startswith('<think>') else thought
            message['content'] = rest

    def tokenize(self, body: Dict[str, Any], detokenize: bool) -> tuple:
        """``/tokenize`` and ``/detokenize`` as vLLM's server answers them (the module docstring)."""
        if body.get('model') not in (None, self.model_name):
            return 404, {'error': {'message': f"model {body.get('model')!r} does not exist"}}
        tok = getattr(self.backend, 'tokenizer', None)
        if tok is None:
            return 404, {'error': {'message': 'no tokenizer'}}
        if detokenize:
            return 200, {'prompt': tok.decode(body.get('tokens') or [], skip_special_tokens=False)}
        if 'messages' in body:
            try:
                text = tok.apply_chat_template(body['messages'], tools=body.get('tools'), tokenize=False,
                                               add_generation_prompt=body.get('add_generation_prompt', True),
                                               continue_final_message=body.get('continue_final_message', False),
                                               **(body.get('chat_template_kwargs') or {}))
            except Exception as exc:  # vLLM answers a template error with 400
                return 400, {'error': {'message': f'{type(exc).__name__}: {exc}'}}
        else:
            text = body.get('prompt') or ''
        ids = tok(text, add_special_tokens=bool(body.get('add_special_tokens', 'messages' not in body)))['input_ids']
        return 200, {'count': len(ids), 'max_model_len': self.max_model_len, 'tokens': ids}

    def _structure_calls(self, raw_choice: Dict[str, Any]) -> None:
        """The hermes tool-call parser of a vLLM server: the reply's ``<tool_call>`` blocks as
        OpenAI ``tool_calls`` (see the module docstring); a block that is not JSON stays text."""
        message = raw_choice['message']
        text = message.get('content') or ''
        calls, kept = [], []
        for k, piece in enumerate(re.split(r'(<tool_call>.*?</tool_call>)', text, flags=re.DOTALL)):
            block = re.fullmatch(r'<tool_call>(.*?)</tool_call>', piece, flags=re.DOTALL)
            try:
                call = json.loads(block.group(1)) if block else None
            except ValueError:
                call = None
            if not isinstance(call, dict) or 'name' not in call:
                kept.append(piece)
                continue
            with self._count_lock:
                self.tool_call_count += 1
                n = self.tool_call_count
            calls.append({'id': f'chatcmpl-tool-{n}', 'type': 'function',
                          'function': {'name': call['name'], 'arguments': json.dumps(call.get('arguments', {}))}})
            if self.keep_call_text:
                kept.append(piece)
        if calls:
            content = ''.join(kept)
            message['content'] = content if content.strip() else None
            message['tool_calls'] = calls
            raw_choice['finish_reason'] = 'tool_calls'

    def complete_text(self, body: Dict[str, Any]) -> tuple:
        """``/v1/completions``: generate from the prompt's ids as they are."""
        if body.get('model') != self.model_name:
            return 404, {'error': {'message': f"model {body.get('model')!r} does not exist"}}
        prompt = body.get('prompt')
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            if not self.token_prompts:
                return 400, {'error': {'message': 'prompt must be a string'}}
            ids = list(prompt)
        elif isinstance(prompt, str) and prompt:
            ids = self.backend.tokenizer(prompt, add_special_tokens=False)['input_ids']
        else:
            return 400, {'error': {'message': 'prompt must be a non-empty string or list of token ids'}}
        top = body.get('logprobs')
        config = _request_config(body, logprobs=top is not None, top_logprobs=top or None)
        with self._lock:
            skip = getattr(self.backend, 'skip_special_tokens', None)
            if skip is not None:  # vLLM's field: the reply's text with its special tokens or without
                self.backend.skip_special_tokens = body.get('skip_special_tokens', True) is not False
            try:
                out = self.backend.generate_ids([ids], sampling_options(config, 16))[0]
            finally:
                if skip is not None:
                    self.backend.skip_special_tokens = skip
        choice = out.response.choices[0]
        raw: Dict[str, Any] = {'index': 0, 'text': choice.message.content, 'finish_reason': choice.finish_reason,
                               'logprobs': None}
        if choice.logprobs is not None:
            content = choice.logprobs['content']
            raw['logprobs'] = {
                'tokens': [c['token'] for c in content],
                'token_logprobs': [c['logprob'] for c in content],
                'top_logprobs': [{t['token']: t['logprob'] for t in c.get('top_logprobs', [])} or None
                                 for c in content],
                'text_offset': [0] * len(content),
            }
        if body.get('return_token_ids'):
            raw['prompt_token_ids'] = ids
            raw['token_ids'] = choice.token_ids
        n = len(choice.token_ids or ())
        usage = {'prompt_tokens': len(ids), 'completion_tokens': n, 'total_tokens': len(ids) + n}
        self._note_cache(ids, choice.token_ids or [], usage)
        return 200, {'id': 'cmpl-test', 'object': 'text_completion', 'created': int(time.time()),
                     'model': self.model_name, 'choices': [raw], 'usage': usage}

    def _note_cache(self, prompt: List[int], completion: List[int], usage: Dict[str, Any]) -> None:
        """The simulated prefix cache: report the prompt's cached prefix, then keep the sequence."""
        if not self.prefix_cache:
            return
        prompt = list(prompt)
        with self._count_lock:
            best = 0
            for seq in self.cache:
                n = _common_prefix(seq, prompt)
                if n > best:
                    best, hit = n, seq
            if best:
                self.cache.move_to_end(hit)
            cached = min(best, max(len(prompt) - 1, 0)) // self.cache_block * self.cache_block
            if self.report_cached:
                usage['prompt_tokens_details'] = {'cached_tokens': cached}
            self.cached_total += cached
            self.prompt_total += len(prompt)
            seq = tuple(prompt + list(completion))
            for old in [s for s in self.cache if len(s) <= len(seq) and seq[:len(s)] == s]:
                del self.cache[old]  # a radix tree holds an extended sequence once
            self.cache[seq] = None
            if self.cache_tokens is not None:
                while len(self.cache) > 1 and sum(len(s) for s in self.cache) > self.cache_tokens:
                    self.cache.popitem(last=False)

    def metrics_text(self) -> str:
        """``/metrics``: the simulated cache's counters as vLLM v1 exports them."""
        with self._count_lock:
            queries, hits = self.prompt_total, self.cached_total
        labels = f'{{engine="0",model_name="{self.model_name}"}}'
        return (f'# HELP vllm:num_requests_running Number of requests in model execution batches.\n'
                f'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{labels} {float(self.in_flight)}\n'
                f'# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.\n'
                f'# TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total{labels} {float(queries)}\n'
                f'# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n'
                f'# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{labels} {float(hits)}\n')

    def kill(self) -> None:
        """Crash: stop listening and drop every connection, also those in the middle of a request."""
        self.dead = True
        self.closed.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> 'ChatServer':
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.closed.set()
        if not self.dead:
            self.httpd.shutdown()
            self.httpd.server_close()


def _request_config(body: Dict[str, Any], logprobs: bool, top_logprobs: Any) -> RequestConfig:
    """The sampling fields both endpoints read alike; they differ in how they ask for logprobs."""
    return RequestConfig(max_tokens=body.get('max_tokens'), temperature=body.get('temperature'),
                         top_p=body.get('top_p'), top_k=body.get('top_k'), stop=body.get('stop'),
                         seed=body.get('seed'), logprobs=logprobs, top_logprobs=top_logprobs)


def _common_prefix(a: Any, b: Any) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ToyLM:
    """A deterministic autoregressive "model" for the streaming tests: the next token and its
    logprob are a function of the context ids (the prompt and what was generated so far: a hash
    of the last four ids and the position), so a generation cut anywhere and continued from the
    prompt and the ids so far goes on exactly as an uninterrupted one, and any wrong or missing
    id changes what follows. It samples whole-word tokens (``' word'``, one token each when
    encoded alone) and ``<|im_end|>``, so a chat-mode continuation re-tokenizes to the same ids."""

    def __init__(self, tokenizer: Any, eos_every: int = 37) -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.convert_tokens_to_ids('<|im_end|>')
        self.eos_every = eos_every
        words = []
        for i in range(len(tokenizer)):
            s = tokenizer.decode([i])
            if len(s) > 2 and s[0] == ' ' and s[1:].isalpha() and tokenizer.encode(s, add_special_tokens=False) == [i]:
                words.append(i)
        assert len(words) >= 16, 'the tokenizer has too few whole-word tokens'
        self.words = words

    def step(self, context: List[int]) -> tuple:
        h = zlib.crc32(struct.pack('<5q', len(context), *([0] * 4 + list(context))[-4:]))
        tid = self.eos if h % self.eos_every == 0 else self.words[h % len(self.words)]
        return tid, -((h >> 8) % 1000) / 256.0  # a binary fraction: exact through JSON

    def generate(self, prompt: List[int], max_tokens: int) -> tuple:
        context, out = list(prompt), []
        while len(out) < max_tokens:
            tid, lp = self.step(context)
            out.append((tid, lp))
            context.append(tid)
            if tid == self.eos:
                return out, 'stop'
        return out, 'length'

    def text(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=True)
