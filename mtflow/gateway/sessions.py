"""Gateway sessions: what the HTTP side and the engine's one loop share about each session.

A session is one request machine of the gateway's stream (``mtflow.engine.stream``). Its first
call becomes the request a :class:`SessionSource` hands the stream; every later call, and the
finish, are *events* the session's ``step`` awaits (:meth:`SessionTable.next_event`: the agent's
time between calls is that step); each output goes back to the waiting call from ``on_turn_end``
(:meth:`SessionTable.reply`), and the end of the request reaches the session from
``on_request_finished`` (:meth:`SessionTable.ended`), so a call still waiting gets the error an
OpenAI client expects.

Two threads meet here: the HTTP server's loop (calls, finishes) and the stream driver's (steps,
replies). One lock guards the table; a future of the other side's loop is resolved with
``call_soon_threadsafe`` and never by the thread that does not own it.
"""
from __future__ import annotations

import asyncio
import hmac
import secrets
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from mtflow.core.machine import (CONTEXT_FULL, ERROR, IDLE_TIMEOUT, INTERRUPTED, LENGTH_TOTAL, MAX_TURNS,
                                 REPLAY_DIVERGED, TIMEOUT)
from mtflow.core.protocol import RolloutInferRequest
from mtflow.engine.stream import NOTHING_YET
from mtflow.gateway.wire import Call, Reply, Returned, WireError

__all__ = ['Finish', 'Session', 'SessionTable', 'SessionSource', 'ENDED_KEEP', 'CLOSING']

#: how many ended sessions' reasons are kept for the error of a later call or finish (older ones get a plain
#: "already finished": the run directory knows every name written)
ENDED_KEEP = 4096
#: the event a waiting step gets when the gateway shuts down (its request is then interrupted)
CLOSING = 'closing'
#: the event a waiting step gets past the idle timeout
IDLE = 'idle'
#: why a session's calls are refused once its stream group was dropped as too stale
STALE = 'stale'
#: why a session's calls are refused once its finished line could not be written
NOT_WRITTEN = 'not_written'


@dataclass
class Finish:
    """The client ended its session: its reward and info; ``reason`` its finish reason."""
    reward: Optional[float]
    info: Dict[str, Any]
    reason: str


@dataclass
class Session:
    """One session (see the module docstring). Everything here is read and written under the
    table's lock."""
    name: str
    index: int
    key: Optional[str] = None
    data: Dict[str, Any] = field(default_factory=dict)
    #: calls and the finish posted and not yet taken by the step, in order
    events: Deque[Any] = field(default_factory=deque)
    #: the step awaiting the next event: ``(loop, future)``
    waiter: Optional[Tuple[asyncio.AbstractEventLoop, asyncio.Future]] = None
    #: the call being answered now, with the HTTP side's ``(loop, future)``
    current: Optional[Tuple[Call, asyncio.AbstractEventLoop, asyncio.Future]] = None
    returned: Returned = field(default_factory=Returned)
    started: bool = False  # its first call went to the stream
    turns: int = 0
    reason: Optional[str] = None  # set when its request finished
    finish: Optional[Finish] = None  # the client's finish, once given
    #: the request's messages after the last turn (what an agent's verifier reads)
    transcript: List[Dict[str, Any]] = field(default_factory=list)
    #: futures of finish calls waiting for the trajectory to be written
    written_waiters: List[Tuple[asyncio.AbstractEventLoop, asyncio.Future]] = field(default_factory=list)
    written: Optional[Dict[str, Any]] = None
    #: the finished output waiting for the client's reward (the session ended by a limit)
    parked: Any = None
    parked_at: float = 0.0
    waiting_since: float = 0.0  # when its step began to wait for the next call
    failure: Optional[str] = None  # why its model call failed, for the error its client gets


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, value: Any) -> None:
    """Resolve ``fut`` on its own loop, from any thread (a future cancelled meanwhile, e.g. by a
    client that went away, is left alone; a closed loop is nobody's any more)."""
    def settle() -> None:
        if not fut.done():
            fut.set_result(value)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass


#: finish reasons a client sees as an error on a call still waiting, with the HTTP status
_ENDED_STATUS = {CONTEXT_FULL: (400, 'context_length_exceeded'), LENGTH_TOTAL: (400, 'length_total'),
                 MAX_TURNS: (400, 'max_turns'), IDLE_TIMEOUT: (408, 'idle_timeout'), TIMEOUT: (504, 'timeout'),
                 ERROR: (500, 'error'), INTERRUPTED: (503, 'interrupted'), REPLAY_DIVERGED: (409, 'replay_diverged'),
                 STALE: (409, 'stale')}


