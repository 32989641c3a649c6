"""What each spawned rank runs (importable, so ``spawn`` can find it): join the gloo group, run
the scenarios, write one JSON file per rank, and always tear the group down
(``destroy_process_group``) so the process exits cleanly (a group left alive at exit is what
aborts gloo processes with ``terminate called without an active exception``)."""
from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List

import mtflow
from tests.helpers import Counter, dump, req
from tests.ranks import StopAfter, first_outputs, make_output

#: a bound above every request's own turn count (the requests stop themselves)
MAX_TURNS = 10

# rank -> request uuids; the number after the dash is how many turns that request takes
LAYOUTS: Dict[int, Dict[str, List[List[str]]]] = {
    2: {
        'uneven': [['r0-1', 'r0-4'], ['r1-2', 'r1-6', 'r1-3']],
        'idle rank 1': [['r0-3', 'r0-5'], []],
        'idle rank 0': [[], ['r1-2']],
    },
    3: {
        'uneven': [['r0-1', 'r0-4'], ['r1-2'], ['r2-6', 'r2-1', 'r2-3']],
        'idle rank': [['r0-3', 'r0-5'], [], ['r2-2']],
        'all idle but one': [[], [], ['r2-4']],
    },
}


#: the raising scenario: rank 1 has requests that step at turn 2 (and one that is done by then)
RAISING = {2: [['r0-1', 'r0-4'], ['r1-2', 'r1-6', 'r1-3']], 3: [['r0-1', 'r0-4'], ['r1-2', 'r1-5'], ['r2-3']]}


class RaisingOnRank(StopAfter):
    """On the chosen rank every hook call raises from turn 2 on (a broken environment)."""

    def __init__(self, broken: bool) -> None:
        super().__init__()
        self.broken = broken

    def step(self, infer_request, response_choice, current_turn):
        if self.broken and current_turn >= 2:
            raise RuntimeError(f'environment of {infer_request.uuid} crashed at turn {current_turn}')
        return super().step(infer_request, response_choice, current_turn)


class Escaping(StopAfter):
    """A step that raises past the executor (``SystemExit`` is not a request failure): the process
    leaves the loop while its peers are still in it."""

    def step(self, infer_request, response_choice, current_turn):
        if current_turn == 2:
            raise SystemExit(3)
        return super().step(infer_request, response_choice, current_turn)


def run_shard(uuids: List[str], scheduler: Any, gather_fn: Any, rank: int, on_error: str = 'raise') -> tuple:
    rollout = Counter(make_output)
    requests = [req(u) for u in uuids]
    ex = mtflow.Executor(scheduler, rollout, gather_fn=gather_fn, rank=rank, on_error=on_error,
                         max_turns=MAX_TURNS)
    return ex.run(requests, first_outputs(requests)), rollout


def jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


# ---- scenarios: (rank, world, gather_fn) -> a JSON-able dict ---------------------------------------
def scenario_layouts(rank: int, world: int, gather: Callable) -> Dict[str, Any]:
    results = {}
    for name, shards in LAYOUTS[world].items():
        res, rollout = run_shard(shards[rank], StopAfter(), gather, rank)
        alone, alone_rollout = run_shard(shards[rank], StopAfter(), mtflow.identity_gather, rank)
        results[name] = {
            'outputs': jsonable(dump(res.outputs)),
            'alone': jsonable(dump(alone.outputs)),
            'finish_reasons': res.finish_reasons,
            'calls': rollout.calls,
            'alone_calls': len(alone_rollout.calls),
            'trace_ranks': sorted({e.rank for e in res.trace}),
        }
    return results


def scenario_raising(rank: int, world: int, gather: Callable) -> Dict[str, Any]:
    """Rank 1's scheduler raises for every request from turn 2; first with ``on_error='return'``,
    then with ``'raise'`` (rank 1 raises MultiTurnRolloutError after the loop, in step)."""
    shards = RAISING[world]
    report: Dict[str, Any] = {}
    for on_error in ('return', 'raise'):
        rollout = Counter(make_output)
        requests = [req(u) for u in shards[rank]]
        ex = mtflow.Executor(RaisingOnRank(rank == 1), rollout, gather_fn=gather, rank=rank, on_error=on_error,
                             max_turns=MAX_TURNS)
        try:
            res = ex.run(requests, first_outputs(requests))
            entry = {'raised': None, 'finish_reasons': res.finish_reasons,
                     'failures': [f.to_dict() for f in res.failures], 'outputs': jsonable(dump(res.outputs))}
        except mtflow.MultiTurnRolloutError as exc:
            entry = {'raised': type(exc).__name__, 'finish_reasons': exc.result.finish_reasons,
                     'failures': [f.to_dict() for f in exc.failures], 'outputs': jsonable(dump(exc.outputs))}
        entry['calls'] = len(rollout.calls)
        report[on_error] = entry
    return report


