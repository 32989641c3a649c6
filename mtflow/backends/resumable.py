"""What the resumable backends share: :mod:`mtflow.engine.resume`'s contract across two loops.

A backend whose engine or HTTP client lives on a private loop (:class:`LoopThread`) runs each
call there while the driver awaits it on its own loop. When the driver cancels that await (a
weight update under ``on_update='resume'``), the call on the private loop is cancelled too (the
engine request aborted, the HTTP response closed), but its result can no longer come back
through the cancelled future. So the call writes its progress into a holder as it goes, and
:func:`bridged` turns the caller's cancellation into
:class:`~mtflow.engine.resume.GenerationAborted` with what the holder had, or into the whole
output when the generation had already ended (nothing is left to resume). The token record is
committed by the caller's side after the call returns, never by the private loop, so a cut
call commits no turn.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Awaitable, Callable, Optional, Tuple

from mtflow.backends.base import SamplingOptions, sampling_options
from mtflow.engine.resume import GenerationAborted, ResumeFrom

__all__ = ['resumed_options', 'bridged']


def resumed_options(request_config: Any, default_max_tokens: int, prefix: Optional[ResumeFrom]) -> SamplingOptions:
    """The call's sampling options; a resumed call without its own ``max_tokens`` gets what is
    left of the backend's default (the driver lowers a configured one itself)."""
    options = sampling_options(request_config, default_max_tokens)
    limit = request_config.get('max_tokens') if isinstance(request_config, dict) \
        else getattr(request_config, 'max_tokens', None)
    if prefix is not None and len(prefix) and limit is None:
        options = dataclasses.replace(options, max_tokens=max(1, options.max_tokens - len(prefix)))
    return options


async def bridged(coro: Awaitable[Any], loop: asyncio.AbstractEventLoop, cut: Callable[[], Tuple[bool, Any]]) -> Any:
    """Await ``coro`` run on ``loop``; when the caller is cancelled, ``cut()`` says
    ``(ended, output)`` from the progress so far: the output is returned when the generation had
    ended, else :class:`GenerationAborted` carries it."""
    future = asyncio.run_coroutine_threadsafe(coro, loop)  # type: ignore[arg-type]
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        ended, output = cut()
        if not ended:
            raise GenerationAborted([output]) from None
        return output
