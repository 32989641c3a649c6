"""NeMo Gym resources servers as YAML environments: NeMo Gym's simple agent loop, with mtflow
holding the model (and so its exact tokens) and the server doing what it does for NeMo Gym.

Per request (one HTTP session with its own cookies, which is how a resources server tells its
sessions apart):

- **reset**: ``POST /seed_session`` with the request's row (its ``data_dict``: a NeMo Gym JSONL
  row's ``responses_create_params`` and the task's own fields, e.g. ``expected_count``). The
  tools the model sees are the row's (``responses_create_params.tools``, which the dataset reader
  turns into the request's ``tools``), each checked against the server's own routes
  (``GET /openapi.json``); a row without tools gets the server's routes as tools.
- **step**: the completion's tool calls (read with ``parser``) are each ``POST /<tool>`` with
  their arguments; the response body, whatever its status, is the tool's output (NeMo Gym's
  agent does the same: a server's error is something the model should read), all of a turn's
  outputs one observation. A completion without a tool call ends the episode: ``POST /verify``
  with the row and the whole episode as a Responses API response (``function_call``,
  ``function_call_output`` and ``message`` items, as NeMo Gym's agent accumulates them); its
  ``reward`` is the step's reward, its other fields go to ``env_info``.
- **close**: the HTTP session is closed.

A server that cannot be reached, a ``seed_session`` or ``verify`` that fails (a status >= 400),
a row naming a tool the server does not serve: that request fails with :class:`EnvFailure`
(kind ``NeMo Gym``), naming the server, the step and the server's answer; the others go on.

``launch`` starts the server in NeMo Gym's own Python (``python``: it needs 3.13, so usually a
venv of its own) with ``nemo_gym_serve.py`` on a free port of 127.0.0.1, the way NeMo Gym's own
tests build a resources server (its ``run_webserver`` needs the whole NeMo Gym run: a head
server, Hydra, Ray).
"""
from __future__ import annotations

import asyncio
import atexit
import copy
import itertools
import json
import os
import sys
import threading
import time
import urllib.request
import weakref
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from mtflow.core.errors import MtflowError
from mtflow.declarative.envs.base import EnvFailure, StepOutcome, require
from mtflow.declarative.envs.config import NemoGymConfig
from mtflow.declarative.envs.local_servers import IOLoop, LocalServer, child_env, launch_local, wait_healthy
from mtflow.declarative.parsers import get_parser

__all__ = ['NemoGymPool', 'NemoGymSession', 'server_tools', 'KIND']

KIND = 'NeMo Gym'
#: routes of every resources server that are not tools (NeMo Gym's own reserved names, and ours)
RESERVED = frozenset({'verify', 'seed_session', 'close_session', 'aggregate_metrics', 'mcp', 'reverify_mode', 'health'})
#: the fields of the verify answer that only echo what was sent
_ECHOED = ('responses_create_params', 'response', 'reward')
SERVE_SCRIPT = Path(__file__).with_name('nemo_gym_serve.py')


class NemoGymError(MtflowError):
    """The resources server could not be started or asked."""


