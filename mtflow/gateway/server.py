"""The gateway's HTTP server (aiohttp), on its own thread and event loop.

Routes (``{s}``: a session's name; a client takes ``http://HOST:PORT/s/{s}/v1`` as its OpenAI
base URL, ``http://HOST:PORT/s/{s}`` as its Anthropic one):

=========================================  ===========================================================
``POST /s/{s}/v1/chat/completions``        OpenAI chat completions (streaming and not, tools, ``n=1``)
``POST /s/{s}/v1/messages``                Anthropic messages (streaming and not, tools)
``GET  /s/{s}/v1/models``, ``/v1/models``  the model served
``POST /v1/chat/completions``, ...         the same, the session named by the ``X-Mtflow-Session``
                                           header or by a session's own API key
``POST /sessions``                         open a session: ``{"session"?, "key"?: bool, "data"?}``
``POST /s/{s}/finish``                     end it: ``{"reward": R, "info": {...}}``; answers once its
                                           trajectory is written
``POST /policy_version``                   ``{"version": n}``: the weights the backend serves now
``GET  /health``                           the sessions open
=========================================  ===========================================================

Errors are JSON in the API's own shape, with the status a client expects: 400 a malformed body
(naming the field), 401 a wrong key, 404 an unknown session, 409 a finished session or a second
finish, 413 a body over ``max_body_bytes``. A client that goes away mid-answer loses that answer
only; the session goes on.
"""
from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Awaitable, Callable, Optional, Tuple

from aiohttp import web

from mtflow.core.machine import CLIENT_FINISHED
from mtflow.gateway.sessions import Finish
from mtflow.gateway.wire import (WireError, anthropic_error, anthropic_events, anthropic_response, openai_chunks,
                                 openai_error, openai_response)

__all__ = ['GatewayServer', 'SESSION_HEADER']

#: the header that names the session when the URL does not
SESSION_HEADER = 'X-Mtflow-Session'


def _key_of(request: Any) -> Optional[str]:
    auth = request.headers.get('Authorization', '')
    if auth.lower().startswith('bearer '):
        return auth[7:].strip() or None
    return request.headers.get('x-api-key') or None


