"""OpenEnv servers as YAML environments, through ``openenv``'s own WebSocket client
(``openenv.core.GenericEnvClient``): one server session per request, opened at the request's start
(``reset``), stepped with every completion, closed on every finish path.

What can go wrong, and what happens:

- **opening a session** (connection refused, a reset error, a timeout): retried ``retries`` times
  with backoff, each time on the least-loaded live server (a server that refused a connection is
  skipped for a while; a launched server whose process exited is skipped for good). Past the
  retries the request fails with :class:`OpenEnvSessionError`, naming every attempt.
- **capacity**: ``max_sessions`` caps this scheduler's open sessions per server; the server's
  own limit (``max_concurrent_envs``, answered as ``CAPACITY_REACHED``) is honoured too. A request
  that finds every server full waits up to ``capacity_wait_s`` (sessions of other requests, ranks
  or jobs may close), then fails with :class:`OpenEnvCapacityError`. Sessions are held for a
  request's whole life, so a batch needs as many sessions as it has requests: size
  ``batch_size`` to the servers' capacity.
- **a step** whose connection breaks or times out fails its request (:class:`OpenEnvSessionError`):
  the session's state is gone with it, so a step is never retried on a new session. A step the
  environment raised on (``EXECUTION_ERROR``), or a JSON action the model wrote (``action: json``)
  that the server rejects, is fed back to the model as ``Error: ...`` and the episode goes on.
- **the action schema**: a server that rejects the text action itself (``VALIDATION_ERROR`` for
  ``{action_field: completion}``) rejects every action: a configuration error, not a move. The
  request fails with :class:`OpenEnvActionError`, naming ``action_field`` and the fields of the
  server's action schema (``GET /schema``); ``mtflow validate`` checks the same when it can read
  the schema (:func:`action_field_problem`), and ``observation_field`` / ``image_fields`` against
  the observation schema (:func:`observation_field_problems`); ``mtflow run`` checks both on each
  server before the first generation (:meth:`OpenEnvPool.preflight`).

Every wait is bounded (``connect_timeout_s``, ``message_timeout_s``, ``capacity_wait_s``), so a
dead server costs its own requests an error, never a hung batch. The connections run on the
pool's own event loop (:meth:`OpenEnvPool.run`), so they answer keepalive pings while the model
generates.
"""
from __future__ import annotations

import asyncio
import atexit
import base64
import binascii
import importlib.util
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
import weakref
from typing import Any, Dict, List, Optional, Tuple

from mtflow.core.errors import MtflowError
from mtflow.core.images import ImageError, Observation
from mtflow.core.keys import closest_key
from mtflow.declarative.envs.base import MissingExtra, StepOutcome, request_seed
from mtflow.declarative.envs.config import OpenEnvConfig
from mtflow.declarative.envs.local_servers import IOLoop, LocalServer, child_env, launch_local, wait_healthy

__all__ = ['OpenEnvPool', 'OpenEnvSession', 'OpenEnvError', 'OpenEnvSessionError', 'OpenEnvCapacityError',
           'OpenEnvLaunchError', 'OpenEnvActionError', 'OpenEnvServer', 'action_field_problem', 'observation_field_problems',
           'read_schema']

#: how long a server that refused a connection is skipped when choosing where to open a session
DEAD_COOLDOWN_S = 5.0
_CAPACITY_POLL_S = 0.05
#: how soon a server that answered CAPACITY_REACHED is asked again
_CAPACITY_RETRY_S = 0.2


class OpenEnvError(MtflowError):
    """An OpenEnv server could not serve a request."""


class OpenEnvSessionError(OpenEnvError):
    """A session could not be opened, or broke during a step."""


class OpenEnvCapacityError(OpenEnvError):
    """Every server stayed at capacity for ``capacity_wait_s``."""


class OpenEnvLaunchError(OpenEnvError):
    """A ``launch``-ed server did not start."""


class OpenEnvActionError(OpenEnvError):
    """The server rejects the action's schema: ``action_field`` is not what the server takes."""


