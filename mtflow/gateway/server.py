"""The gateway's HTTP server (aiohttp), on its own thread and event loop.

Routes (``{s}``: a session's name; a client takes ``http://HOST:PORT/s/{s}/v1`` as its OpenAI
base URL, ``http://HOST:PORT/s/{s}`` as its Anthropic one):

=========================================  ===========================================================
``POST /s/{s}/v1/chat/completions``        OpenAI chat completions (streaming and not, tools, ``n=1``)
``POST /s/{s}/v1/responses``               the OpenAI Responses API (streaming and not, function
                                           tools, ``previous_response_id``)
``POST /s/{s}/v1/messages``                Anthropic messages (streaming and not, tools)
``GET  /s/{s}/v1/models``, ``/v1/models``  the model served
``POST /v1/chat/completions``, ...         the same, the session named by a header
                                           (``gateway.session_header``, default ``X-Session-ID``;
                                           ``X-Mtflow-Session`` too), by a session's own API key, or
                                           (Responses) by the ``previous_response_id``'s session
``POST /sessions``                         open a session: ``{"session"?, "key"?: bool, "data"?}``
``POST /s/{s}/finish``                     end it: ``{"reward": R, "info": {...}}``; answers once its
                                           trajectory is written
``POST /policy_version``                   ``{"version": n}``: the weights the backend serves now
``GET  /health``                           the sessions open
``GET  /``                                 what the gateway serves
=========================================  ===========================================================

Errors are JSON in the API's own shape, with the status a client expects: 400 a malformed body
(naming the field) or a call that names no session, 401 a wrong key, 404 an unknown session or
route (naming the routes served), 405 a method a route does not take, 409 a finished session
or a second finish, 413 a body over ``max_body_bytes``. A streaming call's first event goes out
with the first text the backend streams (:mod:`.streaming`); an error before it is a plain error
answer, one after it an error event. A client that goes away mid-answer loses that answer only;
the session goes on.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from typing import Any, Awaitable, Callable, Dict, Optional, Tuple

from aiohttp import web

from mtflow.core.machine import CLIENT_FINISHED
from mtflow.gateway.formats import FORMATS
from mtflow.gateway.sessions import Finish
from mtflow.gateway.streaming import Pump, TextFeed
from mtflow.gateway.wire import Call, WireError, anthropic_error, openai_error

__all__ = ['GatewayServer', 'SESSION_HEADER', 'ROUTES']

log = logging.getLogger('mtflow.gateway')

#: the header that names the session when the URL does not, read beside ``gateway.session_header``
SESSION_HEADER = 'X-Mtflow-Session'
#: what the gateway serves (``GET /``, and the 404 of any other route)
ROUTES = ('POST /s/{session}/v1/chat/completions', 'POST /s/{session}/v1/responses', 'POST /s/{session}/v1/messages',
          'GET /s/{session}/v1/models', 'POST /v1/chat/completions', 'POST /v1/responses', 'POST /v1/messages',
          'GET /v1/models', 'POST /sessions', 'POST /s/{session}/finish', 'POST /policy_version', 'GET /health', 'GET /')


def _key_of(request: Any) -> Optional[str]:
    auth = request.headers.get('Authorization', '')
    if auth.lower().startswith('bearer '):
        return auth[7:].strip() or None
    return request.headers.get('x-api-key') or None


class GatewayServer:
    """Serves one :class:`mtflow.gateway.Gateway` (see the module docstring): ``start()`` binds
    and returns the port; ``stop()`` closes the listener and waits for the thread."""

    def __init__(self, gateway: Any, host: str, port: int, max_body_bytes: int,
                 session_header: str = 'X-Session-ID') -> None:
        self.gateway = gateway
        self.session_headers = tuple(dict.fromkeys((session_header, SESSION_HEADER)))
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
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[_unserved])
        route = self._route
        for prefix in ('/s/{session}', ''):
            app.router.add_post(f'{prefix}/v1/chat/completions', route(self.chat, 'openai'))
            app.router.add_post(f'{prefix}/v1/responses', route(self.responses, 'openai'))
            app.router.add_post(f'{prefix}/v1/messages', route(self.messages, 'anthropic'))
            app.router.add_get(f'{prefix}/v1/models', route(self.models, 'openai'))
        app.router.add_post('/sessions', route(self.open_session, 'openai'))
        app.router.add_post('/s/{session}/finish', route(self.finish, 'openai'))
        app.router.add_post('/policy_version', route(self.policy_version, 'openai'))
        app.router.add_get('/health', route(self.health, 'openai'))
        app.router.add_get('/', route(self.served, 'openai'))
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

    def _session_of(self, request: Any, previous: Optional[str] = None) -> Tuple[str, Optional[str]]:
        """``(session name, the key the client presented)``: the URL's session, else a session
        header's, else the session whose own key the client presented, else ``previous`` (the
        session of the response a Responses call continues)."""
        key = _key_of(request)
        name = request.match_info.get('session') or next(
            (request.headers[h] for h in self.session_headers if request.headers.get(h)), None)
        if name:
            if len(name) > 200 or not name.isprintable():
                raise WireError(400, 'a session name is at most 200 printable characters', param='session')
            return name, key
        named = (self.gateway.table.named_by_key(key) if key else None) or previous
        if named is None:
            said = " (the API key presented is no session's own)" if key else ''
            raise WireError(400, f'no session{said}: use http://HOST:PORT/s/<session>/v1 as the base URL, the '
                            f"{self.session_headers[0]} header, or a session's own API key", code='no_session')
        return named, key

    # ---- model calls --------------------------------------------------------------------------
    async def chat(self, request: Any) -> Any:
        return await self._call(request, 'openai')

    async def responses(self, request: Any) -> Any:
        return await self._call(request, 'responses')

    async def messages(self, request: Any) -> Any:
        return await self._call(request, 'anthropic')

    async def _call(self, request: Any, api: str) -> Any:
        body = await self._body(request)
        gateway = self.gateway
        previous = gateway.responses.previous_of(body) if api == 'responses' else None
        name, key = self._session_of(request, previous[0] if previous is not None else None)
        if previous is not None and previous[0] != name:  # its conversation would join another's trajectory
            raise WireError(400, f'previous_response_id: {body["previous_response_id"]!r} is a response of session '
                            f'{previous[0]!r}, not of {name!r}, the session this call names; continue a session\'s '
                            'own responses', param='previous_response_id', code='session_mismatch')
        call = gateway.parse_call(name, body, api, previous)
        loop = asyncio.get_running_loop()
        if call.images:  # stored in the run directory (a file write): off the server's loop
            await loop.run_in_executor(None, gateway.images.store_call, call)
        rid, model = gateway.response_id(api), call.model or gateway.model_name
        headers = _warnings(call)
        feed = TextFeed(loop) if call.stream and gateway.sinks is not None else None
        fut = loop.create_future()
        if feed is not None:
            gateway.sinks.open(name, feed.push)
        try:
            gateway.table.post_call(name, call, key, loop, fut)
            if call.stream:
                return await self._stream(request, call, model, rid, fut, feed, name, headers)
            result = await fut
        finally:
            if feed is not None:
                gateway.sinks.close(name, feed.push)
        if isinstance(result, WireError):
            raise result
        gateway.responses.keep(rid, name, call, result)
        return web.json_response(FORMATS[call.api].answer(result, call, model, rid), headers=headers)

    async def _stream(self, request: Any, call: Call, model: str, rid: str, fut: Any, feed: Optional[TextFeed],
                      name: str, headers: Dict[str, str]) -> Any:
        """A streaming call: events as the text comes (see the module docstring)."""
        gateway = self.gateway
        pump = Pump(FORMATS[call.api].writer(call, model, rid), gateway.safe_text(call))
        response: Optional[web.StreamResponse] = None
        try:
            while feed is not None and not fut.done():
                text = asyncio.ensure_future(feed.next())
                done, _ = await asyncio.wait({fut, text}, return_when=asyncio.FIRST_COMPLETED)
                if text not in done:
                    text.cancel()
                    break
                events = pump.update(text.result())
                if events:
                    response = response or await self._open_stream(request, headers)
                    await response.write(b''.join(events))
            result = await fut
            if isinstance(result, WireError):
                if response is None:
                    raise result
                await response.write(b''.join(pump.error(result)))
            else:
                gateway.responses.keep(rid, name, call, result)
                events = pump.finish(result)
                if pump.diverged:
                    gateway.stream_mismatches += 1
                response = response or await self._open_stream(request, headers)
                await response.write(b''.join(events))
            await response.write_eof()
        except (ConnectionError, RuntimeError):  # the client went away: only this answer is lost
            pass
        except Exception as exc:  # a bug of ours after the answer began: said in the stream, the gateway goes on
            if response is None:
                raise
            err = WireError(500, f'the gateway failed on this call: {type(exc).__name__}: {exc}', code='internal')
            with contextlib.suppress(ConnectionError, RuntimeError):
                await response.write(b''.join(pump.error(err)))
                await response.write_eof()
        return response if response is not None else web.Response(status=499)

    async def _open_stream(self, request: Any, headers: Dict[str, str]) -> web.StreamResponse:
        response = web.StreamResponse(headers={'Content-Type': 'text/event-stream', 'Cache-Control': 'no-cache',
                                               **headers})
        await response.prepare(request)
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

    async def served(self, request: Any) -> Any:
        return web.json_response({'service': 'mtflow gateway', 'model': self.gateway.model_name, 'routes': list(ROUTES),
                                  'session_headers': list(self.session_headers)})


_warned: set = set()


def _warnings(call: Call) -> Dict[str, str]:
    """The ``x-mtflow-warning`` header of a call whose tools were not all offered to the model
    (each kind also said once in the gateway's log)."""
    dropped = call.echo.get('dropped_tools') if call.echo else None
    if not dropped:
        return {}
    text = f'tools not offered to the model: {", ".join(dropped)} (the gateway offers function tools only)'
    if text not in _warned:
        _warned.add(text)
        log.warning('gateway: %s', text)
    return {'x-mtflow-warning': text}


@web.middleware
async def _unserved(request: Any, handler: Any) -> Any:
    """A route the gateway does not serve (or a method it does not take there) answers JSON that
    names what it serves, in the OpenAI error shape (Anthropic's under ``/v1/messages``)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status not in (404, 405):
            raise
        what = 'no such route' if exc.status == 404 else f'{request.method} is not served here'
        err = WireError(exc.status, f'{what}: {request.method} {request.path}; the gateway serves '
                        f'{", ".join(ROUTES)}', code='not_found' if exc.status == 404 else 'method_not_allowed')
        body = anthropic_error(err) if '/v1/messages' in request.path else openai_error(err)
        return web.json_response(body, status=exc.status)
