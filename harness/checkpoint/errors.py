"""What a checkpoint's failures are, and how every rank comes to the same verdict on them.

CheckpointError: a checkpoint that cannot be resumed or written (missing, incomplete, corrupt, saved for another
model, a file system that refused the write); harness/train.py turns it into one `error:` line and exit 2. `agreed`
makes one rank's finding every rank's decision, so that no rank is left waiting at a collective for one that raised.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed or written: missing, incomplete, corrupt, saved for another model, or a
    file system that refused the write. train.py turns it into one `error:` line and exit 2: from rank 0 alone when
    `every_rank` (a verdict all ranks reached together), else from each rank that met it."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


class ExportRefused(CheckpointError):
    """An export folder this program may not replace (it holds something else, or the checkpoint it is made from):
    a run at its end writes its export beside it instead (harness/trainer.py)."""


def agreed(error, group=None):
    """The first rank's error (a message, or any picklable value; None: no rank has one), the same on every rank:
    what each rank found alone (its own files, a write only it made) becomes every rank's decision, and no rank is
    left waiting at a collective for one that has raised."""
    if not dist.is_initialized():
        return error
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return next((e for e in errors if e is not None), None)


def rank_world(group=None) -> tuple[int, int]:
    return (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)


def first_cause(e: BaseException) -> BaseException:
    """The exception behind DCP's wrapper of per-rank failures (a BaseException), or `e` itself."""
    if isinstance(e, CheckpointException) and getattr(e, "failures", None):
        return next(iter(e.failures.values()))[0]  # (exception, traceback) of the first failed rank
    return e.__cause__ or e


def one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
