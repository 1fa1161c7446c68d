"""Worker for test_reshard_vote: two gloo ranks ask whether the gathered weights fit (parallel/reshard_policy.py)
with peaks that fit on one rank only, then on both; each writes its answers."""

import gc
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from parallel.reshard_policy import all_ranks_fit

GIB = 1024**3


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    answers = [all_ranks_fit((60 if rank == 0 else 70) * GIB, 4 * GIB, 80 * GIB, dist.group.WORLD),
               all_ranks_fit(60 * GIB, 4 * GIB, 80 * GIB, dist.group.WORLD)]
    Path(out, f"rank{rank}.json").write_text(json.dumps(answers))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(*sys.argv[1:])
    gc.collect()  # the process group freed before the interpreter finalizes (harness/train.py)
