"""Worker for test_reshard_auto: the trainer runs 3 steps with `parallelism.fsdp_reshard_after_forward` as given,
with the GPU's memory replaced by a host analog, so that "auto" takes its GPU path on CPU: after step 1 it gathers
each resharding unit once (the blocks' units, the first block's experts, EP's expert units on their own mesh),
measures them, and keeps their weights or not. The analog: allocated = the bytes of the parameters gathered now
(the modules' parameters other than those they held when built: a unit's gathered ones while it is unsharded;
under EP these are DTensors over the EP mesh, counted by their local part), peak 0, capacity `capacity` bytes.
Rank 0 writes the per-step losses, the measured bytes and the units left resharding."""

import gc
import json
import os
import sys
from types import SimpleNamespace

import torch
from torch.distributed.tensor import DTensor

import parallel.reshard_policy as policy
from parallel.parallelize import resharding_units
from harness.config import load_config
from harness.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(out: str, mode: str, capacity: str, *overrides: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config([
        "--config", os.path.join(REPO, "train_configs", "debug_model.toml"),
        "--training.dataset_path", os.path.join(REPO, "data", "debug_corpus", "train.jsonl"),
        "--training.seq_len", "64", "--training.local_batch_size", str(4 // world), "--training.steps", "3",
        "--training.deterministic", "true", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--parallelism.fsdp_reshard_after_forward", mode, "--job.dump_folder", os.path.join(out, "dump"),
        "--training.dataset_cache_dir", os.path.join(out, "dataset_cache"), *overrides,
    ])
    trainer = Trainer(cfg)
    model = trainer.model
    built = {id(p) for p in model.parameters()}  # the shards, and the parameters FSDP leaves whole

    def gathered_now() -> int:
        return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes
                   for p in model.parameters() if id(p) not in built)
    policy.device_memory = lambda device: SimpleNamespace(allocated=gathered_now, peak=lambda: 0,
                                                          capacity=lambda: int(capacity))
    measured = []
    measure = policy.gathered_bytes
    policy.gathered_bytes = lambda units, memory: measured.append(measure(units, memory)) or measured[-1]
    units = len(resharding_units(model))
    kept = []
    keep = policy.keep_gathered_weights
    policy.keep_gathered_weights = lambda chosen: kept.append(len(chosen)) or keep(chosen)
    trainer.train()
    losses = [json.loads(line)["loss"] for line in open(os.path.join(out, "dump", "metrics.jsonl"))
              if '"loss"' in line]
    if trainer.rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"losses": losses, "measured": measured, "units": units,
                       "left": units - sum(kept)}, f)
    trainer.close()


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    main(*sys.argv[1:])
    gc.collect()  # the process groups freed before the interpreter finalizes (harness/train.py)
