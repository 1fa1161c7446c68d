"""Worker for test_run_lock (a run of the shared launches, tests/distributed/launch.py): the run lock's verdict on 2
gloo ranks. Rank 0 first holds <folder>/dump itself, as another run would; both ranks then ask for it, are refused
with rank 0's message, and ask again once it is free. Each rank writes what it met to <folder>/rank<r>.json."""

import json
import os

import torch.distributed as dist

from harness.run_lock import RunLockError, acquire_run_lock


def verdict(folder: str) -> None:
    rank, dump = dist.get_rank(), os.path.join(folder, "dump")
    other_run = acquire_run_lock(dump, 0) if rank == 0 else None  # one process's lock, as a run on 1 process takes
    met = {}
    try:
        acquire_run_lock(dump, rank, dist.group.WORLD)
    except RunLockError as err:
        met["refused"] = str(err)
    if other_run is not None:
        other_run.release()
    lock = acquire_run_lock(dump, rank, dist.group.WORLD)
    met["held"] = lock.held
    lock.release()
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(met, f)
