"""Running tool calls concurrently, within limits, with every failure turned into a result.

The YAML scheduler's ``step`` is ``async def``, so the executor gathers the steps of all requests
of a turn; inside a step, the calls of one request are gathered too. :class:`ToolRunner` runs each
call:

- async tools on the event loop; sync tools each in a daemon thread of its own, at most
  ``max_threads`` at once (daemon: a call that hangs never keeps the process alive after a
  SIGTERM or Ctrl-C stopped the run, as a pool's worker, joined at exit, would);
- at most ``tool.max_concurrency`` calls of one tool at a time, across all requests (a semaphore
  per tool and per event loop: the executor uses a fresh loop per run), and at most the run's
  ``admission.tool_calls`` calls of all tools together (:mod:`mtflow.engine.admission`);
- with ``tool.timeout_s``: a timed-out async call is cancelled; a timed-out sync call is
  abandoned (a thread cannot be killed) and its late result ignored, so a sync tool that can hang
  should enforce its own limit, or be async (like ``python``, whose process is killed);
- an unknown tool, arguments that do not fit the schema, an exception (``SystemExit`` too: a tool
  that calls ``sys.exit(3)`` fails its call, not the run) or a timeout become a
  :class:`ToolResult` with ``ok=False`` and an ``error`` message for the model, never an exception;
  a tool that knows why it failed raises :class:`ToolError` with a kind (the ``python`` tool:
  ``timeout``, ``memory``, ``exit``, ``killed``, ``refused``), which becomes the ``error_kind``;
- its text is bounded as it returns (:mod:`mtflow.tools.bounds`: nothing beyond what
  ``tool.max_observation`` can show is kept), and what it prints is captured with the call
  (:mod:`mtflow.tools.printed`), not written to mtflow's stdout.

Results come back in call order (``asyncio.gather`` keeps order), so observations are
deterministic whatever finishes first.
"""
from __future__ import annotations

import asyncio
import threading
import weakref
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Dict, List, Optional, Sequence

from mtflow.core.calls import RAISED, TIMED_OUT, Outcome, within
from mtflow.core.images import ImageError, observation_parts
from mtflow.engine.admission import Admission
from mtflow.tools.bounds import cut_text, keep_window
from mtflow.tools.printed import Printed, capturing
from mtflow.tools.tool import Tool


