"""The gateway: an OpenAI/Anthropic-compatible endpoint whose sessions are request machines.

:class:`Gateway` puts together, in one process:

* the **engine**: an :meth:`mtflow.Executor.stream` whose source yields the first request of
  each session (:class:`~mtflow.gateway.sessions.SessionSource`), whose scheduler's ``step`` is
  the agent's time between calls (:class:`~mtflow.gateway.scheduler.SessionScheduler`) and whose
  ``rollout_fn`` is the backend (the sampling a call asked for merged in). Sessions are driven by
  the engine's one dispatch, as every request is; the trace, policy versions, ``max_staleness``,
  context budgets and ``max_turns`` apply unchanged;
* the **run directory** of ``mtflow run`` (:class:`mtflow.run.store.RunStore`: crash-safe
  ``trajectories.jsonl`` with ``turns`` and segments, ``trace.jsonl``, ``summary.json``), plus
  ``sessions.jsonl``, one line per session opened, so that a resume names the sessions a
  restart cut;
* the **HTTP server** (:class:`~mtflow.gateway.server.GatewayServer`) on its own thread.

Threads: the server's loop, the stream driver's, a consumer that takes each finished session from
the stream, and the writer that writes it (the only thread that writes the run directory).
``docs/gateway.md`` has the session model, the segment rules and what is recorded.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from pathlib import Path
from typing import Any, Dict, List, Optional
from urllib.parse import quote

from mtflow.accounting.token_record import RecordAccounting
from mtflow.backends.base import BackendError, reports_of
from mtflow.backends.pairing import keep_markers
from mtflow.core.machine import CLIENT_FINISHED
from mtflow.core.protocol import RequestConfig
from mtflow.declarative.parsers import get_parser
from mtflow.declarative.parsers.base import json_calls
from mtflow.engine.executor import Executor
from mtflow.engine.stream import Stream
from mtflow.gateway.formats import FORMATS
from mtflow.gateway.responses_api import ResponseStore
from mtflow.gateway.scheduler import SessionScheduler
from mtflow.gateway.server import GatewayServer
from mtflow.gateway.sessions import Finish, Session, SessionTable
from mtflow.gateway.images import CallImages, check_placeholders
from mtflow.gateway.streaming import SafeText, safe_text
from mtflow.gateway.thinking import Thinking
from mtflow.gateway.writer import SessionWriter
from mtflow.gateway.wire import Call, Returned, WireError
from mtflow.run.agent_config import GatewayConfig
from mtflow.run.driver import StreamingRun
from mtflow.run.files import SESSIONS, json_line
from mtflow.run.store import RunStore
from mtflow.run.summary import summarize
from mtflow.run.turn_log import TurnLog

__all__ = ['Gateway', 'SESSIONS_FILE', 'sessions_opened', 'close_failed', 'tools_in_system']

#: one line per session opened (``{"session", "index", "opened"}``), flushed as it opens
SESSIONS_FILE = SESSIONS
#: the batcher's wait for the sessions of the batch that just returned: a quiet gap of this long ...
SETTLE_S = 0.05
#: ... and at most this fraction of that batch's time (:class:`mtflow.backends.batcher.DynamicBatcher`)
SETTLE_FRACTION = 0.5


def sessions_opened(out_dir: Path) -> List[str]:
    """The names in a run directory's ``sessions.jsonl`` (a torn last line is left out)."""
    path = Path(out_dir) / SESSIONS_FILE
    if not path.is_file():
        return []
    names = []
    for line in path.read_text(encoding='utf-8').splitlines():
        try:
            names.append(str(json.loads(line)['session']))
        except (ValueError, KeyError, TypeError):
            continue
    return names


def _merged_config(config: Any, asked: Dict[str, Any], client_sampling: bool) -> Any:
    """The request config of one call: the run's, with the client's ``max_tokens`` (capped by the
    run's) and ``stop`` (added), its ``logprobs`` (and ``top_logprobs``) when it asked for them,
    and its ``temperature``/``top_p``/``seed`` under ``client_sampling``."""
    base = config if config is not None else RequestConfig()
    update: Dict[str, Any] = {}
    if asked.get('logprobs'):
        update['logprobs'] = True
        top = max(getattr(base, 'top_logprobs', None) or 0, asked.get('top_logprobs') or 0)
        update['top_logprobs'] = top or getattr(base, 'top_logprobs', None)
    wanted = asked.get('max_tokens')
    if wanted is not None:
        cap = getattr(base, 'max_tokens', None)
        update['max_tokens'] = min(wanted, cap) if cap else wanted
    if asked.get('stop'):
        update['stop'] = list(dict.fromkeys(list(getattr(base, 'stop', None) or []) + list(asked['stop'])))
    if client_sampling:
        update.update({k: asked[k] for k in ('temperature', 'top_p', 'seed') if k in asked})
    return base.model_copy(update=update) if update else config


