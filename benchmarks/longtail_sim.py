"""A long-tailed multi-turn workload on a simulated continuous-batching engine.

Used by ``benchmarks/async_longtail.py`` (lockstep against async) and by the async executor's
tests (a backend whose reply depends only on the request, so both modes must give the same
outputs).

**Engine** (:class:`SimEngine`): a continuous-batching decoder with ``slots`` sequences in flight
and a fixed time per decode step (``decode_s``: every running sequence gains one token per step,
whatever the batch size, as on a memory-bound GPU). A request waits for a free slot, then needs
``n`` steps. A batch call (lockstep) ends when its longest sequence does; a single-request call
(async) ends when its own does. The engine is event driven (one timer per admitted sequence: it
finishes ``n`` decode steps after it got a slot), so it costs a few microseconds per request, not
per token.

**Workload** (:class:`Workload`): request ``i`` has 2-7 turns; each reply's length and each tool
call's latency are drawn from a mixture (lognormal body, and one in ten 10-100x longer) with a
generator seeded by ``(seed, uuid, turn)``: the same request gets the same replies and tool
times in every run and in either mode.
"""
from __future__ import annotations

import asyncio
import math
import random
import weakref
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List

from mtflow import RolloutInferRequest, Scheduler
from mtflow.core.protocol import RolloutOutput, make_choice, make_response
from mtflow.engine.resume import GenerationAborted, current_prefix


_CACHE: Dict[Any, Dict[tuple, Any]] = {}  # drawn values per workload: the same draws, computed once


@dataclass(frozen=True)
class Workload:
    """The long-tail shape: reply lengths in tokens, tool latencies in seconds, turns per request."""
    seed: int = 0
    min_turns: int = 2
    max_turns: int = 7
    reply_median: float = 24.0  # tokens
    reply_sigma: float = 0.5
    tool_median_s: float = 0.010
    tool_sigma: float = 0.5
    tail_p: float = 0.1  # one reply (one tool call) in ten ...
    tail_min: float = 10.0  # ... is 10-100x longer (slower)
    tail_max: float = 100.0
    max_reply: int = 4096

    def _rng(self, *key: Any) -> random.Random:
        return random.Random(zlib.crc32(repr((self.seed, ) + key).encode()))

    def _mixture(self, rng: random.Random, median: float, sigma: float) -> float:
        body = median * math.exp(rng.gauss(0.0, sigma))
        if rng.random() < self.tail_p:
            body *= rng.uniform(self.tail_min, self.tail_max)
        return body

    def _cached(self, key: tuple, make: Any) -> Any:
        cache = _CACHE.setdefault(self, {})
        value = cache.get(key)
        if value is None:
            value = cache[key] = make()
        return value

    def turns(self, uuid: str) -> int:
        return self._cached(('turns', uuid),
                            lambda: self._rng('turns', uuid).randint(self.min_turns, self.max_turns))

    def reply_tokens(self, uuid: str, turn: int) -> int:
        def make() -> int:
            n = self._mixture(self._rng('reply', uuid, turn), self.reply_median, self.reply_sigma)
            return max(1, min(self.max_reply, int(round(n))))

        return self._cached(('reply', uuid, turn), make)

    def tool_s(self, uuid: str, turn: int) -> float:
        return self._cached(('tool', uuid, turn),
                            lambda: self._mixture(self._rng('tool', uuid, turn), self.tool_median_s, self.tool_sigma))

    def requests(self, n: int) -> List[RolloutInferRequest]:
        return [RolloutInferRequest(messages=[{'role': 'user', 'content': f'task {i}'}], uuid=f'r{i:04d}')
                for i in range(n)]

    def own_work_s(self, uuid: str, decode_s: float) -> float:
        """The request's own work: its replies' decode time and its tools' latency, nothing else."""
        t = self.turns(uuid)
        return sum(self.reply_tokens(uuid, k) * decode_s for k in range(1, t + 1)) + sum(
            self.tool_s(uuid, k) for k in range(1, t))

    def total_tokens(self, uuids: List[str]) -> int:
        return sum(self.reply_tokens(u, k) for u in uuids for k in range(1, self.turns(u) + 1))


