"""Worker for test_reshard_vote (a run of the shared launches, tests/distributed/launch.py): two gloo ranks ask
whether the gathered weights fit (parallel/reshard_policy.py) with peaks that fit on one rank only, then on both;
each writes its answers."""

import json
from pathlib import Path

import torch.distributed as dist

from parallel.reshard_policy import all_ranks_fit

GIB = 1024**3


def vote(folder: str) -> None:
    rank = dist.get_rank()
    answers = [all_ranks_fit((60 if rank == 0 else 70) * GIB, 4 * GIB, 80 * GIB, dist.group.WORLD),
               all_ranks_fit(60 * GIB, 4 * GIB, 80 * GIB, dist.group.WORLD)]
    Path(folder, f"rank{rank}.json").write_text(json.dumps(answers))