def action_field_problem(schema: Any, field: str) -> Optional[str]:
    """What is wrong with sending ``{field: text}`` to a server whose ``/schema`` is ``schema``
    (``None``: nothing, or the schema does not say). Fields of openenv's ``Action`` base (such as
    ``metadata``) are optional and never required of a text action."""
    action = schema.get('action') if isinstance(schema, dict) else None
    props = action.get('properties') if isinstance(action, dict) else None
    if not isinstance(props, dict) or not props:
        return None
    required = [str(r) for r in action.get('required') or []]
    if field not in props:
        return (f'action_field {field!r} is not a field of the server\'s action schema; it has: '
                f'{", ".join(map(str, props))}' + (f' (required: {", ".join(required)})' if required else ''))
    others = [r for r in required if r != field]
    if others:
        return (f'the server\'s action schema also requires {", ".join(others)}; a text action sets only '
                f'{field!r} (use action: json, or a server whose action has one required field)')
    return None


#: fields of openenv's ``Observation`` base that the server sends beside the observation, not in it
_OBSERVATION_BASE = ('done', 'reward', 'metadata')


def observation_field_problems(schema: Any, config: OpenEnvConfig) -> List[Tuple[str, str]]:
    """``(field, message)`` for each of ``observation_field`` and ``image_fields`` that is not a
    field of the server's observation schema (``GET /schema``), with the fields it has and the
    closest: a typo would otherwise fail every request after its first generation. ``[]`` when
    all are there, or the schema does not say."""
    observation = schema.get('observation') if isinstance(schema, dict) else None
    props = observation.get('properties') if isinstance(observation, dict) else None
    if not isinstance(props, dict) or not props:
        return []
    fields = [str(k) for k in props if k not in _OBSERVATION_BASE]
    named = ([('observation_field', config.observation_field)] if config.observation_field is not None else []) + \
        [('image_fields', name) for name in config.image_fields]
    out = []
    for key, name in named:
        if name in fields:
            continue
        close = closest_key(name, fields)
        out.append((key, f'{key} {name!r} is not a field of the server\'s observation schema; it has: '
                         f'{", ".join(fields)}' + (f'; did you mean {close!r}?' if close else '')))
    return out


def read_schema(url: str, timeout_s: float = 5.0) -> Optional[Dict[str, Any]]:
    """The server's ``GET /schema`` (openenv's combined action/observation/state schemas), or
    ``None`` when it cannot be read."""
    base = re.sub(r'^ws', 'http', url.rstrip('/'))
    try:
        with urllib.request.urlopen(f'{base}/schema', timeout=timeout_s) as resp:
            value = json.loads(resp.read())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _is_capacity(exc: BaseException) -> bool:
    return 'CAPACITY_REACHED' in str(exc)


def _is_server_reply(exc: BaseException) -> bool:
    """The server answered with an error message (the session itself is alive)."""
    return isinstance(exc, RuntimeError) and str(exc).startswith('Server error:')


class OpenEnvServer(LocalServer):
    """One server: its URL, the sessions this pool has open on it, and (when launched) its process."""

    def __init__(self, url: str, process: Optional[subprocess.Popen] = None, log_path: Optional[str] = None) -> None:
        super().__init__(url, process, log_path)
        self.open = 0
        self.opened = 0
        #: refused a connection: not chosen before this time (``time.monotonic()``)
        self.skip_until = 0.0
        #: answered CAPACITY_REACHED: asked again from this time; the message it gave
        self.full_until = 0.0
        self.full_message: Optional[str] = None

    def live(self, now: float) -> bool:
        return not self.exited and now >= self.skip_until


