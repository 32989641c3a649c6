"""Several ranks simulated in one process: one thread per rank, joined by a barrier ``gather_fn``
with accelerate's ``gather_object`` convention (each rank passes a list, all get the concatenation)."""
from __future__ import annotations

import threading
from typing import Any, Callable, List

from mtflow import Scheduler
from tests.helpers import out


class BarrierGather:

    def __init__(self, world_size: int, timeout: float = 30.0) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.slots: List[Any] = [None] * world_size
        self.calls = [0] * world_size

    def for_rank(self, rank: int) -> Callable[[List[bool]], List[bool]]:

        def gather(values: List[bool]) -> List[bool]:
            self.calls[rank] += 1
            self.slots[rank] = list(values)
            self.barrier.wait()
            merged = [v for slot in self.slots for v in slot]
            self.barrier.wait()  # nobody overwrites a slot before everyone has read
            return merged

        return gather


def run_ranks(world_size: int, target: Callable[[int, Callable], Any], timeout: float = 60.0) -> List[Any]:
    """Run ``target(rank, gather_fn)`` on ``world_size`` threads; return each rank's result (or
    raise the first exception). A hang (a rank left waiting) breaks the barrier and fails."""
    gather = BarrierGather(world_size)
    results: List[Any] = [None] * world_size
    errors: List[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = target(rank, gather.for_rank(rank))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)
            gather.barrier.abort()

    threads = [threading.Thread(target=body, args=(r, ), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            gather.barrier.abort()
            raise TimeoutError('a rank is still running: the ranks fell out of step')
    if errors:
        raise errors[0]
    return results


# ---- the rank scenario shared by the threaded tests (tests/test_ranks.py) and the spawned gloo
# ranks (tests/distributed/workers.py): request ``rK-n`` takes n turns
class StopAfter(Scheduler):
    """Request ``rK-n`` finishes after n turns; steps add an observation."""

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': f'obs {current_turn}'})
        return {'infer_request': infer_request, 'rollout_infos': {'last_step': current_turn}}

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= int(infer_request.uuid.split('-')[1])


def make_output(r, n):
    return out(f'{r.uuid} turn {n + 1}', [n + 1, n + 2], [-.5, -.25])


def first_outputs(requests):
    return [out(f'{r.uuid} turn 1', [1, 2], [-.5, -.25]) for r in requests]
