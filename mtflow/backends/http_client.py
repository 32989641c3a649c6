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
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from mtflow.backends.base import BackendError

__all__ = ['CLIENTS', 'Reply', 'Unreachable', 'TimedOut', 'make_client']

CLIENTS = ('httpx', 'aiohttp')
KEEPALIVE_S = 30.0


class Unreachable(Exception):
    """The request did not get an answer: connection refused, reset or dropped."""


class TimedOut(Exception):
    """No answer within the timeout."""


@dataclass
class Reply:
    status_code: int
    headers: Mapping[str, str]
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


class _Httpx:

    def __init__(self, headers: Dict[str, str], timeout: float, max_connections: int) -> None:
        import httpx

        self._httpx = httpx
        self.client = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                keepalive_expiry=KEEPALIVE_S))

    async def request(self, method: str, url: str, body: Optional[Dict[str, Any]] = None,
                      timeout: Optional[float] = None) -> Reply:
        httpx = self._httpx
        try:
            kw = {'timeout': timeout} if timeout is not None else {}
            resp = await self.client.request(method, url, json=body, **kw)
        except httpx.TimeoutException as exc:
            raise TimedOut(str(exc)) from exc
        except httpx.TransportError as exc:
            raise Unreachable(f'{type(exc).__name__}: {exc}') from exc
        return Reply(resp.status_code, resp.headers, resp.text)

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
                      timeout: Optional[float] = None) -> Reply:
        aiohttp = self._aiohttp
        kw = {'timeout': aiohttp.ClientTimeout(total=timeout)} if timeout is not None else {}
        try:
            async with self.session.request(method, url, json=body, **kw) as resp:
                text = await resp.text()
                return Reply(resp.status, resp.headers, text)
        except asyncio.TimeoutError as exc:
            raise TimedOut(str(exc) or 'timeout') from exc
        except aiohttp.ClientError as exc:
            raise Unreachable(f'{_HTTPX_NAMES.get(type(exc).__name__, type(exc).__name__)}: {exc}') from exc

    async def close(self) -> None:
        await self.session.close()


#: aiohttp's errors named as httpx names them, so that a message does not depend on the client
_HTTPX_NAMES = {'ClientConnectorError': 'ConnectError', 'ServerDisconnectedError': 'RemoteProtocolError',
                'ClientOSError': 'ReadError'}


def make_client(kind: str, headers: Dict[str, str], timeout: float, max_connections: int) -> Any:
    """The client ``kind`` (``'httpx'`` or ``'aiohttp'``); build it on the loop that uses it."""
    if kind == 'httpx':
        return _Httpx(headers, timeout, max_connections)
    if kind == 'aiohttp':
        return _Aiohttp(headers, timeout, max_connections)
    raise BackendError(f'openai backend: http_client must be one of {", ".join(CLIENTS)}, not {kind!r}')