class OpenEnvPool:
    """The servers of one ``env: {openenv: ...}`` section, shared by all its requests; calling it
    makes a new :class:`OpenEnvSession` (the scheduler's per-request environment). Nothing starts
    or connects until the first session opens, so validating a config touches no server."""

    def __init__(self, config: OpenEnvConfig, base_dir: Optional[str] = None) -> None:
        if importlib.util.find_spec('openenv') is None:
            raise MissingExtra('openenv', 'openenv')
        self.config = config
        self.base_dir = base_dir
        self.servers: List[OpenEnvServer] = []
        self.sessions: 'weakref.WeakSet[OpenEnvSession]' = weakref.WeakSet()
        self._start_lock = threading.Lock()
        self._started = False
        self._start_error: Optional[BaseException] = None
        self._closed = False
        self.io = IOLoop('mtflow-openenv-io', lambda: OpenEnvError('the OpenEnv pool is closed'))
        self._preflighted = False
        if config.url is not None:
            urls = [config.url] if isinstance(config.url, str) else list(config.url)
            self.servers = [OpenEnvServer(u) for u in urls]
            self._started = True

    def __call__(self) -> 'OpenEnvSession':
        return OpenEnvSession(self)

    # ---- checks before anything runs ------------------------------------------------------------
    def problems(self) -> List[tuple]:
        """``(field, message)`` for what ``mtflow validate`` can check without starting or
        connecting to anything of its own: a ``launch`` module that does not exist, and
        ``action_field`` against the server's action schema where it can be read (a ``url``
        server that answers ``/schema`` within 2 s; a ``launch`` app, asked in-process). A server
        that does not answer is not a problem here: it may be started later (``mtflow run``
        opens a session on each server before the model loads, :meth:`preflight`)."""
        cfg = self.config
        out: List[tuple] = []
        schemas: List[Any] = []
        if isinstance(cfg.launch, str):
            module = cfg.launch.split(':', 1)[0]
            if self.base_dir and self.base_dir not in sys.path:
                sys.path.insert(0, self.base_dir)
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                return [('launch', f'no module named {module!r} (launch {cfg.launch!r}; the server would never start)')]
            schemas.append(_app_schema(cfg.launch))
        elif cfg.url is not None:
            schemas += [read_schema(u, 2.0) for u in ([cfg.url] if isinstance(cfg.url, str) else cfg.url)]
        if cfg.action == 'text':
            for schema in schemas:
                why = action_field_problem(schema, cfg.action_field) if schema is not None else None
                if why:
                    out.append(('action_field', why))
                    break
        return out + next((found for found in (observation_field_problems(s, cfg) for s in schemas) if found), [])

    def preflight(self) -> None:
        """Start the servers and open (and close) one session on each, so that a server that
        cannot be reached, or that rejects the reset, fails the run before the first generation
        (``mtflow run`` does it for ``url`` servers before the model loads, for launched ones once
        they are up) instead of failing every request after its first generation;
        ``action_field`` is checked against each server's schema too. Raises
        :class:`OpenEnvError` naming the server. Once per pool."""
        if self._preflighted:
            return
        self._preflighted = True
        self.start()
        cfg = self.config
        for server in self.servers:
            schema = read_schema(server.url, min(cfg.connect_timeout_s, 5.0))
            if cfg.action == 'text' and schema is not None:
                why = action_field_problem(schema, cfg.action_field)
                if why:
                    raise OpenEnvActionError(f'OpenEnv server {server.url}: {why} (env.openenv.action_field)')
            wrong = observation_field_problems(schema, cfg)
            if wrong:
                raise OpenEnvSessionError('; '.join(f'OpenEnv server {server.url}: {why} (env.openenv.{key})'
                                                    for key, why in wrong))
            asyncio.run(_probe_session(server.url, cfg))

    # ---- servers ------------------------------------------------------------------------------
    def start(self) -> None:
        """Launch the servers (``launch``) and wait until each answers ``/health``; idempotent."""
        with self._start_lock:
            if self._closed:
                raise OpenEnvError('the OpenEnv pool is closed')
            if self._start_error is not None:
                raise self._start_error
            if self._started:
                return
            try:
                for _ in range(self.config.replicas):
                    self.servers.append(self._launch_one())
                for server in self.servers:
                    self._wait_healthy(server)
            except BaseException as exc:
                for server in self.servers:
                    server.stop()
                self._start_error = exc if isinstance(exc, OpenEnvError) else OpenEnvLaunchError(
                    f'launching {self.config.launch!r} failed: {type(exc).__name__}: {exc}')
                raise self._start_error from None
            self._started = True
            _LIVE_POOLS.add(self)

    def _command(self, port: int) -> List[str]:
        launch = self.config.launch
        if isinstance(launch, str):
            return [sys.executable, '-m', 'uvicorn', launch, '--host', '127.0.0.1', '--port', str(port),
                    '--log-level', 'warning']
        return [str(part).replace('{port}', str(port)).replace('{python}', sys.executable) for part in launch]

    def _launch_one(self) -> OpenEnvServer:
        env = child_env(self.base_dir)
        env.setdefault('ENABLE_WEB_INTERFACE', 'false')
        return launch_local(self._command, env, self.base_dir, 'mtflow-openenv-', OpenEnvServer)

    def _wait_healthy(self, server: OpenEnvServer) -> None:
        wait_healthy(server, self.config.startup_timeout_s, f'OpenEnv server {self.config.launch!r}',
                     OpenEnvLaunchError)

    def close(self) -> None:
        """Drop every session still open (their requests are over), stop the I/O loop and the
        launched servers."""
        self._closed = True
        for session in list(self.sessions):
            session.abandon()
        self.io.close()
        for server in self.servers:
            server.stop()
        _LIVE_POOLS.discard(self)

    # ---- the I/O loop -------------------------------------------------------------------------
    async def run(self, coro: Any) -> Any:
        """Run ``coro`` on the pool's own event loop, in a thread of its own, and await it from the
        caller's loop. The WebSocket connections live there because that loop always runs: the
        executor's loop is idle while the model generates (minutes with a slow model), and a
        connection whose loop does not run cannot answer the server's keepalive pings; the server
        then drops it (close code 1011) and the request's session is lost."""
        return await self.io.run(coro)

    def call_soon(self, fn: Any) -> None:
        """Run ``fn`` on the I/O loop (it owns the connections), or now when there is none."""
        self.io.call_soon(fn)

    # ---- sessions -----------------------------------------------------------------------------
    async def _pick(self, deadline: float) -> OpenEnvServer:
        """The least-loaded live server with a free slot; waits (bounded) while all are full."""
        cap = self.config.max_sessions
        while True:
            now = time.monotonic()
            live = [s for s in self.servers if s.live(now)]
            if not live:
                exited = [s for s in self.servers if s.exited]
                if len(exited) == len(self.servers):
                    raise OpenEnvSessionError('no OpenEnv server is running: ' + '; '.join(
                        f'{s.url} exited with status {s.process.returncode}' for s in exited))
                if now > deadline:
                    raise OpenEnvSessionError('no OpenEnv server accepts connections: ' + ', '.join(
                        s.url for s in self.servers))
            free = [s for s in live if (cap is None or s.open < cap) and now >= s.full_until]
            if free:
                return min(free, key=lambda s: (s.open, s.opened))
            if live and now > deadline:
                full = [s for s in live if s.full_message and (cap is None or s.open < cap)]
                limit = (f'the server{"s" if len(full) > 1 else ""} answered: {full[0].full_message}' if full else
                         f'{cap} sessions each from this scheduler (max_sessions)')
                raise OpenEnvCapacityError(
                    f'every OpenEnv server stayed at capacity for {self.config.capacity_wait_s:g} s (capacity_wait_s); '
                    f'{limit}; lower batch_size, raise max_concurrent_envs or add servers')
            await asyncio.sleep(_CAPACITY_POLL_S)

    async def open_session(self, reset_kwargs: Dict[str, Any]) -> tuple:
        """``(server, client, reset result)``, with retries; see the module docstring."""
        if not self._started:
            await asyncio.to_thread(self.start)
        from openenv.core import GenericEnvClient

        cfg = self.config
        capacity_deadline = time.monotonic() + cfg.capacity_wait_s
        attempts: List[str] = []
        while True:
            server = await self._pick(capacity_deadline)
            server.open += 1
            server.opened += 1
            client = GenericEnvClient(base_url=server.url, connect_timeout_s=cfg.connect_timeout_s,
                                      message_timeout_s=cfg.message_timeout_s)
            try:
                await asyncio.wait_for(client.connect(), cfg.connect_timeout_s + 1.0)
                result = await asyncio.wait_for(client.reset(**reset_kwargs), cfg.message_timeout_s + 1.0)
                server.full_message = None
                return server, client, result
            except Exception as exc:
                server.open -= 1
                exc = await _refusal(client, exc)
                await _close_client(client, 1.0)
                now = time.monotonic()
                if _is_capacity(exc):  # ask again shortly; _pick gives up at the deadline
                    server.full_until = now + _CAPACITY_RETRY_S
                    server.full_message = f'{server.url}: {_server_message(exc)}'
                    continue
                if not _is_server_reply(exc):
                    server.skip_until = now + DEAD_COOLDOWN_S
                attempts.append(f'{server.url}: {_describe(exc)}')
                if len(attempts) > cfg.retries:
                    raise OpenEnvSessionError(f'could not open an OpenEnv session ({len(attempts)} attempt(s)): '
                                              + '; '.join(attempts)) from None
                await asyncio.sleep(cfg.retry_backoff_s * len(attempts))


