"""How long a run has left: an estimate that errs on the long side and follows the machine's speed.

The work left is bounded by the turn limit: a live request may play every turn up to
``max_turns``, a request not started all of them (requests that stop early give theirs back, so
the estimate only tightens). The time a turn takes is what the latest turns took, not the run's
average: under a load that changes, the average is the speed of another machine. And the part of
a turn still running counts with the time it has taken so far, so a slowdown shows before it ends.

- **lockstep**: a batch is a sequence of turns, each the steps of its live requests (none before
  the first) and one model call over them. What is left is the current batch's turns up to
  ``max_turns`` and ``max_turns`` turns for each batch not started, each as long as the longest
  step phase plus the longest call of this batch and the one before (a batch's first turns are
  its widest, its later ones have longer prompts, a rising load makes any longer: the longest
  covers them). Counting request-turns at the run's average rate instead made the tail of a
  batch look fast (2 live requests at turn 5 are 2 request-turns, but a whole lockstep turn
  each) and the next batch's wide turns look as cheap as that tail. A load that keeps rising
  (other jobs starting one after another) makes every turn left longer than the last one: when
  each phase's last turns of one width in the rate window all got longer, turn after turn
  (:func:`rise_rate`, the smallest of the last rises, and a least-squares slope beyond its
  noise), that rise is carried on for as long as it has lasted, at most the time left
  (:func:`extrapolated`); it stops as soon as one turn is no longer than the one before, so a
  load that stepped up once and stays is a new speed, not a trend.
- **async**: requests advance on their own; what is left is the largest of the turns of the bound
  at the recent rate (turns finished per second over a window that ends now), the same turns
  shared by the live requests each at its recent pace (Little's law: the live requests over the
  time between two turns of one request; the window's rate lags when that pace slows or fewer
  requests are live; a request in its first turn is not heard from yet, so while requests are
  left the live ones are as many as the run has had at once), and the turns the furthest-behind
  live request may still play at that pace (the tail of a run, when few requests are left, goes
  at one request's pace).

Until a first call has returned, and in lockstep a first step phase has ended (a turn's length
is not known before), the estimate is a lower bound (:attr:`Eta.lower_bound`): the turns left,
each at least as long as what is known of one so far. Without ``max_turns`` there is no bound,
and the estimate is the requests left at the recent request rate.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

__all__ = ['Eta']

#: the rate window: at least this many seconds, or this share of the elapsed time
WINDOW_S, WINDOW_SHARE = 5.0, 0.1
#: at least this many completions in a rate window (it reaches further back when fewer are in it)
WINDOW_MIN_EVENTS = 4
#: a rising load: the slope of a turn's length over the last this many measurements (at least
#: TREND_MIN_POINTS) is extrapolated when it exceeds TREND_T times its standard error
TREND_POINTS, TREND_MIN_POINTS, TREND_T = 6, 3, 2.0


def rise_rate(points: List[Tuple[float, float]]) -> float:
    """How fast a length grows, as a share of itself per second: the least-squares slope of
    ``(time, seconds)`` over ``points`` divided by the fitted length at the last point; 0 unless
    the slope is positive and more than :data:`TREND_T` standard errors (noise is no trend), or
    with fewer than :data:`TREND_MIN_POINTS` points. A flat or falling series gives 0: the
    estimate only extrapolates a rise, and stops as soon as the last points flatten."""
    n = len(points)
    if n < TREND_MIN_POINTS:
        return 0.0
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((t - mt) ** 2 for t, _ in points)
    if sxx <= 0:
        return 0.0
    slope = sum((t - mt) * (y - my) for t, y in points) / sxx
    if slope <= 0:
        return 0.0
    residual = sum((y - my - slope * (t - mt)) ** 2 for t, y in points)
    se = math.sqrt(residual / (n - 2) / sxx) if n > 2 else 0.0
    if slope <= TREND_T * se:
        return 0.0
    at_last = my + slope * (points[-1][0] - mt)
    return slope / at_last if at_last > 0 else 0.0


def extrapolated(seconds: float, rate: float, horizon: float = math.inf) -> float:
    """``seconds`` of work at today's speed when the work of each second from now takes ``rate``
    more of its length per second, for ``horizon`` seconds (then stays): a rise carried on for as
    long as it has lasted. Each turn is longer by the rise until it starts, which is counted at
    today's speed (first order: the rise's own lengthening is not compounded)."""
    if rate <= 0 or seconds <= 0:
        return seconds
    h = min(max(horizon, 0.0), seconds)
    return seconds + rate * (h * seconds - h * h / 2.0)


class Eta:
    """The estimate (module docstring), fed by the run as it goes (from the driver's thread)
    and read from the progress log's thread: one lock keeps the two apart.

    Args:
        total: requests this attempt rolls out.
        max_turns: the turn limit (``None``: no bound).
        lockstep: the lockstep driver (batches of turns), else async.
        batch_size: requests per lockstep batch.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, total: int, max_turns: Optional[int], lockstep: bool = True, batch_size: int = 1,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.total, self.max_turns, self.lockstep = total, max_turns or None, lockstep
        self.batch_size = max(int(batch_size or 1), 1)
        self.clock = clock
        self.t0 = clock()
        # lockstep
        self.started = 0        # requests handed to a batch
        self.batch_turn = 0     # the current batch's model calls returned
        self.call_began: Optional[float] = None  # the model call running now began
        self.call_ended: Optional[float] = None  # the batch's last model call returned (its steps run since)
        self.longest = {'call': 0.0, 'steps': 0.0}   # this batch's longest call and step phase
        self.before = {'call': 0.0, 'steps': 0.0}    # the batch before's
        self.known = {'call': False, 'steps': False}  # measured at least once
        # every measurement: (when it ended, live requests, seconds), for the trend of each phase
        self.history: Dict[str, Deque[Tuple[float, int, float]]] = {'call': deque(maxlen=256), 'steps': deque(maxlen=256)}
        self._steps_pending: Optional[Tuple[float, float]] = None  # a step phase, until its call tells its width
        # async
        self.turn_times: Deque[float] = deque(maxlen=4096)  # when each request-turn finished
        self.request_turns: Dict[str, Tuple[int, float]] = {}  # uuid -> (turns so far, when its last ended)
        self.gaps: Deque[float] = deque(maxlen=64)  # seconds between two turns of one request
        self.done_times: Deque[float] = deque(maxlen=4096)  # when each request finished
        self.most_live = 0  # the most requests at once that had played a turn and not finished
        self.lower_bound = False  # the last estimate is a lower bound
        self._lock = threading.Lock()

    # ---- what the run reports ------------------------------------------------------------------
    def start(self) -> None:
        self.t0 = self.clock()

    def batch_started(self, size: int) -> None:
        with self._lock:
            self.started += size
            if self.batch_turn:
                self.before = dict(self.longest)
            self.batch_turn, self.longest = 0, {'call': 0.0, 'steps': 0.0}
            self.call_began = self.call_ended = None

    def call_started(self) -> None:
        """A lockstep model call over the batch's live requests begins (their steps are done)."""
        with self._lock:
            now = self.clock()
            if self.call_ended is not None:
                self._measured('steps', now - self.call_ended)
                self._steps_pending = (now, now - self.call_ended)
            self.call_began, self.call_ended = now, None

    def call_done(self, live: int = 0) -> None:
        """That call returned; ``live``: the requests it generated for (0: not told)."""
        with self._lock:
            now = self.clock()
            if self._steps_pending is not None:
                self.history['steps'].append((self._steps_pending[0], live, self._steps_pending[1]))
                self._steps_pending = None
            if self.call_began is not None:
                self._measured('call', now - self.call_began)
                self.history['call'].append((now, live, now - self.call_began))
            self.batch_turn += 1
            self.call_began, self.call_ended = None, now

    def _measured(self, phase: str, seconds: float) -> None:
        self.longest[phase] = max(self.longest[phase], seconds)
        self.known[phase] = True

    def turn_done(self, uuid: str) -> None:
        """One request's turn finished (async: its model call returned)."""
        with self._lock:
            now = self.clock()
            self.turn_times.append(now)
            turns, last = self.request_turns.get(uuid, (0, None))
            if last is not None:
                self.gaps.append(now - last)
            self.request_turns[uuid] = (turns + 1, now)
            self.most_live = max(self.most_live, len(self.request_turns))

    def request_done(self, uuid: Optional[str] = None) -> None:
        with self._lock:
            self.done_times.append(self.clock())
            if uuid is not None:
                self.request_turns.pop(uuid, None)

    # ---- the estimate --------------------------------------------------------------------------
    def seconds_left(self, turns_left: Optional[int], finished: int) -> Optional[float]:
        """Seconds until the run ends, ``None`` when nothing tells yet; ``turns_left``: the
        bound's turns not played (``None`` without a bound); ``finished``: requests done."""
        return self.estimate(turns_left, finished)[0]

    def estimate(self, turns_left: Optional[int], finished: int) -> Tuple[Optional[float], bool]:
        """:meth:`seconds_left` and whether it is only a lower bound, read together."""
        with self._lock:
            seconds = self._seconds_left(turns_left, finished)
            return seconds, self.lower_bound and seconds is not None and seconds > 0

    def _seconds_left(self, turns_left: Optional[int], finished: int) -> Optional[float]:
        self.lower_bound = False
        if finished >= self.total and self.total:
            return 0.0
        now = self.clock()
        if self.lockstep and self.max_turns is not None and (self.known['call'] or self.call_began is not None):
            return self._lockstep(now, finished)
        if turns_left is not None and self.turn_times:
            return self._async(now, turns_left)
        if self.done_times:
            per_request = self._seconds_per_event(self.done_times, now)
            return (self.total - finished) * per_request
        return None

    def _lockstep(self, now: float, finished: int) -> float:
        call = max(self.longest['call'], self.before['call'], 0.0 if self.call_began is None else now - self.call_began)
        steps = max(self.longest['steps'], self.before['steps'], 0.0 if self.call_ended is None else now - self.call_ended)
        self.lower_bound = not (self.known['call'] and (self.known['steps'] or self.max_turns == 1))
        live = self.started > finished
        turns_left = (self.max_turns - self.batch_turn if live else 0) + \
            math.ceil(max(self.total - self.started, 0) / self.batch_size) * self.max_turns
        seconds = max(turns_left, 1) * (call + steps)
        if self.lower_bound or call + steps <= 0:
            return seconds
        for phase, length in (('call', call), ('steps', steps)):
            rate, lasted = self._phase_rise(phase)
            seconds = extrapolated(seconds, rate * length / (call + steps), lasted) if rate else seconds
        return seconds

    def _phase_rise(self, phase: str) -> Tuple[float, float]:
        """How fast the phase's length rises (a share of itself per second) and for how long it has
        risen. The rate: the :func:`rise_rate` of its last :data:`TREND_POINTS` measurements as
        wide as its latest (same live requests: a batch's narrowing tail and the next batch's wide
        turns are no trend) within the rate window (turns of one width far apart, a batch's first
        turns each a batch apart, are too few to tell a step from a rise), and no more than the smallest rise between two of the last
        :data:`TREND_MIN_POINTS` (a rise every turn still shows: a load that stepped up once and
        stays there, or a turn that once ran long, is a new speed to keep, not a trend). How long:
        since the end of the last measurement of that width that was no longer than the one
        before it (each since has been longer), or since the first began."""
        history = self.history[phase]
        if not history:
            return 0.0, 0.0
        width, latest = history[-1][1], history[-1][0]
        since = latest - max(WINDOW_S, WINDOW_SHARE * (latest - self.t0))  # the rate window's
        same = [(t, seconds) for t, live, seconds in history if live == width and t >= since]
        points = same[-TREND_POINTS:]
        last = points[-TREND_MIN_POINTS:]
        if len(last) < TREND_MIN_POINTS or last[-1][1] <= 0:
            return 0.0, 0.0
        steady = min((y1 - y0) / (t1 - t0) if t1 > t0 else 0.0 for (t0, y0), (t1, y1) in zip(last, last[1:]))
        rate = min(rise_rate(points), max(steady, 0.0) / last[-1][1])
        if rate <= 0:
            return 0.0, 0.0
        first = len(same) - 1
        while first > 0 and same[first - 1][1] < same[first][1]:
            first -= 1
        began = same[first - 1][0] if first else same[0][0] - same[0][1]  # the last seen no longer, or the start
        return rate, same[-1][0] - began

    def _async(self, now: float, turns_left: int) -> float:
        throughput = turns_left * self._seconds_per_event(self.turn_times, now)
        if not self.gaps or not self.request_turns or self.max_turns is None:
            return throughput
        behind = min(turns for turns, _ in self.request_turns.values())
        mean_gap = sum(self.gaps) / len(self.gaps)
        gap = max(mean_gap, now - min(last for _, last in self.request_turns.values()))
        # the live requests, each at its recent pace: those heard from, or as many as the run has had
        # at once while more are left (one in its first turn is not heard from yet), all left at its end
        live = max(len(self.request_turns), min(self.most_live, self.total - len(self.done_times)))
        pace = turns_left * mean_gap / live
        return max(throughput, pace, max(self.max_turns - behind, 0) * gap)

    def _seconds_per_event(self, times: Deque[float], now: float) -> float:
        """Seconds per event over the recent window, which ends now (a stall counts): the events
        of the last :data:`WINDOW_S` seconds (or :data:`WINDOW_SHARE` of the run), at least
        :data:`WINDOW_MIN_EVENTS` of them, over the time since the event before them."""
        window = max(WINDOW_S, WINDOW_SHARE * (now - self.t0))
        n = max(sum(1 for t in times if t > now - window), min(WINDOW_MIN_EVENTS, len(times)))
        start = times[-n - 1] if n < len(times) else self.t0
        return max(now - start, 1e-9) / n
