"""Worker for the shared launches (tests/distributed/launch.py): runs each run of a spec, in order, in this process
(one-process runs) or on every rank of a torchrun world over gloo (the process group is made once, for all of them).

The spec: a JSON list of [folder, "module:function", *args]; each run is function(folder, *args). It leaves the file
`started` in its folder when it begins and `finished` once every rank has returned from it. A run that raises writes
its traceback to `failed.rank<r>.txt` in its folder and ends the launch (torchrun then stops the other ranks): a rank
could be left waiting in a collective the failed rank will never join. Runs must undo what they change of the process
(patched functions, torch's default dtype); the worker resets dynamo's compiled frames and torch's deterministic switch
between runs."""

import gc
import importlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed.launch import COLLECTIVE_TIMEOUT_S, FAILED, FINISHED, STARTED


def main(spec: str) -> None:
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank = dist.get_rank() if distributed else 0
    for folder, target, *args in json.loads(Path(spec).read_text()):
        module, function = target.split(":")
        Path(folder, STARTED).touch()
        started, cpu_started = time.perf_counter(), time.process_time()
        try:
            getattr(importlib.import_module(module), function)(folder, *args)
            assert torch.get_default_dtype() == torch.float32, f"{target} left the default dtype changed"
            if "torch._dynamo" in sys.modules:  # else nothing was compiled (and its import takes seconds)
                torch._dynamo.reset()
            torch.use_deterministic_algorithms(False)  # the trainer's training.deterministic switches it process-wide
            gc.collect()
            # What survives (torch's and the imports' ~300k objects, mostly) is left out of later collections: a full
            # one scans them all, ~0.2 s of CPU, after each run on each rank.
            gc.freeze()
            if distributed:
                dist.barrier()
        except BaseException:
            Path(folder, FAILED.format(f"rank{rank}")).write_text(traceback.format_exc())
            raise
        cpu = torch.tensor(time.process_time() - cpu_started, dtype=torch.float64)
        if distributed:
            dist.all_reduce(cpu)  # the CPU time of every rank: what a run costs the suite's cores
        if rank == 0:
            Path(folder, FINISHED).touch()
            print(f"{folder}: {time.perf_counter() - started:.1f} s, {cpu.item():.1f} CPU-s", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    gc.unfreeze()
    gc.collect()  # the process groups freed before the interpreter finalizes (harness/train.py)