class OpenEnvSession:
    """One request's session; the YAML scheduler's environment protocol (all async)."""

    def __init__(self, pool: OpenEnvPool) -> None:
        self.pool = pool
        self.server: Optional[OpenEnvServer] = None
        self.client: Any = None
        self.uuid: Optional[str] = None
        self.steps = 0
        self.closed = False
        pool.sessions.add(self)

    async def reset(self, infer_request: Any) -> Optional[str]:
        cfg = self.pool.config
        data = getattr(infer_request, 'data_dict', None) or {}
        self.uuid = getattr(infer_request, 'uuid', None)
        kwargs = {**cfg.reset_kwargs, **(data.get('reset_kwargs') or {})}
        kwargs.setdefault('seed', request_seed(infer_request))
        if self.uuid:
            kwargs.setdefault('episode_id', str(self.uuid)[:255])
        self.server, self.client, result = await self.pool.run(self.pool.open_session(kwargs))
        return self._observation(result.observation)

    async def step(self, action: str) -> StepOutcome:
        return await self.pool.run(self._step(action))

    async def _step(self, action: str) -> StepOutcome:
        if self.client is None:
            raise OpenEnvSessionError('step() before reset()')
        cfg = self.pool.config
        self.steps += 1
        payload, as_text = self._action(action)
        try:
            result = await asyncio.wait_for(self.client.step(payload), cfg.message_timeout_s + 1.0)
        except Exception as exc:
            if as_text and _is_server_reply(exc) and 'VALIDATION_ERROR' in str(exc):
                raise await self._schema_error(exc) from None
            if _is_server_reply(exc) and not _is_capacity(exc):
                return StepOutcome(f'Error: {_server_message(exc)}', 0.0, False, False,
                                   {'openenv_server': self.server.url, 'error': _server_message(exc)})
            self.server.skip_until = time.monotonic() + DEAD_COOLDOWN_S
            raise OpenEnvSessionError(f'OpenEnv server {self.server.url} failed during step {self.steps}: '
                                      f'{_describe(exc)} (the session is lost; a step is not retried)') from None
        reward = float(result.reward) if result.reward is not None else 0.0
        info: Dict[str, Any] = {'openenv_server': self.server.url}
        metadata = result.observation.get('metadata') if isinstance(result.observation, dict) else None
        if metadata:
            info['openenv_metadata'] = metadata
        return StepOutcome(self._observation(result.observation), reward, bool(result.done), False, info)

    async def close(self) -> None:
        """Close the session (best effort, bounded: a dead server cannot hold a request up)."""
        if self.closed:
            return
        self.closed = True
        client, self.client = self.client, None
        if client is not None:
            self.server.open -= 1
            await self.pool.run(_close_client(client, 5.0))
        self.pool.sessions.discard(self)

    def abandon(self) -> None:
        """Drop the connection without the event loop (the scheduler closing after a run ended)."""
        if self.closed:
            return
        self.closed = True
        client, self.client = self.client, None
        if client is not None:
            self.server.open -= 1
            transport = getattr(getattr(client, '_ws', None), 'transport', None)
            if transport is not None:
                self.pool.call_soon(transport.abort)
        self.pool.sessions.discard(self)

    # ---- text <-> OpenEnv -----------------------------------------------------------------------
    def _action(self, text: str) -> tuple:
        """``(the step's action, whether it is the text form {action_field: text})``."""
        cfg = self.pool.config
        if cfg.action == 'json':
            parsed = _json_object(text)
            if parsed is not None:
                return parsed, False
        return {cfg.action_field: text}, True

    async def _schema_error(self, exc: BaseException) -> OpenEnvActionError:
        """The error of a text action the server's schema rejects, with the schema's fields."""
        field = self.pool.config.action_field
        schema = await asyncio.to_thread(read_schema, self.server.url, 5.0)
        why = action_field_problem(schema, field) if schema is not None else None
        return OpenEnvActionError(
            f'OpenEnv server {self.server.url} rejected the action {{{field!r}: <completion>}} at step {self.steps}: '
            f'{_server_message(exc)}; '
            + (why if why else f'check env.openenv.action_field ({field!r}) against the server\'s action schema')
            + ' (env.openenv.action_field)')

    def _observation(self, observation: Any) -> Any:
        """The text shown to the model, or an :class:`~mtflow.core.images.Observation` with the
        images of ``image_fields`` (which the text then leaves out). The fields of openenv's
        ``Observation`` base are never shown: ``openenv`` 0.10 keeps ``metadata`` in the payload
        (``openenv-core`` 0.3 left it out), which would turn a one-field observation into JSON
        (a step's metadata goes to ``env_info['openenv_metadata']``)."""
        if isinstance(observation, dict):
            observation = {k: v for k, v in observation.items() if k not in _OBSERVATION_BASE}
        fields = self.pool.config.image_fields
        if not fields or not isinstance(observation, dict):
            return self._text(observation)
        images = []
        for name in fields:
            if name not in observation:
                raise OpenEnvSessionError(f'the observation has no field {name!r} (image_fields); it has: '
                                          + ', '.join(map(str, observation)))
            if observation[name] is not None:
                images.append(openenv_image(observation, name))
        shown = {k: v for k, v in observation.items() if k not in fields and
                 not (k.endswith('_shape') and k[:-len('_shape')] in fields)}
        return Observation(self._text(shown), images)

    def _text(self, observation: Any) -> str:
        field = self.pool.config.observation_field
        if isinstance(observation, dict):
            if field is not None:
                if field not in observation:
                    raise OpenEnvSessionError(f'the observation has no field {field!r} (observation_field); it has: '
                                              + ', '.join(map(str, observation)))
                return str(observation[field])
            if len(observation) == 1:
                return str(next(iter(observation.values())))
            return json.dumps(observation, ensure_ascii=False, default=str)
        return '' if observation is None else str(observation)


