"""Routing one backend's requests over several engine servers (replicas).

The cost that decides a multi-turn fleet's speed is the prefix cache: turn t+1's prompt is turn
t's prompt plus the reply and the observation, so the replica that served turn t still holds the
KV cache of most of turn t+1's prompt and skips that prefill. A router that ignores this spreads
a conversation's turns over all replicas and the hit rate falls to about 1/replicas (prime-rl
measured 98% -> 5% after a routing change). The policies:

=======================  ============================================================================
policy                   a request's turn goes to
=======================  ============================================================================
``sticky_least_loaded``  the replica that served its last turn, unless that one is dead or
                         overloaded (its own ``max_in_flight`` reached, or ``sticky_slack`` more
                         requests in flight than the least loaded one); else, and for a new
                         request, the least loaded healthy replica (the default)
``least_loaded``         the healthy replica with the fewest requests in flight (ties: the one
                         that served fewer)
``round_robin``          the next healthy replica in turn
``consistent_hash``      a point on a hash ring of ``key + weight version`` (64 virtual nodes per
                         replica; a dead replica's keys go to the next one on the ring)
=======================  ============================================================================

**Weight versions.** After a weight update the replicas' caches hold KV of the old weights;
:meth:`Router.set_weight_version` forgets every sticky placement (the next turns are placed by
load again) and changes the consistent-hash salt; the OpenAI backend also sends the version as
vLLM's ``cache_salt`` so a server never serves a new-weights prompt from old-weights blocks.

**Admission.** With ``max_in_flight`` per replica, :meth:`Router.acquire` waits (a queue, not a
failure) when the replica the policy chose is full. The queues are per replica, so that a full
fleet does not undo the placement: a request's next turn waits for the replica that holds its
cache (``sticky_least_loaded``, ``consistent_hash``) instead of taking whichever slot frees first
(which spread turns over the fleet by load: 37% hits after turn 1 on 4 saturated replicas in
``benchmarks/serving.py``). A new request, or one placed by load (``least_loaded``,
``round_robin``), waits in one shared queue for any replica. A freed slot goes, in this order,
to its replica's own queue, then to the shared queue, then to the longest other queue if that one
is more than ``sticky_slack`` long (a move, counted in ``rebalanced``: a slot never idles while a
replica's backlog is more than the slack); a request whose replica's backlog is already past the
slack when it arrives goes to a free replica at once. :meth:`Router.release` hands the slot
straight to the next waiter (no wake-up of every waiter).

**Forks** (``docs/branching.md``). A request forked into children (:meth:`Router.fork`) hands
them its placement: a child's first turn goes where its parent's prefix is cached (sticky), and
hashes as its parent (consistent hash); its serving log starts with the parent's entries, so its
n-th entry is still its turn n.

**Health.** A replica that refuses a connection is marked down at once (:meth:`mark_down`) and
its requests move to another (each move counted, and noted in the request's serving log, which
``mtflow run`` writes into the trace); a health check (``GET <url>/models``, every
``health_interval_s``) brings it back when it answers.

**Serving log.** Each model call of a request appends one entry (replica, prompt tokens, the
cached prompt tokens the server reported as ``usage.prompt_tokens_details.cached_tokens``, the
moves); the n-th entry is turn n. :meth:`take` pops a finished request's entries.
"""
from __future__ import annotations

import asyncio
import bisect
import hashlib
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence, Set

from mtflow.backends.base import BackendError

__all__ = ['POLICIES', 'Replica', 'Router', 'cached_tokens_of', 'hit_rate', 'watch_health']

POLICIES = ('sticky_least_loaded', 'least_loaded', 'round_robin', 'consistent_hash')
#: serving-log entries kept for requests nobody took (a Python caller that never calls take)
MAX_LOGGED_REQUESTS = 100_000
_VNODES = 64


