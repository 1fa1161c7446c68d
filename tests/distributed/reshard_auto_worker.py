"""Worker for test_reshard_auto (a run of the shared launches, tests/distributed/launch.py): the trainer runs 3 steps
with `parallelism.fsdp_reshard_after_forward` as given, with the GPU's memory replaced by a host analog, so that
"auto" takes its GPU path on CPU: after step 1 it gathers each resharding unit once (the blocks' units, the first
block's experts, EP's expert units on their own mesh), measures them, and keeps their weights or not. The analog:
allocated = the bytes of the parameters gathered now (the modules' parameters other than those they held when built:
a unit's gathered ones while it is unsharded; under EP these are DTensors over the EP mesh, counted by their local
part), peak 0, capacity `capacity` bytes. In float64. Rank 0 writes <folder>/result.json: the per-step losses, the
measured bytes and the units left resharding."""

import json
import os
from types import SimpleNamespace
from unittest import mock

import torch
from torch.distributed.tensor import DTensor

import parallel.reshard_policy as policy
from parallel.parallelize import resharding_units
from tests.distributed.trainer_runs import close_keeping_process_group, debug_trainer


def run(folder: str, mode: str, capacity: str, *overrides: str) -> None:
    torch.set_default_dtype(torch.float64)
    try:
        _run(folder, mode, capacity, overrides)
    finally:
        torch.set_default_dtype(torch.float32)


def _run(folder: str, mode: str, capacity: str, overrides: tuple[str, ...]) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = debug_trainer(folder, "--training.local_batch_size", str(4 // world), "--training.steps", "3",
                            "--training.deterministic", "true", "--metrics.log_freq", "1",
                            "--parallelism.fsdp_reshard_after_forward", mode, *overrides)
    model = trainer.model
    built = {id(p) for p in model.parameters()}  # the shards, and the parameters FSDP leaves whole

    def gathered_now() -> int:
        return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes
                   for p in model.parameters() if id(p) not in built)
    def device_memory(device):
        return SimpleNamespace(allocated=gathered_now, peak=lambda: 0, capacity=lambda: int(capacity))

    measured = []
    measure = policy.gathered_bytes

    def gathered_bytes(units, memory):
        measured.append(measure(units, memory))
        return measured[-1]

    units, kept = len(resharding_units(model)), []
    keep = policy.keep_gathered_weights

    def keep_gathered_weights(chosen):
        kept.append(len(chosen))
        keep(chosen)

    with (mock.patch.object(policy, "device_memory", device_memory),
          mock.patch.object(policy, "gathered_bytes", gathered_bytes),
          mock.patch.object(policy, "keep_gathered_weights", keep_gathered_weights)):
        trainer.train()
    losses = [json.loads(line)["loss"] for line in open(os.path.join(folder, "dump", "metrics.jsonl"))
              if '"loss"' in line]
    if trainer.rank == 0:
        with open(os.path.join(folder, "result.json"), "w") as f:
            json.dump({"losses": losses, "measured": measured, "units": units,
                       "left": units - sum(kept)}, f)
    close_keeping_process_group(trainer)