def ended_error(name: str, reason: str, detail: str = '') -> WireError:
    """The error a call on session ``name`` gets once it ended with ``reason``."""
    status, code = _ENDED_STATUS.get(reason, (409, 'session_finished'))
    text = f'session {name!r} has ended ({reason})'
    if reason == CONTEXT_FULL:
        text = f'session {name!r}: the prompt does not fit the context budget ({reason}); the session has ended'
    return WireError(status, text + (f': {detail}' if detail else ''), code=code)


def finished_error(name: str, reason: Optional[str], detail: Optional[str] = None) -> WireError:
    """The error of a call or finish that comes after session ``name`` ended (a 409)."""
    why = f' ({reason}{": " + detail if detail else ""})' if reason else ''
    limit = (reason or '').split(':')[0]
    if limit in (MAX_TURNS, CONTEXT_FULL, LENGTH_TOTAL):  # a bound of the run ended it: the client hears it now
        return WireError(400, f'session {name!r} has ended: it reached the run\'s {limit} bound',
                         code=_ENDED_STATUS[limit][1])
    return WireError(409, f'session {name!r} has already finished{why}; start a new session', code='session_finished')


class SessionSource:
    """The gateway stream's source: the first request of each new session, else
    :data:`~mtflow.engine.stream.NOTHING_YET` (the table pokes the stream when a session comes)."""

    def __init__(self) -> None:
        self.pending: Deque[RolloutInferRequest] = deque()
        self.closed = False

    def __iter__(self) -> 'SessionSource':
        return self

    def __next__(self) -> Any:
        try:
            return self.pending.popleft()
        except IndexError:
            if self.closed:
                raise StopIteration from None
            return NOTHING_YET