@dataclass
class Replica:
    """One server and what the router knows of it."""
    index: int
    url: str
    max_in_flight: Optional[int] = None
    in_flight: int = 0
    peak_in_flight: int = 0  # the most requests it held at once
    served: int = 0
    healthy: bool = True
    down_since: Optional[float] = None
    failures: int = 0  # requests that failed here (and moved or retried)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    later_prompt_tokens: int = 0  # prompt tokens of turns >= 2 (the ones a cache can serve)
    later_cached_tokens: int = 0

    def full(self) -> bool:
        return self.max_in_flight is not None and self.in_flight >= self.max_in_flight


def hit_rate(cached: int, prompt: int) -> Optional[float]:
    """``cached / prompt`` rounded to 4 places; ``None`` when no prompt tokens were counted."""
    return round(cached / prompt, 4) if prompt else None


def cached_tokens_of(data: Any) -> Optional[int]:
    """The cached prompt tokens a server reported in a completion's ``usage``
    (``prompt_tokens_details.cached_tokens``: vLLM with ``--enable-prompt-tokens-details``,
    sglang, OpenAI), or ``None`` when it reported none."""
    usage = data.get('usage') if isinstance(data, dict) else None
    details = usage.get('prompt_tokens_details') if isinstance(usage, dict) else None
    value = details.get('cached_tokens') if isinstance(details, dict) else None
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass
class _Entry:
    turn: int
    replica: Optional[int] = None
    prompt_tokens: int = 0
    cached_tokens: Optional[int] = None
    moves: List[Dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {'replica': self.replica, 'prompt_tokens': self.prompt_tokens,
                             'cached_tokens': self.cached_tokens}
        if self.moves:
            d['moves'] = list(self.moves)
        return d


@dataclass(eq=False)
class _Waiter:
    """One :meth:`Router.acquire` waiting for a slot: on ``target``'s queue, or on the shared one."""
    key: Optional[str]
    avoid: Set[int]
    future: 'asyncio.Future[Replica]'
    target: Optional[int] = None


class Router:
    """Places each request's turns on one of ``urls`` by ``policy`` (module docstring). Lives on
    one event loop (the backend's private one): :meth:`acquire` waits there."""

    def __init__(self, urls: Sequence[str], policy: str = 'sticky_least_loaded', *,
                 max_in_flight: Optional[int] = None, sticky_slack: int = 8,
                 weight_version: Optional[Any] = None) -> None:
        urls = [str(u).rstrip('/') for u in urls]
        if not urls:
            raise BackendError('openai backend: urls must name at least one server')
        if len(set(urls)) != len(urls):
            raise BackendError(f'openai backend: urls lists a server twice: {urls}')
        if policy not in POLICIES:
            raise BackendError(f'openai backend: routing must be one of {", ".join(POLICIES)}, not {policy!r}')
        if max_in_flight is not None and (not isinstance(max_in_flight, int) or max_in_flight < 1):
            raise BackendError(f'openai backend: max_in_flight_per_replica must be a positive int, not {max_in_flight!r}')
        self.policy = policy
        self.replicas = [Replica(i, u, max_in_flight) for i, u in enumerate(urls)]
        self.sticky_slack = sticky_slack
        self.weight_version = weight_version
        self.moves = 0  # requests moved off a failing replica
        self.queued = 0  # acquisitions that had to wait for capacity
        self.queued_s = 0.0  # their time waiting, summed
        self._sticky: Dict[str, int] = {}
        self._hash_key: Dict[str, str] = {}  # a fork's child -> the key it hashes as (its root's)
        self._rr = 0
        self._ring: List[int] = []
        self._ring_owner: List[int] = []
        self._build_ring()
        self.rebalanced = 0  # waiting requests moved off their replica's queue to a free slot elsewhere
        self._log: 'OrderedDict[str, List[_Entry]]' = OrderedDict()
        self._waiting: List[Deque[_Waiter]] = [deque() for _ in self.replicas]  # per replica
        self._shared: Deque[_Waiter] = deque()  # new requests and load-placed ones: any replica

    # ---- placement ------------------------------------------------------------------------------
    def set_weight_version(self, version: Any) -> None:
        """New weights: old KV caches are useless, so sticky placements are forgotten and the
        hash ring's salt changes."""
        if version != self.weight_version:
            self.weight_version = version
            self._sticky.clear()

    def _build_ring(self) -> None:
        points = sorted((_hash(f'{r.url}#{v}'), r.index) for r in self.replicas for v in range(_VNODES))
        self._ring = [p for p, _ in points]
        self._ring_owner = [i for _, i in points]

    def pick(self, key: Optional[str], avoid: Iterable[int] = ()) -> Replica:
        """The replica for ``key``'s next turn now (no waiting): healthy, not full and not in
        ``avoid`` if one is; else the healthy ones; else every replica (a dead fleet is tried
        again rather than failing the request at once)."""
        avoid = set(avoid)
        pool = [r for r in self.replicas if r.healthy and not r.full() and r.index not in avoid]
        if not pool:
            pool = [r for r in self.replicas if r.healthy and r.index not in avoid] or \
                   [r for r in self.replicas if r.index not in avoid] or list(self.replicas)
        chosen = self._choose(key, pool)
        self._remember(key, chosen)
        return chosen

    def _remember(self, key: Optional[str], replica: Replica) -> None:
        if key is not None and self.policy == 'sticky_least_loaded':
            self._sticky[key] = replica.index

    def _load(self, replica: Replica) -> int:
        return replica.in_flight + len(self._waiting[replica.index])

    def _choose(self, key: Optional[str], pool: List[Replica]) -> Replica:
        policy = self.policy
        if policy == 'round_robin':
            n = len(self.replicas)
            allowed = {r.index for r in pool}
            for step in range(n):
                i = (self._rr + step) % n
                if i in allowed:
                    self._rr = i + 1
                    return self.replicas[i]
        least = min(pool, key=lambda r: (self._load(r), r.served, r.index))
        if key is None or policy == 'least_loaded':
            return least
        if policy == 'consistent_hash':
            owner = self._ring_choice(key, {r.index for r in pool})
            return self.replicas[owner] if owner is not None else least
        last = self._sticky.get(key)  # sticky_least_loaded
        if last is not None:
            mine = self.replicas[last]
            if mine in pool and self._load(mine) <= self._load(least) + self.sticky_slack:
                return mine
        return least

    def _ring_choice(self, key: str, allowed: Set[int]) -> Optional[int]:
        start = bisect.bisect(self._ring, _hash(f'{self.weight_version}:{self._hash_key.get(key, key)}'))
        for step in range(len(self._ring)):
            owner = self._ring_owner[(start + step) % len(self._ring)]
            if owner in allowed:
                return owner
        return None

    def _home(self, key: Optional[str], avoid: Set[int]) -> Optional[Replica]:
        """The healthy replica whose cache holds ``key``'s conversation, whether full or not:
        the one to wait for. ``None`` for a new key or a load-placed policy."""
        if key is None or self.policy in ('least_loaded', 'round_robin'):
            return None
        healthy = {r.index for r in self.replicas if r.healthy and r.index not in avoid}
        if self.policy == 'consistent_hash':
            owner = self._ring_choice(key, healthy)
        else:
            owner = self._sticky.get(key)
        return self.replicas[owner] if owner is not None and owner in healthy else None

    async def acquire(self, key: Optional[str], avoid: Iterable[int] = ()) -> Replica:
        """A replica for ``key``, with its slot taken: waits while the chosen replica is full
        (admission control: a queue, not a failure; module docstring)."""
        avoid = set(avoid)
        replica = self._place_now(key, avoid)
        if replica is None:
            home = self._home(key, avoid)
            waiter = _Waiter(key, avoid, asyncio.get_running_loop().create_future(),
                             home.index if home is not None else None)
            (self._waiting[home.index] if home is not None else self._shared).append(waiter)
            self.queued += 1
            t = time.perf_counter()
            try:
                replica = await waiter.future
            except asyncio.CancelledError:
                self._forget(waiter)
                raise
            finally:
                self.queued_s += time.perf_counter() - t
            return replica
        self._take(replica)
        return replica

    def _place_now(self, key: Optional[str], avoid: Set[int]) -> Optional[Replica]:
        """A replica with a free slot for ``key`` now, or ``None`` when it must wait."""
        if not any(r.healthy for r in self.replicas):
            return self.pick(key, avoid)  # a dead fleet: try it again rather than wait forever
        home = self._home(key, avoid)
        free = [r for r in self.replicas if r.healthy and not r.full() and r.index not in avoid]
        if home is not None and not home.full() and not self._waiting[home.index]:
            chosen = self._choose(key, free)
        elif home is not None and len(self._waiting[home.index]) < self.sticky_slack:
            return None  # wait for the replica that holds the cache
        elif free and not (home is None and self._shared):
            chosen = self._choose(key, free)
        else:
            return None
        if home is not None and chosen is not home:
            self.rebalanced += 1
        self._remember(key, chosen)
        return chosen

    def _take(self, replica: Replica) -> None:
        replica.in_flight += 1
        replica.peak_in_flight = max(replica.peak_in_flight, replica.in_flight)

    def _forget(self, waiter: _Waiter) -> None:
        """A cancelled waiter leaves its queue; a slot already handed to it is given back."""
        queue = self._waiting[waiter.target] if waiter.target is not None else self._shared
        try:
            queue.remove(waiter)
        except ValueError:
            pass
        fut = waiter.future
        if fut.done() and not fut.cancelled():
            self._free(fut.result())

    async def release(self, replica: Replica) -> None:
        self._free(replica)

    def _free(self, replica: Replica) -> None:
        replica.in_flight -= 1
        self._dispatch(replica)

    def _dispatch(self, replica: Replica) -> None:
        """Hand ``replica``'s free slots to waiters: its own queue, then the shared one, then the
        longest other queue past the slack (a move)."""
        while replica.healthy and not replica.full():
            waiter = self._next_for(replica)
            if waiter is None:
                return
            self._take(replica)
            self._remember(waiter.key, replica)
            waiter.future.set_result(replica)

    def _next_for(self, replica: Replica) -> Optional[_Waiter]:
        own = self._waiting[replica.index]
        while own:
            waiter = own.popleft()
            if not waiter.future.done():
                return waiter
        for i, waiter in enumerate(self._shared):
            if replica.index not in waiter.avoid and not waiter.future.done():
                del self._shared[i]
                return waiter
        longest = max(self._waiting, key=len)
        if len(longest) > self.sticky_slack:
            for i, waiter in enumerate(longest):
                if replica.index not in waiter.avoid and not waiter.future.done():
                    del longest[i]
                    self.rebalanced += 1
                    return waiter
        return None

    def _redispatch(self, replica: Replica) -> None:
        """``replica`` went down: its waiters go to the shared queue's front (oldest first), and
        every free slot elsewhere takes what it can; with no healthy replica left, every waiter
        is sent to try the dead fleet again (as a new request would be)."""
        orphans = self._waiting[replica.index]
        while orphans:
            waiter = orphans.pop()
            waiter.target = None
            self._shared.appendleft(waiter)
        if not any(r.healthy for r in self.replicas):
            waiters = [w for q in (*self._waiting, self._shared) for w in q]
            for q in (*self._waiting, self._shared):
                q.clear()
            for waiter in waiters:
                if not waiter.future.done():
                    chosen = self.pick(waiter.key, waiter.avoid)
                    self._take(chosen)
                    waiter.future.set_result(chosen)
            return
        for other in self.replicas:
            self._dispatch(other)

    # ---- health ---------------------------------------------------------------------------------
    def mark_down(self, replica: Replica) -> None:
        if replica.healthy:
            replica.healthy = False
            replica.down_since = time.monotonic()
            self._redispatch(replica)

    def mark_up(self, replica: Replica) -> None:
        if not replica.healthy:
            replica.healthy, replica.down_since = True, None
            self._dispatch(replica)

    async def check_health(self, probe: Any) -> None:
        """One round of health checks: ``await probe(replica) -> bool`` for every replica,
        concurrently; waiters are woken when one comes back."""
        results = await asyncio.gather(*(probe(r) for r in self.replicas), return_exceptions=True)
        for replica, ok in zip(self.replicas, results):
            if ok is True:
                self.mark_up(replica)
            else:
                self.mark_down(replica)

    def fork(self, parent: str, children: Sequence[str]) -> None:
        """``parent`` was forked into ``children``: they go where its prefix is cached (module docstring)."""
        home, root, entries = self._sticky.get(parent), self._hash_key.get(parent, parent), self._log.get(parent)
        for child in children:
            if home is not None:
                self._sticky[child] = home
            self._hash_key[child] = root
            if entries is not None:
                self._log[child] = list(entries)

    # ---- the serving log and figures ------------------------------------------------------------
    def begin(self, key: Optional[str]) -> _Entry:
        """A new serving-log entry: the next turn of ``key``."""
        if key is None:
            return _Entry(turn=0)
        entries = self._log.get(key)
        if entries is None:
            entries = self._log[key] = []
            if len(self._log) > MAX_LOGGED_REQUESTS:
                self._log.popitem(last=False)
        entry = _Entry(turn=len(entries) + 1)
        entries.append(entry)
        return entry

    def moved(self, entry: _Entry, replica: Replica, reason: str) -> None:
        self.moves += 1
        replica.failures += 1
        entry.moves.append({'from': replica.index, 'reason': reason})

    def served(self, entry: _Entry, replica: Replica, prompt_tokens: int, cached: Optional[int]) -> None:
        replica.served += 1
        entry.replica, entry.prompt_tokens, entry.cached_tokens = replica.index, prompt_tokens, cached
        if cached is None:
            return
        replica.prompt_tokens += prompt_tokens
        replica.cached_tokens += cached
        if entry.turn > 1:
            replica.later_prompt_tokens += prompt_tokens
            replica.later_cached_tokens += cached

    def take(self, key: str) -> List[Dict[str, Any]]:
        """The serving log of ``key``'s turns (entry n-1 is turn n), removed from the router."""
        self._hash_key.pop(key, None)
        return [e.to_dict() for e in self._log.pop(key, ())]

    def summary(self) -> Dict[str, Any]:
        """Figures for ``summary.json``: per replica and overall, requests served, moves and the
        prefix-cache hit rate (cached / prompt tokens, over every turn and over turns >= 2)."""
        rows = []
        for r in self.replicas:
            rows.append({'url': r.url, 'served': r.served, 'failures': r.failures, 'healthy': r.healthy,
                         'max_in_flight': r.max_in_flight, 'peak_in_flight': r.peak_in_flight,
                         'prompt_tokens': r.prompt_tokens, 'cached_tokens': r.cached_tokens,
                         'later_prompt_tokens': r.later_prompt_tokens, 'later_cached_tokens': r.later_cached_tokens,
                         'hit_rate': hit_rate(r.cached_tokens, r.prompt_tokens),
                         'hit_rate_after_turn_1': hit_rate(r.later_cached_tokens, r.later_prompt_tokens)})
        prompt = sum(r.prompt_tokens for r in self.replicas)
        cached = sum(r.cached_tokens for r in self.replicas)
        later_p = sum(r.later_prompt_tokens for r in self.replicas)
        later_c = sum(r.later_cached_tokens for r in self.replicas)
        return {'policy': self.policy, 'replicas': rows, 'moves': self.moves, 'queued': self.queued,
                'queued_s': round(self.queued_s, 4), 'rebalanced': self.rebalanced,
                'weight_version': self.weight_version, 'prompt_tokens': prompt, 'cached_tokens': cached,
                'hit_rate': hit_rate(cached, prompt), 'hit_rate_after_turn_1': hit_rate(later_c, later_p)}


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), 'big')


async def watch_health(router: Router, probe: Any, interval_s: float) -> None:
    """``router``'s health checks (:meth:`Router.check_health`) every ``interval_s`` seconds,
    until cancelled (the task a backend of several servers keeps on its loop)."""
    while True:
        await asyncio.sleep(interval_s)
        await router.check_health(probe)
