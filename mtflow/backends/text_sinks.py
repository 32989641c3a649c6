"""Where a backend sends a request's text as it is generated: the gateway's streaming calls.

A backend that streams (``streams_text = True``: HF through a streamer, vLLM's async engine, an
OpenAI-compatible server, the scripted model) looks up each request of a call in its
:class:`TextSinks` by uuid and, for the ones someone listens to, calls the sink with the text
generated so far (cumulative, as the backend itself decodes it) each time it grows. The final
output is returned as always; the sink only sees it sooner. Nobody listening costs one dict
lookup per request.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Optional

__all__ = ['TextSinks', 'Sink']

#: ``sink(text_so_far)``: called from the backend's thread; must not block
Sink = Callable[[str], None]


class TextSinks:
    """The sinks of one backend, by request uuid (any thread)."""

    def __init__(self) -> None:
        self._sinks: Dict[str, Sink] = {}
        self._lock = threading.Lock()

    def open(self, uuid: str, sink: Sink) -> None:
        with self._lock:
            self._sinks[str(uuid)] = sink

    def close(self, uuid: str, sink: Optional[Sink] = None) -> None:
        """Stop sending request ``uuid``'s text (to ``sink`` only, when given)."""
        with self._lock:
            if sink is None or self._sinks.get(str(uuid)) is sink:
                self._sinks.pop(str(uuid), None)

    def get(self, request: Any) -> Optional[Sink]:
        """The sink of ``request`` (a request or its uuid), if someone listens."""
        if not self._sinks:
            return None
        uuid = request if isinstance(request, str) else getattr(request, 'uuid', None)
        return self._sinks.get(str(uuid)) if uuid is not None else None