class SessionTable:
    """Every live session of one gateway, by name and by key (see the module docstring).

    Args:
        open_on_call: a call to an unknown session opens it (else: 404 unless opened first).
        wake: pokes the stream (a new session is in the source).
        cut: names of sessions an earlier attempt left open (a restart cut them): refused.
        is_done: whether a name was written (refused too).
    """

    def __init__(self, open_on_call: bool = True, wake: Optional[Callable[[], None]] = None,
                 cut: Optional[set] = None, on_open: Optional[Callable[[Session], None]] = None,
                 is_done: Optional[Callable[[str], bool]] = None) -> None:
        self.lock = threading.Lock()
        self.sessions: Dict[str, Session] = {}
        self.by_key: Dict[str, str] = {}
        self.ended_names: 'OrderedDict[str, str]' = OrderedDict()
        self.source = SessionSource()
        self.open_on_call = open_on_call
        self.wake = wake
        self.cut = set(cut or ())
        self.on_open = on_open
        #: whether a session of that name is written (the run directory's own set: every attempt's)
        self.is_done: Callable[[str], bool] = is_done or (lambda name: False)
        self.next_index = 0
        self.closing = False

    # ---- opening ------------------------------------------------------------------------------
    def _refuse_old(self, name: str) -> None:
        if name in self.cut:
            raise WireError(409, f'session {name!r} was cut by a restart of the gateway (its turns were not '
                            'written); start a new session', code='session_cut')
        if name in self.ended_names or self.is_done(name):
            raise finished_error(name, self.ended_names.get(name))

    def open(self, name: Optional[str] = None, *, key: bool = False, data: Optional[Dict[str, Any]] = None) -> Session:
        """Open a session (``name``: default a fresh one); ``key``: give it an API key of its own,
        which every call and its finish must then present. A name in use is a 409."""
        with self.lock:
            if self.closing:
                raise WireError(503, 'the gateway is shutting down', code='shutting_down')
            name = name or f's{secrets.token_hex(6)}'
            if name in self.sessions:
                raise WireError(409, f'session {name!r} is already open', code='session_exists')
            self._refuse_old(name)
            return self._add(name, f'mtk-{secrets.token_urlsafe(24)}' if key else None, data)

    def _add(self, name: str, key: Optional[str], data: Optional[Dict[str, Any]]) -> Session:
        session = Session(name, self.next_index, key, dict(data or {}))
        self.next_index += 1
        self.sessions[name] = session
        if key:
            self.by_key[key] = name
        if self.on_open is not None:
            self.on_open(session)
        return session

    def named_by_key(self, key: str) -> Optional[str]:
        with self.lock:
            return self.by_key.get(key)

    def check_key(self, session: Session, given: Optional[str]) -> None:
        """A session with a key answers only to it (a key of another session is refused the same)."""
        if session.key is not None and (given is None or not hmac.compare_digest(session.key, given)):
            raise WireError(401, f'session {session.name!r} needs its own API key', code='invalid_api_key')

    def get(self, name: str) -> Optional[Session]:
        return self.sessions.get(name)

    # ---- the HTTP side ----------------------------------------------------------------------------
    def post_call(self, name: str, call: Call, key: Optional[str], loop: asyncio.AbstractEventLoop,
                  fut: asyncio.Future) -> None:
        """Hand one call to session ``name`` (opened now when it is new and calls open sessions);
        ``fut`` (of ``loop``) gets the :class:`Reply` or a :class:`WireError`."""
        with self.lock:
            session = self.sessions.get(name)
            if session is None:
                self._refuse_old(name)
                if self.closing:
                    raise WireError(503, 'the gateway is shutting down', code='shutting_down')
                if not self.open_on_call:
                    raise WireError(404, f'no session {name!r}: open it first (POST /sessions)',
                                    code='session_not_found')
                session = self._add(name, None, None)
            self.check_key(session, key)
            if session.reason is not None or session.finish is not None:
                raise finished_error(name, session.reason or session.finish.reason, session.failure)
            if not session.started:
                session.started = True
                session.current = (call, loop, fut)
                data = dict(session.data)
                data.setdefault('session', name)
                self.source.pending.append(RolloutInferRequest(uuid=name, messages=call.messages, tools=call.tools,
                                                               images=list(call.images), data_dict=data))
                wake = self.wake
            else:
                wake = None
                self._post(session, (call, loop, fut))
        if wake is not None:
            wake()

    def post_finish(self, name: str, finish: Finish, key: Optional[str], loop: asyncio.AbstractEventLoop,
                    fut: asyncio.Future) -> Optional[Any]:
        """The client ends session ``name``: posted to its step, or (the session already ended by
        a limit) given to its parked output, which is returned to be written now. ``fut`` gets
        the written trajectory's summary."""
        with self.lock:
            session = self.sessions.get(name)
            if session is None:
                if name in self.ended_names or self.is_done(name):
                    raise finished_error(name, self.ended_names.get(name))
                if name in self.cut:
                    self._refuse_old(name)
                raise WireError(404, f'no session {name!r}', code='session_not_found')
            self.check_key(session, key)
            if session.finish is not None:
                raise finished_error(name, session.finish.reason)
            if not session.started:  # no call was ever made: nothing to record
                del self.sessions[name]
                self.by_key.pop(session.key or '', None)
                self._remember(name, finish.reason)
                raise WireError(409, f'session {name!r} made no model call: there is no trajectory to finish',
                                code='no_calls')
            session.finish = finish
            session.written_waiters.append((loop, fut))
            if session.written is not None:
                _resolve(loop, fut, session.written)
                return None
            if session.parked is not None:
                parked, session.parked = session.parked, None
                return parked
            if session.reason is None:
                self._post(session, finish)
            return None

    def _post(self, session: Session, event: Any) -> None:
        waiter, session.waiter = session.waiter, None
        if waiter is not None:
            _resolve(waiter[0], waiter[1], event)
        else:
            session.events.append(event)

    # ---- the engine's side ------------------------------------------------------------------------
    async def next_event(self, name: str) -> Any:
        """The session's next call or finish, awaited in its step on the driver's loop; ``None``
        when it waited past the idle timeout (:meth:`idle`, one sweep for every session: no timer
        per step, whose cancelled handles would hold each call until the loop purges them)."""
        loop = asyncio.get_running_loop()
        with self.lock:
            session = self.sessions[name]
            if session.events:
                return self._take(session, session.events.popleft())
            if self.closing:
                return CLOSING
            fut = loop.create_future()
            session.waiter = (loop, fut)
            session.waiting_since = time.monotonic()
        event = await fut
        if event is IDLE:
            return None
        with self.lock:
            return self._take(session, event)

    def idle(self, timeout_s: float) -> int:
        """Every step that has waited for its session's next call longer than ``timeout_s``
        gets ``None`` (the idle timeout); how many."""
        now = time.monotonic()
        due = []
        with self.lock:
            for session in self.sessions.values():
                if session.waiter is not None and now - session.waiting_since >= timeout_s:
                    due.append(session.waiter)
                    session.waiter = None
        for loop, fut in due:
            _resolve(loop, fut, IDLE)
        return len(due)

    def _take(self, session: Session, event: Any) -> Any:
        if isinstance(event, tuple):  # a call: answered when its output comes
            session.current = event
            return event[0]
        return event

    def current_call(self, name: str) -> Optional[Call]:
        """The call session ``name`` is answering now (``None``: none)."""
        session = self.sessions.get(name)
        current = session.current if session is not None else None
        return current[0] if current is not None else None

    def reply(self, name: str, reply: Reply, messages: List[Dict[str, Any]], error: Optional[WireError] = None) -> None:
        """The model's output for the call being answered (``on_turn_end``); ``error``: what the
        call gets instead (its ``tool_choice`` unmet)."""
        with self.lock:
            session = self.sessions.get(name)
            if session is None:
                return
            session.turns = reply.turn
            session.transcript = messages
            session.returned.add(reply)
            current, session.current = session.current, None
        if current is not None:
            _resolve(current[1], current[2], error or reply)

    def failed(self, name: str, why: str) -> None:
        """The model call of session ``name`` failed (said to its waiting call when it ends)."""
        with self.lock:
            session = self.sessions.get(name)
            if session is not None:
                session.failure = why

    def ended(self, name: str, reason: str, detail: str = '') -> None:
        """The session's request finished with ``reason`` (``on_request_finished``): a call still
        waiting gets the error, the calls queued behind it too."""
        with self.lock:
            session = self.sessions.get(name)
            if session is None:
                return
            session.reason = reason
            detail = detail or session.failure or ''
            pending = [session.current] if session.current is not None else []
            session.current = None
            for event in session.events:
                if isinstance(event, tuple):
                    pending.append(event)
                elif session.finish is None:
                    session.finish = event  # a finish queued behind the last call gives the reward
            session.events.clear()
        err = ended_error(name, reason, detail)
        for _call, loop, fut in pending:
            _resolve(loop, fut, err)

    # ---- after the stream delivered it --------------------------------------------------------
    def finished_output(self, name: str, output: Any, park: bool) -> Optional[Session]:
        """The stream delivered session ``name``'s output. Returns the session when it is to be
        written now (the client gave its finish, or ``park`` is false); else the output waits for
        the client's reward (:meth:`post_finish`, or :meth:`expired` after the grace time)."""
        with self.lock:
            session = self.sessions.get(name)
            if session is None:
                return None
            if session.finish is not None or not park:
                return session
            session.parked = output
            session.parked_at = time.monotonic()
            return None

    def expired(self, grace_s: float) -> List[Tuple[Session, Any]]:
        """Parked outputs whose client gave no finish within ``grace_s``: taken, to be written
        without a reward."""
        now = time.monotonic()
        out = []
        with self.lock:
            for session in self.sessions.values():
                if session.parked is not None and now - session.parked_at >= grace_s:
                    out.append((session, session.parked))
                    session.parked = None
        return out

    def written(self, name: str, summary: Dict[str, Any]) -> None:
        """Session ``name``'s trajectory is in the run directory: finish calls waiting get
        ``summary``, and the session leaves the table (its name is remembered as ended)."""
        with self.lock:
            session = self.sessions.pop(name, None)
            if session is None:
                return
            self.by_key.pop(session.key or '', None)
            self._remember(name, (session.reason or '') + (f': {session.failure}' if session.failure else ''))
            session.written = summary
            waiters = list(session.written_waiters)
        for loop, fut in waiters:
            _resolve(loop, fut, summary)

    def dropped(self, name: str, why: str) -> None:
        """Session ``name`` will not be written (its stream group was dropped as too stale)."""
        self.ended(name, STALE, why)
        self._unwritten(name, STALE, WireError(409, f'session {name!r} was dropped: {why}', code='stale'))

    def not_written(self, name: str, why: str) -> None:
        """Session ``name`` finished but its line could not be written (``why``): its finish calls
        get a 500 saying so, never a summary of a trajectory that is not on disk."""
        self._unwritten(name, NOT_WRITTEN, WireError(500, f'session {name!r} could not be written: {why}',
                                                     code='not_written'))

    def _unwritten(self, name: str, reason: str, err: WireError) -> None:
        with self.lock:
            session = self.sessions.pop(name, None)
            if session is None:
                return
            self.by_key.pop(session.key or '', None)
            self._remember(name, reason)
            waiters = list(session.written_waiters)
        for loop, fut in waiters:
            _resolve(loop, fut, err)

    def _remember(self, name: str, reason: str) -> None:
        self.ended_names[name] = reason
        while len(self.ended_names) > ENDED_KEEP:
            self.ended_names.popitem(last=False)

    def shut(self) -> None:
        """The gateway stops: no session or call is taken any more, and every step waiting for
        its session's next call gets :data:`CLOSING` (so the stream can interrupt it now)."""
        with self.lock:
            self.closing = True
            self.source.closed = True
            waiters = [s.waiter for s in self.sessions.values() if s.waiter is not None]
            for session in self.sessions.values():
                session.waiter = None
        for loop, fut in waiters:
            _resolve(loop, fut, CLOSING)

    def close(self) -> List[Tuple[Session, Any]]:
        """After :meth:`shut` and the stream's end: the parked outputs (written as they are)."""
        with self.lock:
            self.closing = True
            self.source.closed = True
            parked = [(s, s.parked) for s in self.sessions.values() if s.parked is not None]
            for session, _ in parked:
                session.parked = None
        return parked
