"""Worker for the shared launches (tests/distributed/launch.py): runs each run of a spec, in order, in this process
(one-process runs) or on every rank of a world of processes forked from it, over gloo (the process group is made once,
for all of them).

The ranks are forked after this process has imported torch, dynamo and the runs' modules: ranks started as fresh
interpreters (torchrun's) would each import them (~1.5 CPU-seconds for torch alone, as much again for dynamo and the
harness), and torchrun's agent torch once more. torch.multiprocessing's `start_processes` watches the ranks as
torchrun does: once one fails, it stops the others (SIGTERM, then SIGKILL) and this process exits with its error.

The spec: a JSON list of [folder, "module:function", *args]; each run is function(folder, *args). It leaves the file
`started` in its folder when it begins and `finished` once every rank has returned from it. A run that raises writes
its traceback to `failed.rank<r>.txt` in its folder and ends the launch (the other ranks are stopped): a rank
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
import torch.multiprocessing

from tests.distributed.launch import COLLECTIVE_TIMEOUT_S, FAILED, FINISHED, STARTED, free_port


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


def run_all(spec: str) -> None:
    main(spec)
    gc.unfreeze()
    gc.collect()  # the process groups freed before the process ends (harness/train.py)


def rank(index: int, nproc: int, port: int, spec: str) -> None:
    """Rank `index` of `nproc` (a forked process): the variables torchrun would set, then the runs."""
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run_all(spec)


def launch(spec: str, nproc: int) -> None:
    """The runs of `spec` in this process, or on `nproc` ranks forked from it once their modules are imported."""
    if nproc == 1:
        run_all(spec)
        return
    for _, target, *_ in json.loads(Path(spec).read_text()):
        importlib.import_module(target.split(":")[0])
    import torch._dynamo  # noqa: F401  (every training run's optimizer imports it: once here, not once per rank)

    torch.multiprocessing.start_processes(rank, args=(nproc, free_port(), spec), nprocs=nproc, start_method="fork")


if __name__ == "__main__":
    launch(sys.argv[2], int(sys.argv[1]))