def scenario_peer_exits(rank: int, world: int, gather: Callable) -> Dict[str, Any]:
    """The last rank leaves the loop at turn 2 (an exception the executor does not catch); the
    others must get a GatherError, not wait forever."""
    shards = LAYOUTS[world]['uneven']
    scheduler = Escaping() if rank == world - 1 else StopAfter()
    try:
        run_shard(shards[rank], scheduler, gather, rank)
    except mtflow.MtflowError as exc:
        return {'error': type(exc).__name__, 'message': str(exc), 'call': getattr(exc, 'call', None)}
    return {'error': None}


class DriftOnLastRank(StopAfter):
    """On the last rank, ``r-5`` finishes at turn 2 instead of 5: a tensor-parallel group whose
    ranks drifted apart (they must hold the same live set)."""

    def __init__(self, drift: bool) -> None:
        super().__init__()
        self.drift = drift

    def check_finished(self, infer_request, response_choice, current_turn):
        if self.drift and infer_request.uuid == 'r-5' and current_turn == 2:
            return True
        return super().check_finished(infer_request, response_choice, current_turn)


def scenario_check_ranks(rank: int, world: int, gather: Callable) -> Dict[str, Any]:
    """Every rank holds the same requests (``Executor(check_ranks=True)``): agreeing ranks run
    as without the check; a rank that drifts makes every rank raise RankMismatchError at the
    same turn."""
    from mtflow.engine.executor import RankMismatchError

    uuids = ['r-1', 'r-5', 'r-3']
    report: Dict[str, Any] = {}
    for case in ('agree', 'drift'):
        rollout = Counter(make_output)
        requests = [req(u) for u in uuids]
        scheduler = DriftOnLastRank(case == 'drift' and rank == world - 1)
        ex = mtflow.Executor(scheduler, rollout, gather_fn=gather, rank=rank, check_ranks=True,
                             max_turns=MAX_TURNS)
        try:
            res = ex.run(requests, first_outputs(requests))
            report[case] = {'raised': None, 'outputs': jsonable(dump(res.outputs)), 'calls': len(rollout.calls)}
        except RankMismatchError as exc:
            report[case] = {'raised': type(exc).__name__, 'turn': exc.turn, 'ranks': list(exc.ranks),
                            'message': str(exc), 'finish_reasons': exc.result.finish_reasons,
                            'calls': len(rollout.calls)}
    return report


def scenario_branching(rank: int, world: int, gather: Callable) -> Dict[str, Any]:
    """Each rank forks its own requests (``docs/branching.md``) over the real group: its leaves
    and trees, and the same requests alone (no ``gather_fn``); an error is reported, not raised
    (the other scenarios' ranks go on)."""
    from tests.branching import test_ranks as B

    shards = B.SHARDS[:world] if world <= len(B.SHARDS) else B.SHARDS + [[]] * (world - len(B.SHARDS))
    try:
        together = B._run(shards[rank], gather, rank)
    except Exception as exc:  # noqa: BLE001 - what the test reports
        return {'error': f'{type(exc).__name__}: {exc}'}
    return {'together': together, 'alone': B._run(shards[rank])}


SCENARIOS = {
    'branching': scenario_branching,
    'check_ranks': scenario_check_ranks,
    'layouts': scenario_layouts,
    'raising': scenario_raising,
    'peer_exits': scenario_peer_exits,
}


def make_gather(kind: str) -> tuple:
    """Join the group the launcher set up; return ``(gather_fn, rank, world)``."""
    if kind == 'accelerate':
        from mtflow.distributed import accelerate_gather

        gather = accelerate_gather()  # PartialState() initialises the group from the environment
        return gather, gather.rank, gather.world_size
    import torch.distributed as dist

    from mtflow.distributed import torch_gather

    dist.init_process_group('gloo', timeout=timedelta(seconds=float(os.environ.get('MTFLOW_TEST_PG_TIMEOUT', 120))))
    return torch_gather(), dist.get_rank(), dist.get_world_size()


def rank_main(rank: int, kind: str, scenarios: List[str], out_dir: str) -> None:
    """Entry point of one spawned rank."""
    import torch.distributed as dist

    path = Path(out_dir) / f'rank{rank}.json'
    report: Dict[str, Any] = {'rank': rank}
    code = 0
    try:
        gather, got_rank, world = make_gather(kind)
        report.update(got_rank=got_rank, world=world)
        for name in scenarios:
            report[name] = SCENARIOS[name](rank, world, gather)
    except SystemExit as exc:
        report['exited'] = exc.code
        code = int(exc.code or 0)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        report['crash'] = ''.join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        code = 1
    finally:
        path.write_text(json.dumps(report, indent=1, default=str))
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    if code:
        sys.exit(code)
