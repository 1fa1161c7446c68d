"""Worker for test_stop_vote: two gloo ranks vote at four step boundaries through StopRequested.agreed. Rank 1
enters the first boundary only once rank 0 has come back from it: a vote that waited for its own all-reduce
would leave the ranks waiting for each other there (the store's wait then times out). Each rank writes what
every boundary, then two settles, returned."""

import gc
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from harness.preemption import INTERRUPTED, TERMINATED, StopRequested


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, store = dist.get_rank(), dist.distributed_c10d._get_default_store()
    store.set_timeout(timedelta(seconds=30))
    stop = StopRequested()
    results = []
    if rank == 1:
        store.wait(["rank0 left boundary 1"])  # rank 0 must not be waiting for rank 1 at boundary 1
    results.append(stop.agreed(dist.group.WORLD))
    if rank == 0:
        store.set("rank0 left boundary 1", "1")
    if rank == 1:
        stop.reason = TERMINATED  # SIGTERM on rank 1 only, during step 2
    results.append(stop.agreed(dist.group.WORLD))
    if rank == 0:
        stop.reason = INTERRUPTED  # Ctrl-C on rank 0 during step 3: the larger reason wins
    results.append(stop.agreed(dist.group.WORLD))
    results.append(stop.agreed(dist.group.WORLD))
    results.append(stop.settle())
    results.append(stop.settle())  # nothing in flight any more
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(*sys.argv[1:])
    gc.collect()  # the process group freed before the interpreter finalizes (harness/train.py)