def openenv_image(observation: Dict[str, Any], name: str) -> Any:
    """The image in field ``name`` of an OpenEnv observation (JSON): a data URL as it is, other
    text as base64 of encoded bytes, nested lists of pixels as an array, a flat list reshaped by
    the ``<name>_shape`` field beside it. Raises :class:`~mtflow.core.images.ImageError`."""
    value = observation[name]
    where = f'image_fields: field {name!r}'
    if isinstance(value, str):
        if value.startswith('data:'):
            return value
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError(f'{where} is text that is neither a data:image/ URL nor base64') from None
    if isinstance(value, list):
        import numpy as np  # lazy: only pixel observations need numpy

        try:
            arr = np.asarray(value)
            shape = observation.get(f'{name}_shape')
            if arr.ndim == 1 and shape is not None:
                arr = arr.reshape([int(d) for d in shape])
        except (ValueError, TypeError) as exc:
            raise ImageError(f'{where}: not an array of pixels ({exc})') from None
        if arr.dtype.kind not in 'uif':
            raise ImageError(f'{where}: not an array of pixels (dtype {arr.dtype})')
        if arr.dtype.kind != 'f':
            arr = np.clip(arr, 0, 255).astype(np.uint8)
        return arr
    raise ImageError(f'{where} holds a {type(value).__name__}, not an image')