def server_tools(openapi: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """``{name: chat-completions tool}`` of a resources server's tool routes (``POST /<name>``
    with a JSON body), from its OpenAPI document; the body's schema is the tool's parameters."""
    schemas = (openapi.get('components') or {}).get('schemas') or {}
    out: Dict[str, Dict[str, Any]] = {}
    for path, ops in (openapi.get('paths') or {}).items():
        name = path.strip('/')
        post = ops.get('post') if isinstance(ops, dict) else None
        if not post or not name or '/' in name or '{' in name or name in RESERVED:
            continue
        body = (((post.get('requestBody') or {}).get('content') or {}).get('application/json') or {}).get('schema')
        params = _inline(body, schemas) if body else {'type': 'object', 'properties': {}}
        out[name] = {'type': 'function', 'function': {
            'name': name, 'description': post.get('description') or post.get('summary') or '', 'parameters': params}}
    return out


def _inline(schema: Any, schemas: Dict[str, Any], depth: int = 0) -> Any:
    """``schema`` with its ``#/components/schemas/...`` references replaced by what they name."""
    if depth > 20:
        return schema
    if isinstance(schema, dict):
        ref = schema.get('$ref')
        if isinstance(ref, str) and ref.startswith('#/components/schemas/'):
            return _inline(schemas.get(ref.rsplit('/', 1)[1], {}), schemas, depth + 1)
        return {k: _inline(v, schemas, depth + 1) for k, v in schema.items() if k != 'title'}
    if isinstance(schema, list):
        return [_inline(v, schemas, depth + 1) for v in schema]
    return schema


class NemoGymPool:
    """The server of one ``env: {nemo_gym: ...}`` section, shared by its requests; calling it makes
    a :class:`NemoGymSession`. Nothing starts until the first session opens."""

    def __init__(self, config: NemoGymConfig, base_dir: Optional[str] = None) -> None:
        require('aiohttp', 'nemo-gym')
        self.config = config
        self.base_dir = base_dir
        self.parser = get_parser(config.parser, config.parser_options, base_dir)
        self.server: Optional[LocalServer] = LocalServer(config.url) if config.url else None
        self.tools: Optional[Dict[str, Dict[str, Any]]] = None
        self.io = IOLoop('mtflow-nemo-gym-io', lambda: NemoGymError('the NeMo Gym pool is closed'))
        self._lock = threading.Lock()
        self._start_error: Optional[BaseException] = None
        self._ids = itertools.count(1)

    def __call__(self) -> 'NemoGymSession':
        return NemoGymSession(self)

    @property
    def name(self) -> str:
        return self.config.launch or self.config.url or ''

    def python(self) -> str:
        py = self.config.python
        if py is None:
            return sys.executable
        path = Path(os.path.expanduser(py))
        if not path.is_absolute() and self.base_dir:
            path = Path(self.base_dir) / path
        return str(path)

    def problems(self) -> List[Tuple[str, str]]:
        """What ``mtflow validate`` checks without starting anything: the launch Python exists."""
        if self.config.launch is not None:
            py = self.python()
            if not os.access(py, os.X_OK):
                return [('python', f'{py} is not an executable Python (NeMo Gym needs Python 3.13: make a venv '
                                   'with nemo-gym, docs/environments.md)')]
        return []

    def start(self) -> None:
        """Launch the server (``launch``), wait for ``/health``, read its tools; idempotent."""
        with self._lock:
            if self._start_error is not None:
                raise self._start_error
            if self.tools is not None:
                return
            try:
                if self.server is None:
                    command = lambda port: [self.python(), str(SERVE_SCRIPT), self.config.launch, str(port)]
                    env = child_env(self.base_dir, same_python=self.config.python is None)
                    self.server = launch_local(command, env, self.base_dir, 'mtflow-nemo-gym-')
                    _LIVE_POOLS.add(self)
                    wait_healthy(self.server, self.config.startup_timeout_s, f'NeMo Gym server {self.config.launch!r}',
                                 NemoGymError)
                self.tools = server_tools(_get_json(f'{self.server.url}/openapi.json', self.config.request_timeout_s))
            except BaseException as exc:
                if self.server is not None:
                    self.server.stop()
                self._start_error = exc if isinstance(exc, NemoGymError) else NemoGymError(
                    f'NeMo Gym server {self.name!r}: {type(exc).__name__}: {exc}')
                raise self._start_error from None

    def close(self) -> None:
        self.io.close()
        if self.server is not None:
            self.server.stop()
        _LIVE_POOLS.discard(self)


def _get_json(url: str, timeout_s: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


class NemoGymSession:
    """One request's episode on the server (its own cookies); the scheduler's environment."""

    def __init__(self, pool: NemoGymPool) -> None:
        self.pool = pool
        self.http: Any = None
        self.row: Dict[str, Any] = {}
        self.output: List[Dict[str, Any]] = []
        self.steps = 0

    # ---- the protocol (async; the HTTP session lives on the pool's loop) -------------------------
    async def reset(self, infer_request: Any) -> Optional[str]:
        try:
            await asyncio.to_thread(self.pool.start)
        except NemoGymError as exc:
            raise EnvFailure(KIND, self.pool.name, 'to start', exc) from None
        self.row = _row(infer_request)
        served = self.pool.tools or {}
        if infer_request.tools:
            names = [t.get('function', t).get('name') for t in infer_request.tools if isinstance(t, dict)]
            unknown = [n for n in names if n not in served]
            if unknown:
                raise EnvFailure(KIND, self.pool.name, 'at reset', NemoGymError(
                    f'the row names tool(s) {", ".join(map(repr, unknown))} that the server does not serve; it serves: '
                    + (', '.join(sorted(served)) or 'no tools')))
        else:
            infer_request.tools = list(served.values())
        self.row.setdefault('responses_create_params', {'input': _input_items(infer_request.messages),
                                                        'tools': [dict(t['function'], type='function', strict=False)
                                                                  for t in infer_request.tools]})
        await self.pool.io.run(self._seed())
        return None

    async def step(self, action: str) -> StepOutcome:
        self.steps += 1
        return await self.pool.io.run(self._step(action))

    async def close(self) -> None:
        http, self.http = self.http, None
        if http is not None:
            await self.pool.io.run(http.close())

    # ---- on the pool's loop ---------------------------------------------------------------------
    async def _post(self, route: str, body: Any, where: str) -> Tuple[int, str]:
        import aiohttp
        try:
            async with self.http.post(f'{self.pool.server.url}/{route}', json=body) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise EnvFailure(KIND, self.pool.name, where, NemoGymError(
                f'{self.pool.server.url}/{route}: {type(exc).__name__}: {exc}')) from None

    async def _seed(self) -> None:
        import aiohttp
        self.http = aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True),
                                          timeout=aiohttp.ClientTimeout(total=self.pool.config.request_timeout_s))
        status, text = await self._post('seed_session', self.row, 'at seed_session')
        if status >= 400:
            raise EnvFailure(KIND, self.pool.name, 'at seed_session', NemoGymError(f'status {status}: {text[:500]}'))

    async def _step(self, action: str) -> StepOutcome:
        calls = list(self.pool.parser.parse(action))
        if not calls:
            return await self._verify(action)
        texts = []
        for call in calls:
            if call.error is not None:  # as NeMo Gym's agent answers arguments it cannot read
                texts.append(json.dumps({'error': f'Invalid tool call: {call.error}'}))
                continue
            call_id = f'call_{next(self.pool._ids)}'
            arguments = call.arguments if isinstance(call.arguments, dict) else {}
            self.output.append({'type': 'function_call', 'name': call.name, 'arguments': json.dumps(arguments),
                                'call_id': call_id, 'id': f'fc_{call_id}', 'status': 'completed'})
            _, text = await self._post(call.name, arguments, f'at step {self.steps} (tool {call.name!r})')
            self.output.append({'type': 'function_call_output', 'call_id': call_id, 'output': text})
            texts.append(text)
        return StepOutcome('\n'.join(texts), 0.0, False, False, {})

    async def _verify(self, text: str) -> StepOutcome:
        content = [{'type': 'output_text', 'text': text, 'annotations': []}]
        self.output.append({'type': 'message', 'role': 'assistant', 'id': f'msg_{next(self.pool._ids)}',
                            'status': 'completed', 'content': content})
        response = {'id': f'resp_{next(self.pool._ids)}', 'created_at': int(time.time()), 'model': 'mtflow',
                    'object': 'response', 'output': copy.deepcopy(self.output), 'parallel_tool_calls': True,
                    'tool_choice': 'auto', 'tools': self.row['responses_create_params'].get('tools') or []}
        status, body = await self._post('verify', {**self.row, 'response': response}, f'at verify (step {self.steps})')
        try:
            answer = json.loads(body)
            reward = float(answer['reward'])
        except (ValueError, KeyError, TypeError):
            answer, reward = None, None
        if status >= 400 or reward is None:
            raise EnvFailure(KIND, self.pool.name, f'at verify (step {self.steps})',
                             NemoGymError(f'status {status}: {body[:500]}'))
        info = {k: v for k, v in answer.items() if k not in _ECHOED and k not in self.row}
        return StepOutcome('', reward, True, False, info)


def _row(infer_request: Any) -> Dict[str, Any]:
    """The NeMo Gym row of a request: its ``data_dict`` without mtflow's own keys."""
    data = dict(getattr(infer_request, 'data_dict', None) or {})
    for key in ('group', 'seed'):
        data.pop(key, None)
    return data


def _input_items(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [{'role': 'developer' if m.get('role') == 'system' else m.get('role'), 'content': m.get('content') or ''}
            for m in messages if m.get('role') in ('system', 'user', 'assistant')]


#: pools with a launched server, stopped at interpreter exit if nobody closed them
_LIVE_POOLS: 'weakref.WeakSet[NemoGymPool]' = weakref.WeakSet()


@atexit.register
def _stop_launched() -> None:
    for pool in list(_LIVE_POOLS):
        if pool.server is not None:
            pool.server.stop(grace_s=2.0)
