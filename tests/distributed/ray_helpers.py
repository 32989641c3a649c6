"""Pieces of the Ray tests that the actors import (module-level, so the spec pickles by reference):
a dataset whose request ``qK`` takes ``K % 4 + 1`` turns, a scripted backend keyed by uuid and
turn (so a request's outputs do not depend on which actor runs it, or how often it was retried),
and a gate that holds one request at one turn until its actor is killed."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

from mtflow import Branching, Scheduler
from mtflow.backends.scripted import ScriptedBackend
from tests.helpers import req


def turns_of(k: int) -> int:
    return k % 4 + 1


def dataset(n: int) -> List[Any]:
    return [req(f'q{k}', data_dict={'turns': turns_of(k)}) for k in range(n)]


def script(n: int) -> List[dict]:
    return [{'uuid': f'q{k}', 'turn': t, 'content': f'q{k} says {t}', 'token_ids': [k, t, 7],
             'logprobs': [-.1, -.2, -.3]}
            for k in range(n) for t in range(1, turns_of(k) + 1)]


class CountTurns(Scheduler):
    """Finishes request ``qK`` after its ``data_dict['turns']`` turns; steps add an observation."""

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': f'observation {current_turn}'})
        return {'infer_request': infer_request, 'rollout_infos': {'observed': current_turn}}

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= infer_request.data_dict['turns']


def make_scheduler(tokenizer: Any = None) -> CountTurns:
    return CountTurns()


class Gated:
    """``rollout_fn`` over a scripted backend that, the first time ``victim`` asks for turn
    ``at_turn`` anywhere, writes this actor's name to ``gate/claimed`` and blocks (until the test
    kills the actor; after ``hold_s`` it gives up and goes on, so a broken test cannot hang)."""

    def __init__(self, n: int, gate: Optional[str], victim: str = 'q5', at_turn: int = 2, hold_s: float = 240.0):
        self.inner = ScriptedBackend(outputs=script(n))
        self.gate = Path(gate) if gate else None
        self.victim, self.at_turn, self.hold_s = victim, at_turn, hold_s
        self.turns: dict = {}

    def describe(self) -> str:
        return 'scripted (gated)'

    @property
    def stats(self) -> Any:
        return self.inner.stats

    def fork(self, parent: str, children: List[str]) -> None:  # a branched run's children go on from their parent
        self.inner.fork(parent, children)

    def __call__(self, requests: List[Any], request_config: Any) -> Any:
        for r in requests:
            self.turns[r.uuid] = self.turns.get(r.uuid, 0) + 1
            if self.gate is not None and r.uuid == self.victim and self.turns[r.uuid] == self.at_turn:
                self.hold()
        return self.inner(requests, request_config)

    def hold(self) -> None:
        import ray

        try:
            fd = os.open(self.gate / 'claimed', os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:  # a retry of the victim: it goes through
            return
        os.write(fd, ray.get_runtime_context().get_actor_name().encode())
        os.close(fd)
        deadline = time.monotonic() + self.hold_s
        while time.monotonic() < deadline:
            time.sleep(0.05)


def start_killer(gate: Path, ready: Callable[[], bool] = lambda: True) -> Tuple[threading.Thread, List[str]]:
    """A thread that kills (``ray.kill``) the actor whose name a :class:`Gated` backend wrote to
    ``gate/claimed``, once ``ready()``; the list gets the name killed."""
    import ray

    killed: List[str] = []

    def killer() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            claimed = gate / 'claimed'
            if claimed.exists() and claimed.read_text() and ready():
                name = claimed.read_text()
                ray.kill(ray.get_actor(name))
                killed.append(name)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    return thread, killed


def make_backend(n: int, gate: Optional[str] = None, victim: str = 'q5', at_turn: int = 2) -> Gated:
    return Gated(n, gate, victim, at_turn)


class BranchedCountTurns(CountTurns):
    """:class:`CountTurns` as a branched group (``docs/branching.md``): forked before turn 2 into 2,
    3 leaves per prompt (a prompt of 1 turn ends first and is topped up with copies)."""
    branch = Branching(at={'turn': 2}, copies=2, leaves=3)


def make_branched_scheduler(tokenizer: Any = None) -> BranchedCountTurns:
    return BranchedCountTurns()