_FENCE = re.compile(r'```(?:json)?\s*(\{.*\})\s*```', re.DOTALL)


async def _probe_session(url: str, cfg: OpenEnvConfig) -> None:
    """Open one session on ``url``, reset it with the configured kwargs, close it (one attempt,
    bounded by the configured timeouts; a server at capacity is up, which is all this checks)."""
    from openenv.core import GenericEnvClient

    client = GenericEnvClient(base_url=url, connect_timeout_s=cfg.connect_timeout_s,
                              message_timeout_s=cfg.message_timeout_s)
    try:
        await asyncio.wait_for(client.connect(), cfg.connect_timeout_s + 1.0)
        await asyncio.wait_for(client.reset(**cfg.reset_kwargs), cfg.message_timeout_s + 1.0)
    except Exception as exc:
        exc = await _refusal(client, exc)
        if not _is_capacity(exc):
            raise OpenEnvSessionError(f'OpenEnv server {url} cannot open a session: {_describe(exc)} '
                                      f'(env.openenv.{"url" if cfg.url is not None else "launch"})') from None
    finally:
        await _close_client(client, 2.0)


def _app_schema(ref: str) -> Optional[Dict[str, Any]]:
    """``GET /schema`` of a ``launch`` ASGI app, asked in-process (nothing listens on a port);
    ``None`` when the app cannot be imported or asked (the launch itself reports that)."""
    try:
        from fastapi.testclient import TestClient

        module, attr = ref.split(':', 1)
        app = importlib.import_module(module)
        for part in attr.split('.'):
            app = getattr(app, part)
        resp = TestClient(app).get('/schema')
        return resp.json() if resp.status_code == 200 else None
    except Exception:
        return None


