"""How far a run is and when it ends: requests finished, turns done against the run's bound,
tokens/s and an ETA, shown as a live bar (both stdout and stderr are terminals) or as one log line
every ``interval_s`` seconds (a pipe, ``nohup``, a cluster job's log), or not at all.

Why turns and not requests: in lockstep every request of a batch finishes at about the same
turn, so a request count reads ``0/16`` until the end. The bound is ``requests x max_turns``; a
request that finishes early gives its unplayed turns back, so the bound only shrinks. A turn is
one generation of one of the run's requests (a compaction's summary call is none), counted when
its model call returns, in lockstep and async alike, so the count never passes the bound. The
ETA (:mod:`mtflow.run.eta`) is what is left of the bound at the speed of the last turns, an upper
estimate that tightens as requests finish; ``ETA >1:30`` before the first turn ends (a lower
bound: the turns left, each at least as long as the first has taken so far).
"""
from __future__ import annotations

import sys
import threading
import time
from typing import IO, Any, Callable, Dict, List, Optional

from mtflow.run.eta import Eta

__all__ = ['RunProgress', 'ProgressBar', 'progress_mode', 'format_duration']

#: ``bar``: a live rich bar on stderr; ``log``: a line every ``interval_s`` on the stream; ``off``
MODES = ('bar', 'log', 'off')


def progress_mode(enabled: bool, stdout: Any = None, stderr: Any = None) -> str:
    """``off`` when disabled; ``bar`` when stdout and stderr are both terminals; else ``log``."""
    if not enabled:
        return 'off'
    out, err = stdout or sys.stdout, stderr or sys.stderr
    ttys = all(callable(getattr(s, 'isatty', None)) and s.isatty() for s in (out, err))
    return 'bar' if ttys else 'log'