class GatewayServer:
    """Serves one :class:`mtflow.gateway.Gateway` (see the module docstring): ``start()`` binds
    and returns the port; ``stop()`` closes the listener and waits for the thread."""

    def __init__(self, gateway: Any, host: str, port: int, max_body_bytes: int) -> None:
        self.gateway = gateway
        self.host, self.port = host, port
        self.max_body_bytes = max_body_bytes
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.thread: Optional[threading.Thread] = None
        self._runner: Any = None
        self._started = threading.Event()
        self._error: Optional[BaseException] = None
        self._stop: Optional[asyncio.Event] = None

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> int:
        self.thread = threading.Thread(target=self._main, name='mtflow-gateway-http', daemon=True)
        self.thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self.port

    def _main(self) -> None:
        loop = self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # a port in use: handed to start()
            self._error = exc
            self._started.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        app = web.Application(client_max_size=self.max_body_bytes)
        route = self._route
        for prefix in ('/s/{session}', ''):
            app.router.add_post(f'{prefix}/v1/chat/completions', route(self.chat, 'openai'))
            app.router.add_post(f'{prefix}/v1/messages', route(self.messages, 'anthropic'))
            app.router.add_get(f'{prefix}/v1/models', route(self.models, 'openai'))
        app.router.add_post('/sessions', route(self.open_session, 'openai'))
        app.router.add_post('/s/{session}/finish', route(self.finish, 'openai'))
        app.router.add_post('/policy_version', route(self.policy_version, 'openai'))
        app.router.add_get('/health', route(self.health, 'openai'))
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the port 0 picked
        self._stop = asyncio.Event()
        self._started.set()
        await self._stop.wait()
        await self._runner.cleanup()

    def stop(self) -> None:
        loop = self.loop
        if loop is not None and self._stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass
        if self.thread is not None:
            self.thread.join(timeout=30)

    # ---- the shape of every handler --------------------------------------------------------------
    def _route(self, handler: Callable[..., Awaitable[Any]], api: str) -> Callable[[Any], Awaitable[Any]]:
        async def handle(request: Any) -> Any:
            try:
                return await handler(request)
            except WireError as err:
                body = anthropic_error(err) if api == 'anthropic' else openai_error(err)
                return web.json_response(body, status=err.status)
            except Exception as exc:  # a bug of ours: this call fails, the gateway goes on
                err = WireError(500, f'the gateway failed on this call: {type(exc).__name__}: {exc}', code='internal')
                body = anthropic_error(err) if api == 'anthropic' else openai_error(err)
                return web.json_response(body, status=500)

        return handle

    async def _body(self, request: Any) -> Any:
        length = request.content_length
        if length is not None and length > self.max_body_bytes:
            raise WireError(413, f'the body is {length} bytes, over the gateway\'s limit of {self.max_body_bytes} '
                            '(gateway.max_body_bytes)', code='request_too_large', param='body')
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise WireError(413, f'the body is over the gateway\'s limit of {self.max_body_bytes} bytes '
                            '(gateway.max_body_bytes)', code='request_too_large', param='body') from None
        if not raw:
            raise WireError(400, 'the body is empty: a JSON object is required', param='body')
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            where = f' at line {exc.lineno} column {exc.colno}' if isinstance(exc, json.JSONDecodeError) else ''
            raise WireError(400, f'the body is not valid JSON{where}: {getattr(exc, "msg", exc)}',
                            param='body') from None
        except RecursionError:
            raise WireError(400, 'the body is not valid JSON: nested too deeply', param='body') from None

    def _session_of(self, request: Any) -> Tuple[str, Optional[str]]:
        """``(session name, the key the client presented)``: the URL's session, else the header's,
        else the session whose own key the client presented."""
        key = _key_of(request)
        name = request.match_info.get('session') or request.headers.get(SESSION_HEADER)
        if name:
            if len(name) > 200 or not name.isprintable():
                raise WireError(400, 'a session name is at most 200 printable characters', param='session')
            return name, key
        named = self.gateway.table.named_by_key(key) if key else None
        if named is None:
            raise WireError(400 if not key else 401, 'no session: use http://HOST:PORT/s/<session>/v1 as the base URL, '
                            f'the {SESSION_HEADER} header, or a session\'s own API key', code='no_session')
        return named, key

    # ---- model calls --------------------------------------------------------------------------
    async def chat(self, request: Any) -> Any:
        return await self._call(request, 'openai')

    async def messages(self, request: Any) -> Any:
        return await self._call(request, 'anthropic')

    async def _call(self, request: Any, api: str) -> Any:
        name, key = self._session_of(request)
        body = await self._body(request)
        gateway = self.gateway
        call = gateway.parse_call(name, body, api)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        gateway.table.post_call(name, call, key, loop, fut)
        result = await fut
        if isinstance(result, WireError):
            raise result
        rid, model = gateway.response_id(api), call.model or gateway.model_name
        if not call.stream:
            body = anthropic_response(result, model, rid) if api == 'anthropic' else openai_response(result, model, rid)
            return web.json_response(body)
        return await self._stream(request, api, result, model, rid, call.include_usage)

    async def _stream(self, request: Any, api: str, reply: Any, model: str, rid: str, include_usage: bool) -> Any:
        response = web.StreamResponse(headers={'Content-Type': 'text/event-stream', 'Cache-Control': 'no-cache'})
        try:
            await response.prepare(request)
            if api == 'anthropic':
                for event, data in anthropic_events(reply, model, rid):
                    await response.write(f'event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n'.encode())
            else:
                for chunk in openai_chunks(reply, model, rid, include_usage):
                    await response.write(f'data: {json.dumps(chunk, ensure_ascii=False)}\n\n'.encode())
                await response.write(b'data: [DONE]\n\n')
            await response.write_eof()
        except (ConnectionError, RuntimeError):  # the client went away: only this answer is lost
            pass
        return response

    async def models(self, request: Any) -> Any:
        return web.json_response({'object': 'list', 'data': [{'id': self.gateway.model_name, 'object': 'model',
                                                              'created': 0, 'owned_by': 'mtflow',
                                                              'backend': self.gateway.serves}]})

    # ---- sessions -------------------------------------------------------------------------------
    async def open_session(self, request: Any) -> Any:
        body = await self._body(request)
        if not isinstance(body, dict):
            raise WireError(400, 'the body must be a JSON object', param='body')
        name, key, data = body.get('session'), body.get('key', False), body.get('data') or {}
        if name is not None and (not isinstance(name, str) or not name or len(name) > 200 or '/' in name):
            raise WireError(400, 'session: a name of 1 to 200 characters without "/"', param='session')
        if not isinstance(key, bool):
            raise WireError(400, 'key: must be true or false', param='key')
        if not isinstance(data, dict):
            raise WireError(400, 'data: must be an object', param='data')
        info = self.gateway.open_session(name, key=key, data=data)
        return web.json_response(info)

    async def finish(self, request: Any) -> Any:
        name = request.match_info['session']
        key = _key_of(request)
        body = await self._body(request)
        if not isinstance(body, dict):
            raise WireError(400, 'the body must be a JSON object: {"reward": R, "info": {...}}', param='body')
        reward, info = body.get('reward'), body.get('info') or {}
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise WireError(400, f'reward: must be a number or null, not {reward!r:.40}', param='reward')
        if not isinstance(info, dict):
            raise WireError(400, 'info: must be an object', param='info')
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.gateway.post_finish(name, Finish(None if reward is None else float(reward), info, CLIENT_FINISHED), key,
                                 loop, fut)
        result = await fut
        if isinstance(result, WireError):
            raise result
        return web.json_response(result)

    async def policy_version(self, request: Any) -> Any:
        body = await self._body(request)
        version = body.get('version') if isinstance(body, dict) else None
        try:
            self.gateway.set_policy_version(version)
        except ValueError as exc:
            raise WireError(400, f'version: {exc}', param='version') from None
        return web.json_response({'version': version})

    async def health(self, request: Any) -> Any:
        return web.json_response({'ok': True, 'sessions': len(self.gateway.table.sessions)})
