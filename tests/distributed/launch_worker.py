"""Worker for test_launch (runs of the shared launches, tests/distributed/launch.py, that fail by design, and runs
after them). A run that fails only the first time marks that in <folder>.tried, a file beside its folder (a failed
run's folder is set aside when it runs again)."""

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _first_time(folder: str) -> bool:
    tried = Path(f"{folder}.tried")
    first = not tried.exists()
    tried.touch()
    return first


def fails_on_rank_1(folder: str) -> None:
    """Rank 1 leaves the first time as a killed process does (no traceback), and raises the second; rank 0 waits
    meanwhile, outside any collective, until the launcher stops it. Each rank's process id in <folder>/pid.rank<r>."""
    rank = dist.get_rank()
    Path(folder, f"pid.rank{rank}").write_text(str(os.getpid()))
    if rank == 1:
        if _first_time(folder):
            os._exit(1)
        raise RuntimeError("rank 1 fails this run by design")
    time.sleep(300)


def sums_over_the_ranks(folder: str) -> None:
    """An all-reduce of each rank's 1 over the launch's process group: the sum and the rank's process id in
    <folder>/rank<r>.json."""
    rank = dist.get_rank()
    total = torch.ones(())
    dist.all_reduce(total)
    Path(folder, f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "sum": total.item()}))


def fails_once(folder: str) -> None:
    if _first_time(folder):
        raise RuntimeError("this run fails the first time by design")
    Path(folder, "passed").touch()


def fails_never(folder: str) -> None:
    Path(folder, "passed").touch()