class _Executors:
    """``make_executor`` of :class:`mtflow.run.driver.StreamingRun` (whose writer the gateway
    uses): the gateway's one executor, and the turn log that gives each line its ``turns``."""

    def __init__(self, executor: Executor, turn_log: TurnLog) -> None:
        self.executor, self.turn_log = executor, turn_log

    def __call__(self, rollout_fn: Any, on_finished: Any) -> Executor:
        return self.executor


class Gateway:
    """An OpenAI/Anthropic-compatible endpoint in front of ``backend`` that records every session
    in the run directory ``out`` (see the module docstring).

    Args:
        backend: an mtflow backend (``mtflow.backends``: the embedded HF model, vLLM, an
            OpenAI-compatible fleet, scripted) or any ``rollout_fn``.
        out: the run directory; ``mode``: ``'new'``, ``'resume'`` (sessions already written stay;
            the ones an earlier attempt left open are refused as cut) or ``'overwrite'``.
        settings: the ``gateway:`` section (:class:`mtflow.run.agent_config.GatewayConfig`).
        request_config, max_turns, context: the run's sampling, turn bound and context budget
            (:class:`mtflow.ContextBudget`), as for ``mtflow run``.
        store: an open :class:`RunStore` instead of ``out``/``mode`` (``mtflow gateway`` opens it
            before the model loads).
        refuse_cut: refuse the sessions an earlier attempt left open (default); ``False``: they
            may start again (``mtflow run`` with ``agent:`` reruns their episodes).

    ``start()`` (or ``with Gateway(...) as gw:``) serves; :attr:`url` is the address, and
    :meth:`base_url` a session's OpenAI base URL. ``close()`` stops: the sessions in flight finish
    ``interrupted`` (``interrupted.jsonl``), the others are written, ``summary.json`` too.
    """

    def __init__(self, backend: Any, out: Any = None, *, settings: Optional[GatewayConfig] = None,
                 request_config: Any = None, max_turns: Optional[int] = None, context: Any = None,
                 mode: str = 'new', store: Optional[RunStore] = None, fingerprint: Optional[Dict[str, Any]] = None,
                 meta: Optional[Dict[str, Any]] = None, summary_config: Any = None, refuse_cut: bool = True) -> None:
        if store is None and out is None:
            raise ValueError('Gateway: give the run directory (out=) or an open store (store=)')
        self.backend = backend
        self.settings = settings or GatewayConfig()
        self.request_config = request_config
        self.max_turns = max_turns
        self.context = context
        self.model_name = str(getattr(backend, 'model_name', None) or 'mtflow')
        #: the backend and its model in one phrase (``hf (SmolLM2-135M-Instruct on cpu)``): the
        #: serving line and ``GET /v1/models`` name what answers
        self.serves = reports_of(backend).describe() or f'{type(backend).__name__} ({self.model_name})'
        self._store_args = (out, mode, fingerprint, meta)
        self.store = store
        self.summary_config = summary_config
        self.refuse_cut = refuse_cut
        try:
            self.parser = get_parser(self.settings.tool_parser, self.settings.parser_options) \
                if self.settings.tool_parser else None
        except (KeyError, TypeError, ValueError, ImportError) as exc:
            raise BackendError(f'gateway.tool_parser: {exc}') from None
        # the markers the parser reads (harmony's, Kimi-K2's) reach it: the backend keeps them, or the gateway is refused
        self.notes = keep_markers(backend, self.parser, getattr(self.parser, 'special_markers', ())) \
            if self.parser is not None else []
        self.tools_in_system = tools_in_system(self.settings.tools_in_system, self.parser, backend)
        try:
            self.thinking = Thinking(self.settings.reasoning, self.settings.tool_parser,
                                     getattr(backend, 'tokenizer', None))
        except ValueError as exc:
            raise BackendError(str(exc)) from None
        #: who listens to a streaming call's text as the backend generates it (None: the backend does not stream)
        self.sinks = getattr(backend, 'text_sinks', None) if getattr(backend, 'streams_text', False) else None
        self.responses = ResponseStore()
        #: streamed replies whose whole text disagreed with what was sent before it (warned each)
        self.stream_mismatches = 0
        self.images: Optional[CallImages] = None  # made by start(), on the run directory
        self.table: SessionTable = None  # type: ignore[assignment]  # made by start()
        self.stream: Optional[Stream] = None
        self.server: Optional[GatewayServer] = None
        self.run: Optional[StreamingRun] = None
        self.cut: List[str] = []
        self.url = ''
        self.writer: Optional[SessionWriter] = None
        self._sessions_file: Any = None
        self._closers: List[Any] = []
        self._t0 = 0.0
        self.closed = False

    @classmethod
    def from_config(cls, cfg: Any, backend: Any, store: RunStore, *, settings: Optional[GatewayConfig] = None,
                    refuse_cut: bool = True) -> 'Gateway':
        """The gateway of a run config (:class:`mtflow.run.config.RunConfig`: its sampling, turn bound,
        context budget and ``gateway:`` section, or ``settings``) on an open ``store``; not started."""
        return cls(backend, store=store, settings=settings or cfg.gateway, request_config=cfg.make_request_config(),
                   max_turns=cfg.max_turns or None, context=cfg.context_budget(backend), summary_config=cfg,
                   refuse_cut=refuse_cut)

    # ---- starting --------------------------------------------------------------------------------
    def start(self) -> 'Gateway':
        if self.store is None:
            out, mode, fingerprint, meta = self._store_args
            self.store = RunStore.open(out, mode, fingerprint, meta={**(meta or {}), 'gateway': True})
        store = self.store
        self.images = CallImages(store.images)
        opened = sessions_opened(store.out_dir)
        self.cut = [name for name in opened if name not in store.done]
        table = self.table = SessionTable(self.settings.open_on_call, cut=set(self.cut) if self.refuse_cut else None,
                                          on_open=self._log_open, is_done=store.is_done)
        table.next_index = len(opened)
        self._sessions_file = open(Path(store.out_dir) / SESSIONS_FILE, 'a', encoding='utf-8')
        turn_log = TurnLog()
        reports = reports_of(self.backend)  # as mtflow run wires them (run.driver.roll_out)
        turn_log.on_finish = reports.forget
        turn_log.known_digest = reports.known_digest
        executor = Executor(SessionScheduler(table, self.parser, self.settings.idle_timeout_s, self.thinking),
                            turn_log.wrap(self._rollout_fn()), self.request_config, max_turns=self.max_turns or None,
                            on_error='return', accounting=RecordAccounting(), context=self.context,
                            step_timeout_s=None, rollout_timeout_s=self.settings.rollout_timeout_s)
        self.executor = executor
        self.run = StreamingRun(_Executors(executor, turn_log), self.backend, store, 1)
        self._t0 = time.perf_counter()
        sessions = self.settings.max_sessions
        self.stream = executor.stream(table.source, max_concurrency=sessions, buffer=sessions,
                                      max_staleness=self.settings.max_staleness, stale='drop')
        table.wake = self.stream.poke
        self.writer = SessionWriter(self.stream, table, self.run, self.settings.finish_grace_s,
                                    time.time() - store.started_unix, self.settings.idle_timeout_s)
        self.writer.start()
        self.server = GatewayServer(self, self.settings.host, self.settings.port, self.settings.max_body_bytes,
                                    self.settings.session_header)
        try:
            port = self.server.start()
        except BaseException:
            self.close('failed')
            raise
        host = self.settings.host
        self.url = f'http://{"127.0.0.1" if host in ("0.0.0.0", "") else host}:{port}'
        return self

    def _rollout_fn(self) -> Any:
        """The backend as the stream's ``rollout_fn``: its own async path, or a dynamic batcher
        that sends at once, except while the sessions of the batch that just returned are coming
        back: then it waits for them (a quiet gap of ``settle_s``) at most a fraction of that
        batch's own time, so sessions do not settle into groups that never merge (a backend as
        fast as the scripted one waits next to nothing); each call's sampling merged in."""
        backend, client = self.backend, self.settings.client_sampling
        make = getattr(backend, 'async_rollout_fn', None)
        inner = make(max_wait_s=0.0, settle_s=SETTLE_S, settle_fraction=SETTLE_FRACTION) if callable(make) else backend
        if inner is not backend and callable(getattr(inner, 'close', None)):
            self._closers.append(inner.close)
        gateway = self

        async def rollout(requests: List[Any], request_config: Any = None) -> Any:
            table = gateway.table
            if requests:
                call = table.current_call(str(requests[0].uuid))
                asked = dict(call.sampling) if call is not None else {}
                if call is not None and call.logprobs is not None:  # the client asked for logprobs: computed
                    asked.update(logprobs=True, top_logprobs=call.logprobs or None)
                if asked:
                    request_config = _merged_config(request_config, asked, client)
            try:
                value = inner(requests, request_config)
                outputs = await value if hasattr(value, '__await__') else value
            except Exception as exc:  # its sessions fail; the call still waiting is told why
                for request in requests:
                    table.failed(str(request.uuid), f'{type(exc).__name__}: {exc}')
                raise
            for request, out in zip(requests, outputs):
                if isinstance(out, BaseException):
                    table.failed(str(request.uuid), f'{type(out).__name__}: {out}')
            return outputs

        def forget(uuid: str) -> None:
            gateway._released(uuid)

        rollout.forget = forget  # type: ignore[attr-defined]  # the stream's forget_fn finds it
        rollout.__wrapped__ = backend  # type: ignore[attr-defined]  # context budgets read the backend
        return rollout

    def __enter__(self) -> 'Gateway':
        return self.start() if self.server is None else self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- what the server asks ----------------------------------------------------------------------
    def base_url(self, session: str, api: str = 'openai') -> str:
        """A session's base URL: the OpenAI one (``.../v1``), or the Anthropic one (the name
        percent-encoded: a ``num_generations`` copy's ``#`` would start a fragment)."""
        return f'{self.url}/s/{quote(session, safe="")}' + ('/v1' if api == 'openai' else '')

    def response_id(self, api: str) -> str:
        return FORMATS[api].new_id()

    def parse_call(self, name: str, body: Any, api: str, previous: Optional[Any] = None) -> Call:
        """A request body of ``api`` (:data:`.formats.FORMATS`) as session ``name``'s call;
        ``previous``: the kept ``(session, messages, images)`` a Responses call continues."""
        session = self.table.get(name)
        returned = session.returned if session is not None else Returned()  # a new session: nothing returned yet
        render = self.parser.render_calls if self.parser is not None else json_calls
        call = FORMATS[api].parse(body, returned, render, previous[1:] if previous is not None else None)
        check_placeholders(call)
        if api == 'responses':  # what previous_response_id continues: as the client wrote it, before the tools' text
            call.echo['conversation'] = call.messages[call.echo.get('prefix', 0):]
        if call.tools and self.tools_in_system:
            call.messages = _with_tools(call.messages, self.parser.render_tools(call.tools))
        return call

    def safe_text(self, call: Call) -> SafeText:
        """What of a streaming call's growing reply can go out now (:class:`.streaming.SafeText`)."""
        return safe_text(call, self.thinking, self.parser, getattr(self.request_config, 'stop', None))

    def open_session(self, name: Optional[str] = None, *, key: bool = False,
                     data: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Open a session (any thread): ``{session, base_url, anthropic_base_url, api_key}``."""
        session = self.table.open(name, key=key, data=data)
        return {'session': session.name, 'base_url': self.base_url(session.name),
                'anthropic_base_url': self.base_url(session.name, 'anthropic'), 'api_key': session.key}

    def post_finish(self, name: str, finish: Finish, key: Optional[str], loop: Any, fut: Any) -> None:
        parked = self.table.post_finish(name, finish, key, loop, fut)
        if parked is not None:  # ended by a limit, waiting for this reward: written now
            self.writer.parked(name, parked)

    def finish(self, name: str, reward: Optional[float] = None, info: Optional[Dict[str, Any]] = None, *,
               reason: str = CLIENT_FINISHED, key: Optional[str] = None, timeout: Optional[float] = None) -> Any:
        """End session ``name`` from any thread but the server's; returns the written summary
        (raises :class:`~mtflow.gateway.wire.WireError` as the HTTP finish answers it)."""
        async def wait() -> Any:
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            self.post_finish(name, Finish(reward, dict(info or {}), reason), key, loop, fut)
            return await asyncio.wait_for(fut, timeout)

        result = asyncio.run(wait())
        if isinstance(result, WireError):
            raise result
        return result

    def set_policy_version(self, version: Any) -> None:
        """The version of the weights the backend serves from now on (any thread; forward only)."""
        self.executor.set_policy_version(version)

    # ---- sessions log ---------------------------------------------------------------------------
    def _log_open(self, session: Session) -> None:
        f = self._sessions_file
        if f is not None and not f.closed:
            f.write(json_line({'session': session.name, 'index': session.index, 'opened': round(time.time(), 3)})
                    + '\n')
            f.flush()

    def _released(self, uuid: str) -> None:
        """The stream is done with session ``uuid``'s request (it is written, or was dropped as too
        stale: then its client is told): the backend forgets what it kept for it."""
        session = self.table.get(uuid) if self.table is not None else None
        if session is not None and session.reason is None:
            self.table.dropped(uuid, f'its oldest turn is more than gateway.max_staleness='
                                     f'{self.settings.max_staleness} policy versions old')
            self.run.turn_log.drop(uuid)
        self.responses.drop_session(uuid)
        reports_of(self.backend).forget(uuid)
        prompter = getattr(self.backend, 'prompter', None)  # its token record, kept by uuid (HF, vLLM)
        if prompter is not None and callable(getattr(prompter, 'forget', None)):
            prompter.forget(uuid)

    # ---- stopping ---------------------------------------------------------------------------------
    @property
    def written(self) -> int:
        """Sessions written by this attempt."""
        return self.writer.written if self.writer is not None else 0

    def figures(self) -> Dict[str, Any]:
        stats = self.stream.stats if self.stream is not None else {}
        return {'rollout_fn_calls': stats.get('rollout_fn_calls', 0), 'stream_mismatches': self.stream_mismatches,
                'wall_s': round(time.perf_counter() - self._t0, 3),
                'sessions_written': self.written, 'sessions_cut_before': len(self.cut),
                'dropped_stale': stats.get('dropped_groups', 0), 'write_s': round(self.store.fsync_s, 4)
                if self.store is not None else None}

    def close(self, status: Optional[str] = None, total: Optional[int] = None,
              extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Stop serving: new calls are refused, sessions in flight finish ``interrupted``
        (their waiting calls get a 503), every finished session is written, then ``summary.json``
        (``status``: default ``complete``, or ``interrupted`` when sessions were cut; ``total``: the
        requests the run meant to roll out, default those written and cut; ``extra``: more figures
        for the summary). Returns the figures."""
        if self.closed:
            return {}
        self.closed = True
        if self.table is not None:
            self.table.shut()
        if self.stream is not None:
            self.stream.stop(interrupt=True)
        if self.writer is not None:
            self.writer.join()
        if self.server is not None:
            self.server.stop()
        for close in self._closers:
            close()
        if self._sessions_file is not None:
            self._sessions_file.close()
        figures = self.figures()
        if self.store is not None and not self.store.closed:
            interrupted = self.store.interrupted
            final = status or ('interrupted' if interrupted else 'complete')
            summary = self._summary(figures, total, extra) if final != 'failed' else None
            self.store.close(final, summary, attempt=figures)
            figures['status'] = final
            figures['summary'] = summary
        if self.writer is not None and self.writer.error is not None:
            raise self.writer.error
        return figures

    def _summary(self, figures: Dict[str, Any], total: Optional[int],
                 extra: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        total = total if total is not None else len(self.store.done) + self.store.interrupted
        summary = summarize(self.summary_config, self.backend, self.store, total, figures, 0.0)
        summary['gateway'] = {'url': self.url, 'sessions_written': self.written, 'cut_before': self.cut}
        return {**summary, **(extra or {})}


def tools_in_system(mode: str, parser: Any, backend: Any) -> bool:
    """Whether the client's tools go into the system prompt (the parser's text): ``always``,
    or ``auto`` when the chat template does not render a tool list itself."""
    if mode != 'auto' or parser is None:
        return mode == 'always' and parser is not None
    tok = getattr(backend, 'tokenizer', None)
    if tok is None or not getattr(tok, 'chat_template', None):
        return False  # an OpenAI server renders the tools itself
    probe = [{'type': 'function', 'function': {'name': 'mtflow_probe_tool', 'parameters': {}}}]
    try:
        text = tok.apply_chat_template([{'role': 'user', 'content': 'q'}], tools=probe, tokenize=False,
                                       add_generation_prompt=True)
    except Exception:
        return True
    return 'mtflow_probe_tool' not in text


def close_failed(gateway: Optional[Gateway], store: RunStore) -> None:
    """Something failed while serving: the gateway closes as ``failed`` (what finished is written),
    or, when it never started, the fresh run directory is removed."""
    if gateway is not None:
        gateway.close('failed')
    else:
        store.discard()


def _with_tools(messages: List[Dict[str, Any]], text: str) -> List[Dict[str, Any]]:
    """The tools' text at the end of the first system message (one added before the rest when
    there is none)."""
    if messages and messages[0].get('role') == 'system':
        first = dict(messages[0], content=f'{messages[0].get("content") or ""}\n\n{text}'.lstrip())
        return [first] + messages[1:]
    return [{'role': 'system', 'content': text}] + messages

