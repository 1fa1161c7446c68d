"""Worker for test_stop_vote (a run of the shared launches, tests/distributed/launch.py): two gloo ranks vote at
four step boundaries through StopRequested.agreed. Rank 1 enters the first boundary only once rank 0 has come back
from it: a vote that waited for its own all-reduce would leave the ranks waiting for each other there (the store's
wait then times out). Each rank writes what every boundary, then two settles, returned."""

import json
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from harness.preemption import INTERRUPTED, TERMINATED, StopRequested


def vote(folder: str) -> None:
    store = dist.distributed_c10d._get_default_store()
    timeout = store.timeout
    store.set_timeout(timedelta(seconds=30))
    try:
        _vote(folder, store)
    finally:
        store.set_timeout(timeout)  # the launch's next runs wait on the store as long as they did before


def _vote(folder: str, store: dist.Store) -> None:
    rank = dist.get_rank()
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
    Path(folder, f"rank{rank}.json").write_text(json.dumps(results))