def format_duration(seconds: Optional[float]) -> str:
    """``1:05`` (m:ss), ``2:03:04`` past an hour, ``?`` when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return '?'
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f'{h}:{m:02d}:{s:02d}' if h else f'{m}:{s:02d}'


class RunProgress:
    """The figures of a run in progress and their display.

    Args:
        mode: one of :data:`MODES`.
        total: requests this attempt rolls out.
        max_turns: the run's turn limit (``None``: unlimited, no turn bound).
        interval_s: seconds between log lines (``log`` mode).
        tokens: returns the tokens generated so far by this attempt (e.g. the backend's
            counter), or ``None`` to count them from the finished requests' trace events.
        stream: where log lines go (default: stdout, where the summary table goes).
        listener: called with :meth:`figures` at every turn and finished request, and once at
            :meth:`stop` (``--log tensorboard|wandb``, ``mtflow/run/tracking.py``), in every mode.
        label: what the bar says the run does (``rollout``; ``mtflow rescore``: ``rescore``); a
            log line of another label than ``rollout`` starts ``mtflow <label>:``.
        lockstep, batch_size: how the run drives its requests (the ETA's model of what is left).
    """

    def __init__(self, mode: str, total: int, max_turns: Optional[int] = None, interval_s: float = 10.0,
                 tokens: Optional[Callable[[], Optional[int]]] = None, stream: Optional[IO[str]] = None,
                 description: str = '', listener: Optional[Callable[[Dict[str, Any]], None]] = None,
                 label: str = 'rollout', lockstep: bool = True, batch_size: int = 1) -> None:
        if mode not in MODES:
            raise ValueError(f'progress mode must be one of {MODES}, not {mode!r}')
        if interval_s <= 0:
            raise ValueError(f'the progress interval must be > 0 seconds, not {interval_s}')
        self.mode, self.total, self.max_turns, self.interval_s = mode, total, max_turns or None, interval_s
        self.tokens_fn = tokens
        self.stream = stream
        self.listener = listener
        self.finished = 0  # requests written (what "done: N/M requests" counts)
        #: ``total`` counts every leaf of each prompt's tree already (a leaf budget: ``branch.leaves``)
        self.leaves_counted = False
        self.interrupted = 0  # requests a stop cut short: not written, run again by --resume
        self.turns_done = 0  # turns generated (a lockstep turn of k live requests is k turns)
        self.turns_of_finished = 0
        self.turns_given_back = 0  # unplayed turns of requests that finished before max_turns
        self.finished_tokens = 0
        self.live = 0
        self.description = description
        self.label = label
        self.started: Optional[float] = None
        self.eta = Eta(total, self.max_turns, lockstep=lockstep, batch_size=batch_size)
        self._counted_turns = False  # the model calls feed turns_done; else (a Ray fan-out) the finished requests do
        self._bar: Any = None
        self._task: Any = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lines = 0

    @property
    def enabled(self) -> bool:
        """Whether anything follows the figures (a display or a listener)."""
        return self.mode != 'off' or self.listener is not None

    # ---- what the run reports ------------------------------------------------------------------
    def on_batch(self, size: int) -> None:
        """A lockstep batch of ``size`` requests starts."""
        self.eta.batch_started(size)

    def on_call(self) -> None:
        """A lockstep model call over the batch's live requests begins."""
        self.eta.call_started()

    def on_turn(self, live: int) -> None:
        """One generation over ``live`` requests is done (a lockstep turn)."""
        if live <= 0:  # the executor's empty call that keeps ranks in step is no turn
            return
        self._counted_turns = True
        self.turns_done += live
        self.live = live
        self.eta.call_done(live)
        self._refresh()

    def on_request_turn(self, uuid: str) -> None:
        """One request's generation is done (async: its own model call returned)."""
        self._counted_turns = True
        self.turns_done += 1
        self.eta.turn_done(uuid)
        self._refresh()

    def on_fork(self, parent: str, children: List[str], turns: int) -> None:
        """``parent`` was forked into ``children`` (``docs/branching.md``), which hold its ``turns``
        turns: each child is a request to write (unless the total already counted every leaf a
        prompt's tree will have) and its inherited turns count as played, as its line will count
        them, so the count and its bound stay in step."""
        if not self.leaves_counted:
            self.total += len(children)
            self.eta.total += len(children)
        self.eta.started += len(children)
        self.turns_done += len(children) * int(turns)
        self._refresh()

    def on_finished(self, num_turns: Optional[int], tokens: int = 0, written: bool = True,
                    uuid: Optional[str] = None) -> None:
        """One request finished after ``num_turns`` turns, having generated ``tokens``;
        ``written=False``: cut short by a stop (``interrupted.jsonl``, run again by ``--resume``),
        so its turns count but it is no finished request."""
        self.eta.request_done(uuid)
        if written:
            self.finished += 1
        else:
            self.interrupted += 1
        n = int(num_turns or 0)
        self.turns_of_finished += n
        if self.max_turns is not None:
            self.turns_given_back += max(self.max_turns - n, 0)
        self.finished_tokens += int(tokens or 0)
        self._refresh()

    def update(self, completed: int, description: str = '') -> None:
        """Requests delivered so far (a Ray fan-out reports only these)."""
        self.finished = completed
        self.description = description
        self._refresh()

    # ---- the figures ---------------------------------------------------------------------------
    def figures(self) -> Dict[str, Any]:
        now = time.perf_counter()
        elapsed = now - self.started if self.started is not None else 0.0
        turns = self.turns_done if self._counted_turns else self.turns_of_finished
        bound = self.total * self.max_turns - self.turns_given_back if self.max_turns is not None else None
        tokens = self.tokens_fn() if self.tokens_fn is not None else None
        if tokens is None:
            tokens = self.finished_tokens
        eta: Optional[float] = 0.0
        at_least = False
        if self.finished >= self.total and self.total:
            pass
        elif not self._counted_turns and self.finished:  # only deliveries are known (a Ray fan-out)
            eta = (self.total - self.finished) * elapsed / self.finished if elapsed > 0 else None
        else:
            eta, at_least = self.eta.estimate(max(bound - turns, 0) if bound is not None else None,
                                              self.finished + self.interrupted)
        return {'finished': self.finished, 'total': self.total, 'turns': turns, 'turn_bound': bound,
                'tokens': tokens, 'tokens_per_s': round(tokens / elapsed, 1) if elapsed > 0 else None,
                'elapsed_s': round(elapsed, 3), 'eta_s': round(eta, 3) if eta is not None else None,
                'eta_is_lower_bound': at_least}

    def text(self) -> str:
        """``12/16 requests, turns 70/96, 35.2 tokens/s, elapsed 0:20, ETA 0:05``."""
        f = self.figures()
        turns = f"turns {f['turns']}/{f['turn_bound']}, " if f['turn_bound'] is not None else (
            f"turns {f['turns']}, " if f['turns'] else '')  # a Ray fan-out reports no turns
        tps = f"{f['tokens_per_s']} tokens/s" if f['tokens_per_s'] is not None else '? tokens/s'
        cut = f" ({self.interrupted} interrupted)" if self.interrupted else ''
        at_least = '>' if f['eta_is_lower_bound'] else ''
        return (f"{f['finished']}/{f['total']} requests{cut}, {turns}{tps}, elapsed {format_duration(f['elapsed_s'])}, "
                f"ETA {at_least}{format_duration(f['eta_s'])}")

    # ---- the display ---------------------------------------------------------------------------
    def start(self) -> None:
        self.started = time.perf_counter()
        self.eta.start()
        if self.mode == 'bar':
            # rich's progress module costs ~0.1 s to import; a quiet run never pays it
            from rich.console import Console
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

            self._bar = Progress(SpinnerColumn(), TextColumn(f'[bold]{self.label}'), BarColumn(), TextColumn('{task.description}'),
                                 console=Console(stderr=True), transient=False)
            bound = self.total * self.max_turns if self.max_turns else self.total
            self._task = self._bar.add_task(self.text(), total=bound or 1)
            self._bar.start()
        elif self.mode == 'log':
            self._thread = threading.Thread(target=self._log_loop, name='mtflow-progress', daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self.listener is not None and self.started is not None:
            self.listener(self.figures())
        if self._bar is not None:
            self._refresh()
            self._bar.stop()
            self._bar = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
            self._log_line('done')

    def _refresh(self) -> None:
        if self.listener is not None:
            self.listener(self.figures())
        if self._bar is None:
            return
        f = self.figures()
        if f['turn_bound'] is not None:
            self._bar.update(self._task, completed=f['turns'], total=max(f['turn_bound'], 1), description=self.text())
        else:
            self._bar.update(self._task, completed=f['finished'], total=max(self.total, 1), description=self.text())

    def _log_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._log_line()

    def _log_line(self, tag: str = '') -> None:
        stream = self.stream or sys.stdout
        try:
            who = 'mtflow' if self.label == 'rollout' else f'mtflow {self.label}'
            stream.write(f"{who}: {'done: ' if tag else ''}{self.text()}\n")
            stream.flush()
            self.lines += 1
        except (OSError, ValueError):  # a closed pipe: the run goes on without its log
            pass


def ProgressBar(enabled: Any, total: int, description: str = '', **kwargs: Any) -> RunProgress:  # noqa: N802
    """The progress of a run of ``total`` requests: ``enabled`` is a mode of :data:`MODES`, or a
    bool (``True``: a bar or log lines as :func:`progress_mode` decides)."""
    mode = enabled if isinstance(enabled, str) else progress_mode(bool(enabled))
    return RunProgress(mode, total, description=description, **kwargs)