def _json_object(text: str) -> Optional[Dict[str, Any]]:
    text = (text or '').strip()
    m = _FENCE.search(text)
    for candidate in ([m.group(1)] if m else []) + [text]:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _server_message(exc: BaseException) -> str:
    msg = str(exc)
    return msg[len('Server error: '):] if msg.startswith('Server error: ') else msg


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return 'timed out'
    text = ' '.join(str(exc).split())
    return f'{type(exc).__name__}: {text}' if text else type(exc).__name__


async def _refusal(client: Any, exc: BaseException) -> BaseException:
    """The server's reason when it closed a new session at once. A server that refuses a session
    (CAPACITY_REACHED, a factory error) sends the error and closes; when our reset crossed that
    close, the client saw only the closed connection, and the error is still unread."""
    if _is_server_reply(exc):
        return exc
    ws = getattr(client, '_ws', None)
    if ws is None:
        return exc
    try:
        raw = await asyncio.wait_for(ws.recv(), 0.5)
        message = json.loads(raw)
    except Exception:
        return exc
    if isinstance(message, dict) and message.get('type') == 'error':
        data = message.get('data') or {}
        return RuntimeError(f"Server error: {data.get('message', 'Unknown error')} (code: {data.get('code', 'UNKNOWN')})")
    return exc


async def _close_client(client: Any, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(client.close(), timeout_s)
    except Exception:
        ws = getattr(client, '_ws', None)
        transport = getattr(ws, 'transport', None)
        if transport is not None:
            transport.abort()


#: pools with launched servers, stopped at interpreter exit if nobody closed them
_LIVE_POOLS: 'weakref.WeakSet[OpenEnvPool]' = weakref.WeakSet()


@atexit.register
def _stop_launched() -> None:
    for pool in list(_LIVE_POOLS):
        for server in pool.servers:
            server.stop(grace_s=2.0)
