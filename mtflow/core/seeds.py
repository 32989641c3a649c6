"""Seeds that follow a request, not its place in a batch.

A request's environment episode and the model's samples for it depend on the run's seed and on
the request itself (its uuid; for a sample also how far its conversation has got), never on
which batch, call, worker or moment it shared: so ``batch_size``, ``max_concurrency`` and the
driver's mode change no trajectory. :func:`stable_seed` is the one hash; the environments'
episode seed (``mtflow.declarative.envs.request_seed``) and the backends' sampling seed
(:func:`sampling_seed`) are built on it.
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional

__all__ = ['SEED_BOUND', 'stable_seed', 'sampling_seed']

#: seeds are below 2**31: every engine and server takes them (vLLM, OpenAI-compatible servers, torch)
SEED_BOUND = 2 ** 31


def stable_seed(*parts: Any) -> int:
    """A number in ``[0, 2**31)`` from ``parts`` (joined by ``:``), the same on every machine,
    process and run (``hash()`` is salted per process; this is not)."""
    key = ':'.join(str(p) for p in parts)
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) & (SEED_BOUND - 1)


def sampling_seed(seed: Optional[int], request: Any, position: int = 0) -> Optional[int]:
    """The sampling seed of ``request``'s next generation: from ``seed``, the request's uuid and
    how far its conversation has got (the number of messages and the length of the last one, so
    every turn and every continuation of a turn draws anew), whatever the call it is in.

    ``None`` without a ``seed`` (the engine's own randomness). A request without a uuid gets
    ``seed + position`` (its place in the call, ms-swift's rule): it has nothing else to go by."""
    if seed is None:
        return None
    uuid = getattr(request, 'uuid', None)
    if not uuid:
        return (int(seed) + position) % SEED_BOUND
    messages = getattr(request, 'messages', None) or []
    last = messages[-1] if messages else {}
    content = last.get('content') if isinstance(last, dict) else getattr(last, 'content', None)
    return stable_seed(seed, uuid, len(messages), len(str(content or '')))