class _Core:
    """The engine's state on one event loop.

    Every running sequence gains one token per decode step, whatever the batch size, so a sequence
    admitted at time ``t`` with ``n`` tokens to make finishes at ``t + n * decode_s``: each admission
    is one timer on the loop (``call_later``), and a finished sequence hands its slot to the next
    waiting one. O(log n) per request, so the engine itself stays flat from 64 to 1024 requests."""

    def __init__(self, decode_s: float, slots: int) -> None:
        self.decode_s, self.slots = decode_s, slots
        self.waiting: Deque[list] = deque()
        self.running = 0
        self.max_active = 0

    async def generate(self, steps: int, progress: Any = None) -> None:
        """``steps`` decode steps; ``progress`` (a dict) gets ``'t0'``, when a slot was given."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fut.progress = progress  # type: ignore[attr-defined]
        if self.running < self.slots:
            self._admit(loop, steps, fut)
        else:
            self.waiting.append([steps, fut])
        await fut

    def _admit(self, loop: asyncio.AbstractEventLoop, steps: int, fut: asyncio.Future) -> None:
        if getattr(fut, 'progress', None) is not None:
            fut.progress['t0'] = loop.time()
        self.running += 1
        self.max_active = max(self.max_active, self.running)
        handle = loop.call_later(steps * self.decode_s, self._finished, loop, fut)
        fut.add_done_callback(lambda f: self._aborted(loop, f, handle))

    def _finished(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
        if not fut.done():
            fut.set_result(None)  # its done callback frees the slot

    def _aborted(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future, handle: Any) -> None:
        """A finished or cancelled (aborted) sequence frees its slot at once."""
        handle.cancel()
        self.running -= 1
        while self.waiting and self.running < self.slots:
            steps, nxt = self.waiting.popleft()
            if not nxt.done():
                self._admit(loop, steps, nxt)


class SimEngine:
    """A ``rollout_fn`` (async) over the simulated engine: the reply to a request depends only
    on the request (its uuid and how many assistant messages it already has), never on timing.

    Works in both modes: lockstep awaits one call per turn (it ends with its longest sequence),
    async mode one call per request. One engine state per event loop (each executor run has its
    own loop).

    ``resumable=True``: interruptible generation (``mtflow.engine.resume``): a single-request call
    that is cancelled raises ``GenerationAborted`` with the ids decoded so far (one per decode step
    since it got its slot), and a call with a prefix decodes only the rest. Token ``k`` of a reply
    is a function of its position, so a resumed reply is the uninterrupted one exactly; the text
    comes with the last segment (the cut ones carry ids and logprobs only)."""

    def __init__(self, workload: Workload, decode_s: float = 0.0005, slots: int = 256,
                 resumable: bool = False) -> None:
        self.workload, self.decode_s, self.slots = workload, decode_s, slots
        self.resumable = resumable
        # by loop object, not id(): a closed loop's id recurs, and its core's state must not carry over
        self._cores: 'weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Core]' = weakref.WeakKeyDictionary()
        self.calls: List[int] = []  # requests per call
        self.in_flight = 0
        self.max_in_flight = 0

    def core(self) -> _Core:
        loop = asyncio.get_running_loop()
        core = self._cores.get(loop)
        if core is None:
            core = self._cores[loop] = _Core(self.decode_s, self.slots)
        return core

    def reply(self, request: Any, start: int = 0, end: Any = None) -> RolloutOutput:
        """The reply's tokens ``start:end`` (all of it by default; the text only with its end)."""
        uuid = str(request.uuid)
        turn = _turn_of(request)
        n = self.workload.reply_tokens(uuid, turn)
        stop = n if end is None else end
        base = zlib.crc32(f'{uuid}/{turn}'.encode())
        ids = [(base + 7 * k) % 50000 for k in range(start, stop)]
        logprobs = [-((base + k) % 97) / 97.0 for k in range(start, stop)]
        text = f'{uuid} turn {turn}: {n} tokens' if stop == n else ''
        choice = make_choice(text, token_ids=ids, logprobs=logprobs, finish_reason='stop')
        return RolloutOutput(response=make_response(choice, model='sim'))

    async def __call__(self, requests: List[Any], request_config: Any = None) -> List[RolloutOutput]:
        if not requests:
            return []
        self.calls.append(len(requests))
        self.in_flight += len(requests)
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            core = self.core()
            steps = [self.workload.reply_tokens(str(r.uuid), _turn_of(r)) for r in requests]
            if self.resumable and len(steps) == 1:
                return await self._resumable(core, requests[0], steps[0])
            if len(steps) == 1:
                await core.generate(steps[0])
            else:
                await asyncio.gather(*(core.generate(n) for n in steps))
            return [self.reply(r) for r in requests]
        finally:
            self.in_flight -= len(requests)


    async def _resumable(self, core: _Core, request: Any, n: int) -> List[RolloutOutput]:
        prefix = current_prefix()
        done = len(prefix) if prefix is not None else 0
        progress: Dict[str, float] = {}
        try:
            await core.generate(max(0, n - done), progress)
        except asyncio.CancelledError:
            t0 = progress.get('t0')
            made = 0 if t0 is None else int((asyncio.get_running_loop().time() - t0) / self.decode_s)
            made = max(0, min(n - done - 1, made))  # cut before its last token (else it had finished)
            raise GenerationAborted([self.reply(request, done, done + made)]) from None
        return [self.reply(request, done)]


def _turn_of(request: Any) -> int:
    """The turn a request's next reply belongs to: one more than its assistant messages."""
    return 1 + sum(1 for m in request.messages if m.get('role') == 'assistant')


class LongTailScheduler(Scheduler):
    """Each request stops after its own number of turns; each step is a tool call of the
    workload's latency (``asyncio.sleep``: I/O-bound), whose observation is masked out."""

    def __init__(self, workload: Workload, tool_sleep: bool = True) -> None:
        super().__init__(max_turns=workload.max_turns)
        self.workload = workload
        self.tool_sleep = tool_sleep

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        return current_turn >= self.workload.turns(str(infer_request.uuid))

    async def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        uuid = str(infer_request.uuid)
        latency = self.workload.tool_s(uuid, current_turn)
        if self.tool_sleep:
            await asyncio.sleep(latency)
        observation = f'observation {current_turn} after {latency * 1000:.1f} ms'
        infer_request.messages.append({'role': 'tool', 'content': observation})
        tool_ids = [zlib.crc32(observation.encode()) % 50000 + k for k in range(4)]
        ids = list(response_choice.token_ids or []) + tool_ids
        return {
            'infer_request': infer_request,
            'response_token_ids': ids,
            'response_loss_mask': [1] * (len(ids) - 4) + [0] * 4,
            'rollout_infos': {'tool_ms': round(latency * 1000, 3)},
            'trace_info': {'tool_calls': ['wait']},
        }
