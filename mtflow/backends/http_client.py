"""The OpenAI backend's HTTP client: httpx (default) or aiohttp, behind one small interface.

Thousands of concurrent requests are where clients differ (NeMo-Gym hung 40 minutes at 16,000
concurrent requests in a connection pool, fixed by changing client), so both are here and
``benchmarks/serving.py`` measures them side by side (``docs/benchmarks.md``). Each client is
built on the backend's private loop with its pool sized deliberately:

* ``max_connections`` connections in all (the backend's in-flight bound, so no request waits
  in the pool for a connection the backend already admitted), every one kept alive (a
  multi-turn run's next turn reuses it);
* one timeout for connect, read and write (``timeout``);
* httpx: ``max_keepalive_connections = max_connections``, ``keepalive_expiry`` 30 s; aiohttp: a
  ``TCPConnector(limit=max_connections, limit_per_host=0, keepalive_timeout=30)``.

:meth:`request` returns a :class:`Reply` or raises :class:`Unreachable` (connection refused,
reset, dropped: the server may be dead) or :class:`TimedOut`; the backend decides about retries.
:meth:`stream` is the same for a streamed (SSE) answer: each line of a ``text/event-stream``
reply is handed to ``on_line`` as it arrives (the reply comes back with ``streamed=True`` and
no text); an error status or a plain JSON answer comes back whole, as from :meth:`request`.
Cancelling the awaiting task leaves the ``async with`` of the response, which closes its
connection: the server sees the disconnect (vLLM's server then aborts the request).
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

from mtflow.backends.base import BackendError

__all__ = ['CLIENTS', 'Reply', 'Unreachable', 'TimedOut', 'choose_client', 'make_client', 'RETRY_STATUS',
           'error_message', 'retry_after']

CLIENTS = ('httpx', 'aiohttp')
KEEPALIVE_S = 30.0
RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class Unreachable(Exception):
    """The request did not get an answer: connection refused, reset or dropped."""


class TimedOut(Exception):
    """No answer within the timeout."""


@dataclass
class Reply:
    status_code: int
    headers: Mapping[str, str]
    text: str
    streamed: bool = False  # an SSE stream, its lines handed to ``on_line`` (``text`` is empty)

    def json(self) -> Any:
        return json.loads(self.text)


def _is_sse(headers: Mapping[str, str]) -> bool:
    return 'text/event-stream' in (headers.get('content-type') or '').lower()


class _Httpx:

    def __init__(self, headers: Dict[str, str], timeout: float, max_connections: int) -> None:
        import httpx

        self._httpx = httpx
        self.client = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                keepalive_expiry=KEEPALIVE_S))

    async def request(self, method: str, url: str, body: Optional[Dict[str, Any]] = None,
                      timeout: Optional[float] = None, headers: Optional[Dict[str, str]] = None) -> Reply:
        httpx = self._httpx
        try:
            kw = {'timeout': timeout} if timeout is not None else {}
            resp = await self.client.request(method, url, json=body, headers=headers, **kw)
        except httpx.TimeoutException as exc:
            raise TimedOut(str(exc)) from exc
        except httpx.TransportError as exc:
            raise Unreachable(f'{type(exc).__name__}: {exc}') from exc
        return Reply(resp.status_code, resp.headers, resp.text)

    async def stream(self, method: str, url: str, body: Optional[Dict[str, Any]],
                     on_line: Callable[[str], None], headers: Optional[Dict[str, str]] = None) -> Reply:
        httpx = self._httpx
        try:
            async with self.client.stream(method, url, json=body, headers=headers) as resp:
                if resp.status_code >= 400 or not _is_sse(resp.headers):
                    text = (await resp.aread()).decode('utf-8', 'replace')
                    return Reply(resp.status_code, resp.headers, text)
                async for line in resp.aiter_lines():
                    on_line(line)
                return Reply(resp.status_code, resp.headers, '', True)
        except httpx.TimeoutException as exc:
            raise TimedOut(str(exc)) from exc
        except httpx.TransportError as exc:
            raise Unreachable(f'{type(exc).__name__}: {exc}') from exc

    async def close(self) -> None:
        await self.client.aclose()


class _Aiohttp:

    def __init__(self, headers: Dict[str, str], timeout: float, max_connections: int) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self.timeout = timeout
        self.session = aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=timeout),
            connector=aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, keepalive_timeout=KEEPALIVE_S))

    async def request(self, method: str, url: str, body: Optional[Dict[str, Any]] = None,
                      timeout: Optional[float] = None, headers: Optional[Dict[str, str]] = None) -> Reply:
        aiohttp = self._aiohttp
        kw = {'timeout': aiohttp.ClientTimeout(total=timeout)} if timeout is not None else {}
        try:
            async with self.session.request(method, url, json=body, headers=headers, **kw) as resp:
                text = await resp.text()
                return Reply(resp.status, resp.headers, text)
        except asyncio.TimeoutError as exc:
            raise TimedOut(str(exc) or 'timeout') from exc
        except aiohttp.ClientError as exc:
            raise Unreachable(f'{_HTTPX_NAMES.get(type(exc).__name__, type(exc).__name__)}: {exc}') from exc

    async def stream(self, method: str, url: str, body: Optional[Dict[str, Any]],
                     on_line: Callable[[str], None], headers: Optional[Dict[str, str]] = None) -> Reply:
        aiohttp = self._aiohttp
        try:
            async with self.session.request(method, url, json=body, headers=headers) as resp:
                if resp.status >= 400 or not _is_sse(resp.headers):
                    return Reply(resp.status, resp.headers, await resp.text())
                try:
                    async for raw in resp.content:
                        on_line(raw.decode('utf-8', 'replace').rstrip('\r\n'))
                except BaseException:
                    resp.close()  # not read to the end (cancelled, or a bad event): drop the connection
                    raise
                return Reply(resp.status, resp.headers, '', True)
        except asyncio.TimeoutError as exc:
            raise TimedOut(str(exc) or 'timeout') from exc
        except aiohttp.ClientError as exc:
            raise Unreachable(f'{_HTTPX_NAMES.get(type(exc).__name__, type(exc).__name__)}: {exc}') from exc

    async def close(self) -> None:
        await self.session.close()


#: aiohttp's errors named as httpx names them, so that a message does not depend on the client
_HTTPX_NAMES = {'ClientConnectorError': 'ConnectError', 'ServerDisconnectedError': 'RemoteProtocolError',
                'ClientOSError': 'ReadError'}


def choose_client(http_client: str) -> str:
    """The client a backend's ``http_client`` option names (``'auto'``: aiohttp when it is
    installed, else httpx), checked to import here so a missing one is named at construction."""
    if http_client not in CLIENTS + ('auto', ):
        raise BackendError(f'openai backend: http_client must be auto, {" or ".join(CLIENTS)}, not {http_client!r}')
    if http_client == 'auto':
        http_client = 'aiohttp' if importlib.util.find_spec('aiohttp') is not None else 'httpx'
    try:
        __import__(http_client)
    except ImportError as exc:
        extra = 'openai' if http_client == 'httpx' else 'aiohttp'
        raise BackendError(f"the openai backend needs {http_client}: pip install 'mtflow[{extra}]'") from exc
    return http_client


def make_client(kind: str, headers: Dict[str, str], timeout: float, max_connections: int) -> Any:
    """The client ``kind`` (``'httpx'`` or ``'aiohttp'``); build it on the loop that uses it."""
    if kind == 'httpx':
        return _Httpx(headers, timeout, max_connections)
    if kind == 'aiohttp':
        return _Aiohttp(headers, timeout, max_connections)
    raise BackendError(f'openai backend: http_client must be one of {", ".join(CLIENTS)}, not {kind!r}')


def error_message(resp: Any) -> str:
    """The server's error message in an answer (OpenAI's ``{"error": {"message": ...}}`` and
    the common variants), else the start of its body."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(data, dict):
        err = data.get('error', data.get('message', data.get('detail')))
        if isinstance(err, dict):
            err = err.get('message', err)
        if err is not None:
            return str(err)[:300]
    return json.dumps(data)[:200]


def retry_after(value: Optional[str]) -> Optional[float]:
    """A ``Retry-After`` header in seconds (``None``: absent or not a number)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
