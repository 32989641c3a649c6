"""``gather_fn`` over real process groups, with accelerate's ``gather_object`` convention: each
rank passes a list, every rank gets the concatenation in rank order.

The executor calls ``gather_fn([has_live])`` once per turn on every rank and stops when no rank
has live requests, so every rank calls ``rollout_fn`` (a collective in colocated engines) the same
number of times. A failure inside the collective (a peer process died, a timeout) is raised as
:class:`GatherError` naming this rank and the call number, instead of a bare c10d error: the
rank fails fast and loudly rather than waiting forever.

Both functions import torch (and accelerate) only when called. Over more than one process they
register :func:`destroy_process_group_at_exit`: a gloo group left alive at interpreter exit aborts
now and then (SIGABRT, ``terminate called without an active exception``), and a job that uses
mtflow's gather must not need to know that.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

from mtflow.core.errors import MtflowError
from mtflow.distributed.teardown import destroy_process_group_at_exit

__all__ = ['torch_gather', 'accelerate_gather', 'GatherError']

GatherFn = Callable[[List[Any]], List[Any]]


class GatherError(MtflowError):
    """A collective of ``gather_fn`` failed: a peer died, the group timed out or was destroyed."""

    def __init__(self, message: str, *, rank: Optional[int] = None, call: Optional[int] = None) -> None:
        self.rank, self.call = rank, call
        super().__init__(message)


def _require_group(dist: Any, what: str) -> None:
    if not dist.is_available():
        raise GatherError(f'{what}: this torch build has no torch.distributed')
    if not dist.is_initialized():
        raise GatherError(f'{what}: no default process group; call torch.distributed.init_process_group() first '
                          '(torchrun sets the environment for it), or use mtflow.identity_gather on one process')


def torch_gather(group: Any = None) -> GatherFn:
    """The ``gather_fn`` of this rank over ``torch.distributed.all_gather_object`` on ``group``
    (default: the whole world).

    Call it after ``init_process_group`` (the group's world size is fixed at that point). With
    NCCL, ``all_gather_object`` stages the pickled objects on the current CUDA device, so call
    ``torch.cuda.set_device(local_rank)`` first, as every NCCL job does."""
    import torch.distributed as dist

    _require_group(dist, 'torch_gather')
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if dist.get_world_size() > 1:
        destroy_process_group_at_exit()
    calls = 0

    def gather(values: List[Any]) -> List[Any]:
        nonlocal calls
        calls += 1
        buckets: List[Any] = [None] * world
        try:
            dist.all_gather_object(buckets, list(values), group=group)
        except Exception as exc:  # c10d raises RuntimeError/DistBackendError; keep the cause
            raise GatherError(
                f'torch_gather: all_gather_object failed on rank {rank} of {world} at call {calls} '
                f'({type(exc).__name__}: {_first_line(exc)}); another rank probably died or left the loop',
                rank=rank, call=calls) from exc
        merged: List[Any] = []
        for bucket in buckets:
            merged.extend(bucket)
        return merged

    gather.world_size = world  # type: ignore[attr-defined]
    gather.rank = rank  # type: ignore[attr-defined]
    return gather


def accelerate_gather() -> GatherFn:
    """The ``gather_fn`` of this process over ``accelerate.utils.gather_object``.

    Uses (and, if none exists yet, creates) accelerate's ``PartialState``, which initialises the
    process group from the launcher's environment (``accelerate launch`` or torchrun). On a single
    process it returns its input, like :func:`mtflow.identity_gather`."""
    from accelerate import PartialState
    from accelerate.utils import gather_object, parse_flag_from_env

    # an existing state (an Accelerator made by the job) is reused as is; else, as `accelerate
    # launch --cpu` would, ACCELERATE_USE_CPU selects gloo on CPU
    state = PartialState(cpu=parse_flag_from_env('ACCELERATE_USE_CPU'))
    rank, world = state.process_index, state.num_processes
    _check_accelerate_world(world)
    if world > 1:
        destroy_process_group_at_exit()
    calls = 0

    def gather(values: List[Any]) -> List[Any]:
        nonlocal calls
        calls += 1
        try:
            return list(gather_object(list(values)))
        except Exception as exc:
            raise GatherError(
                f'accelerate_gather: gather_object failed on process {rank} of {world} at call {calls} '
                f'({type(exc).__name__}: {_first_line(exc)}); another process probably died or left the loop',
                rank=rank, call=calls) from exc

    gather.world_size = world  # type: ignore[attr-defined]
    gather.rank = rank  # type: ignore[attr-defined]
    return gather


def _check_accelerate_world(world: int) -> None:
    """accelerate's state says one process while torch.distributed has several (e.g. a CPU job
    whose state was made without ``cpu=True``): its ``gather_object`` would return this rank's
    list alone, the ranks would disagree about when to stop, and the collective engine would hang."""
    import torch.distributed as dist

    if world == 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise GatherError(f'accelerate_gather: accelerate sees 1 process but torch.distributed has '
                          f'{dist.get_world_size()}; on CPU create the state with cpu=True (or set '
                          'ACCELERATE_USE_CPU=true), or use mtflow.distributed.torch_gather()')


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [''])[0][:300]