class ToolError(Exception):
    """Raised by a tool to report a failed call of a known ``kind`` (the ``python`` tool:
    ``timeout``, ``memory``, ``exit``, ``killed``, ``refused``); the message is what the model sees."""

    def __init__(self, kind: str, message: str, usage: Optional[Dict[str, float]] = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.usage = dict(usage or {})


class ToolOutput(str):
    """A tool's text with what the call used (the ``python`` tool: ``memory_peak_mb``, ``cpu_s``
    from its cgroup), which :class:`ToolRunner` puts into the call's ``trace_info`` as ``usage``."""
    usage: Dict[str, float]

    def __new__(cls, text: str, usage: Optional[Dict[str, float]] = None) -> 'ToolOutput':
        self = super().__new__(cls, text)
        self.usage = dict(usage or {})
        return self


#: how much of a failed call's error ``ToolResult.to_info`` keeps (the trace's ``calls``)
ERROR_INFO_CHARS = 500


@dataclass
class ToolResult:
    """One call's outcome. ``error_kind``: ``parse``, ``unknown_tool``, ``bad_arguments``,
    ``exception``, ``timeout``, or the kind of a :class:`ToolError` the tool raised, when ``ok``
    is false."""
    name: str
    arguments: Any
    ok: bool
    output: str = ''
    error: str = ''
    error_kind: str = ''
    duration_s: float = 0.0
    usage: Dict[str, float] = field(default_factory=dict)  # what the call used, when the tool says
    #: the images the tool returned beside its text, as it returned them (:mod:`mtflow.core.images`)
    images: List[Any] = field(default_factory=list)
    #: how long the tool's text was when the runner kept only a window of it (``None``: kept whole;
    #: :func:`mtflow.tools.bounds.keep_window`)
    output_chars: Optional[int] = None
    #: what the call printed (:mod:`mtflow.tools.printed`), or ``None``
    printed: Optional[Printed] = None

    def to_info(self) -> Dict[str, Any]:
        info: Dict[str, Any] = {'name': self.name, 'ok': self.ok, 'duration_s': round(self.duration_s, 6)}
        if self.usage:
            info['usage'] = dict(self.usage)
        if self.printed is not None:
            info.update(self.printed.to_info())
        if self.images:
            info['images'] = len(self.images)
        if not self.ok:
            info['error_kind'] = self.error_kind
            info['error'] = self.error[:ERROR_INFO_CHARS]
        return info


_PY_TYPES = {'string': str, 'integer': int, 'number': (int, float), 'boolean': bool, 'array': list, 'object': dict}


def check_arguments(tool: Tool, arguments: Any) -> Dict[str, Any]:
    """``arguments`` as keyword arguments for ``tool``, or ``ValueError`` saying what is wrong.

    A bare string (ReAct's ``Action Input: 2+2``) is given to the tool's only (or first required)
    parameter. Checks: an object, required keys present, no unknown keys unless the schema allows
    them, JSON types of the declared properties."""
    params = tool.parameters or {}
    props: Dict[str, Any] = params.get('properties') or {}
    required: List[str] = list(params.get('required') or [])
    if isinstance(arguments, str) or (arguments is not None and not isinstance(arguments, dict)
                                      and len(props) == 1):
        target = required[0] if required else (next(iter(props)) if len(props) == 1 else None)
        if target is None:
            raise ValueError(f'arguments must be a JSON object, got {type(arguments).__name__}')
        arguments = {target: arguments}
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError(f'arguments must be a JSON object, got {type(arguments).__name__}')
    missing = [k for k in required if k not in arguments]
    if missing:
        raise ValueError(f'missing required argument(s): {", ".join(missing)}')
    if props and params.get('additionalProperties', False) is False:
        unknown = [k for k in arguments if k not in props]
        if unknown:
            raise ValueError(f'unknown argument(s): {", ".join(unknown)} (expected: {", ".join(props)})')
    for key, value in arguments.items():
        expected = (props.get(key) or {}).get('type')
        py = _PY_TYPES.get(expected) if isinstance(expected, str) else None
        if py is not None and (not isinstance(value, py) or (expected in ('integer', 'number')
                                                             and isinstance(value, bool))):
            raise ValueError(f'argument {key!r} must be of type {expected}, got {type(value).__name__}')
    return arguments


class ToolRunner:
    """Runs calls to a fixed set of tools; see the module docstring."""

    def __init__(self, tools: Sequence[Tool], max_threads: int = 64, admission: Optional[Admission] = None) -> None:
        self.tools: Dict[str, Tool] = {t.name: t for t in tools}
        self.max_threads = max_threads
        #: the run's admission control: its ``tool_calls`` gate bounds the calls in flight across
        #: every tool (taken after the tool's own ``max_concurrency`` slot, so one busy tool's
        #: queue never holds the shared slots); ``None``: only the per-tool bounds
        self.admission = admission
        self._semaphores: 'weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Dict[str, asyncio.Semaphore]]' = (
            weakref.WeakKeyDictionary())

    def _loop_semaphore(self, key: str, bound: int) -> asyncio.Semaphore:
        per_loop = self._semaphores.setdefault(asyncio.get_running_loop(), {})
        sem = per_loop.get(key)
        if sem is None:
            sem = per_loop[key] = asyncio.Semaphore(bound)
        return sem

    def _semaphore(self, tool: Tool) -> Optional[asyncio.Semaphore]:
        return self._loop_semaphore(f'tool:{tool.name}', tool.max_concurrency) if tool.max_concurrency else None

    async def _in_thread(self, tool: Tool, kwargs: Dict[str, Any], printed: Printed) -> Any:
        """A sync tool's call in a daemon thread of its own (one of ``max_threads``, whose slot is
        freed when the thread ends, also after the call was abandoned), printing into ``printed``."""
        slots = self._loop_semaphore('threads', self.max_threads)
        await slots.acquire()
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(value: Any, failed: bool) -> None:
            slots.release()
            if not done.done():
                done.set_exception(value) if failed else done.set_result(value)

        def body() -> None:
            try:
                with capturing(printed):
                    value, failed = tool.fn(**kwargs), False
            except BaseException as exc:  # noqa: BLE001 - the call's outcome (sys.exit() too)
                value, failed = exc, True
            try:
                loop.call_soon_threadsafe(settle, value, failed)
            except RuntimeError:  # the run's loop is closed: the call was abandoned long ago
                pass

        try:
            threading.Thread(target=body, name=f'mtflow-tool-{tool.name}', daemon=True).start()
        except BaseException:
            slots.release()
            raise
        return await done

    async def call(self, name: str, arguments: Any) -> ToolResult:
        """Run one call; never raises (except cancellation)."""
        tool = self.tools.get(name)
        if tool is None:
            known = ', '.join(self.tools) or 'none'
            return ToolResult(name, arguments, False, error=f'unknown tool {name!r} (available: {known})',
                              error_kind='unknown_tool')
        try:
            kwargs = check_arguments(tool, arguments)
        except ValueError as exc:
            return ToolResult(name, arguments, False, error=f'bad arguments for {name}: {exc}',
                              error_kind='bad_arguments')
        sem = self._semaphore(tool)
        if sem is not None:
            async with sem:
                return await self._admitted(tool, kwargs)
        return await self._admitted(tool, kwargs)

    async def _admitted(self, tool: Tool, kwargs: Dict[str, Any]) -> ToolResult:
        if self.admission is None:
            return await self._run(tool, kwargs)
        async with self.admission.tool_calls.hold():
            return await self._run(tool, kwargs)

    async def _run(self, tool: Tool, kwargs: Dict[str, Any]) -> ToolResult:
        t = perf_counter()
        printed = Printed()
        try:
            if tool.is_async:
                with capturing(printed):  # the call's task (and the tasks it starts) print into it
                    aw = tool.fn(**kwargs)
                    outcome = await within(aw, tool.timeout_s or None, t)
            else:
                outcome = await within(self._in_thread(tool, kwargs, printed), tool.timeout_s or None, t)
        except (Exception, SystemExit) as exc:  # an async-declared tool that raised as it was called
            outcome = Outcome(RAISED, exc, perf_counter() - t)
        result = self._result(tool, kwargs, outcome, t)
        result.printed = printed if printed.chars else None
        return result

    def _result(self, tool: Tool, kwargs: Dict[str, Any], outcome: Outcome, t: float) -> ToolResult:
        if outcome.kind == TIMED_OUT:
            return ToolResult(tool.name, kwargs, False, error=f'{tool.name} timed out after {tool.timeout_s:g} s',
                              error_kind='timeout', duration_s=outcome.duration)
        if outcome.kind == RAISED:
            return _failed(tool, kwargs, outcome.value, outcome.duration)
        value = outcome.value
        try:
            text, images = observation_parts(value, place=False)
        except ImageError as exc:
            return ToolResult(tool.name, kwargs, False, error=f'{tool.name} returned {exc}', error_kind='exception',
                              duration_s=perf_counter() - t)
        text = _to_text(text)
        kept = keep_window(text, tool.max_observation, tool.truncate_side)  # never hold more than it can show
        return ToolResult(tool.name, kwargs, True, output=kept, duration_s=perf_counter() - t,
                          usage=getattr(value, 'usage', None) if isinstance(value, ToolOutput) else {}, images=images,
                          output_chars=len(text) if len(kept) < len(text) else None)

    async def call_all(self, calls: Sequence[tuple]) -> List[ToolResult]:
        """Run ``[(name, arguments), ...]`` concurrently; results in call order."""
        return list(await asyncio.gather(*[self.call(n, a) for n, a in calls]))

    def close(self) -> None:
        """Release what tools hold (a ``close()`` on the tool's callable: the ``python`` tool's
        warm sandboxes). A sync call still running is abandoned: its thread is a daemon."""
        for tool in self.tools.values():
            close = getattr(tool.fn, 'close', None)
            if callable(close):
                close()


def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return str.__str__(value)
    if value is None:
        return ''
    import json
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def truncate(text: str, limit: Optional[int], side: str = 'right', tokenizer: Any = None) -> str:
    """``text`` cut to ``limit`` tokens (with a tokenizer) or characters; ``side='right'`` keeps
    the beginning, ``'left'`` the end. A marker says how much was dropped
    (:func:`mtflow.tools.bounds.cut_text`)."""
    return cut_text(text, limit, side, tokenizer)[0]


def _failed(tool: Tool, kwargs: Dict[str, Any], exc: BaseException, duration: float) -> ToolResult:
    """The result of a call that raised: a :class:`ToolError` keeps its kind; a ``TypeError``
    about arguments is ``bad_arguments``; anything else is ``exception``."""
    if isinstance(exc, ToolError):
        return ToolResult(tool.name, kwargs, False, error=str(exc), error_kind=exc.kind, duration_s=duration,
                          usage=exc.usage)
    if isinstance(exc, SystemExit):  # sys.exit() in a tool ends that call, not the run
        return ToolResult(tool.name, kwargs, False, error=f'{tool.name} called sys.exit({exc.code!r})',
                          error_kind='exception', duration_s=duration)
    kind = 'bad_arguments' if isinstance(exc, TypeError) and 'argument' in str(exc) else 'exception'
    return ToolResult(tool.name, kwargs, False, error=f'{tool.name} raised {type(exc).__name__}: {exc}',
                      error_kind=kind, duration_s=duration)
