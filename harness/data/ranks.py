"""The data's collectives over the default process group (a no-op in one process): every rank's share of a step,
and one rank's failure raised on every rank, so that no rank waits at a collective for one that has failed."""

from __future__ import annotations

from typing import Callable, TypeVar

from .errors import DataError

T = TypeVar("T")


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_and_world() -> tuple[int, int]:
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)


def all_gather(obj) -> list:
    dist = _dist()
    if dist is None:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def on_every_rank(step: Callable[[], T], what: str) -> T:
    """Run `step` here, then fail on every rank if it failed on any: a DataError elsewhere is a DataError here
    too (bad input: exit 2 on every rank). Collective: every rank calls it, in the same order. Without it a failing
    rank would leave the others waiting at the next collective until a timeout."""
    result, error = None, None
    try:
        result = step()
    except Exception as e:  # not BaseException: Ctrl-C stops this rank as usual
        error = e
    failure = None if error is None else (isinstance(error, DataError), f"{type(error).__name__}: {error}")
    failures = all_gather(failure)
    if error is not None:
        error.every_rank = True  # every rank knows: rank 0 names it (harness/train.py)
        raise error
    for rank, failure in enumerate(failures):
        if failure is not None:
            is_data_error, message = failure
            raised = (DataError if is_data_error else RuntimeError)(f"{what} failed on rank {rank}: {message}")
            raised.every_rank = True
            raise raised
    return result
