"""Worker for test_fp8_hold_fsdp (a run of the shared launches, tests/distributed/launch.py): a LoRA run of the debug
model from a folder in the FP8 release's layout, under full AC and FSDP over the ranks, its frozen base held in FP8
or dequantized at the load (`hold`: lora.fp8_base). Rank 0 writes the folder (the debug model's weights quantized
block-wise by tests/builders.py); every rank builds the trainer, trains 3 steps and exports. Rank 0 saves to
<folder>/result.pt each held weight's dtype, whole shape and local shard shape, the trainer's log of the holding;
the dump folder keeps metrics.jsonl, hf/ and hf-adapter/."""

import os
from pathlib import Path

import torch
import torch.distributed as dist

from models.qwen35_moe import get_flavor, save_hf_checkpoint
from models.qwen35_moe.fp8_hold import held_fp8_weights
from tests.builders import fp8_release_folder, initialized_model
from tests.distributed.trainer_runs import close_keeping_process_group, debug_trainer


def train(folder: str, hold: str) -> None:
    source, fp8 = Path(folder, "fp32"), Path(folder, "fp8")
    if dist.get_rank() == 0:
        model = initialized_model(get_flavor("debugmodel"), 3)
        save_hf_checkpoint(model.state_dict(), model.args, source, dtype=torch.float32)
        fp8_release_folder(source, fp8)
    dist.barrier()
    trainer = debug_trainer(folder, "--lora.enable", "true", "--activation_checkpoint.mode", "full",
                            "--lora.fp8_base", hold, "--checkpoint.initial_load_hf", str(fp8),
                            "--training.steps", "3", "--metrics.log_freq", "1", "--checkpoint.export_dtype", "float32")
    held = {name: (module, attr) for name, (module, attr) in held_fp8_weights(trainer.model).items()}
    shards = {name: (str(getattr(m, a).dtype), tuple(getattr(m, a).shape), tuple(getattr(m, a).to_local().shape))
              for name, (m, a) in held.items()}
    trainer.train()
    trainer.export_hf()
    if trainer.rank == 0:
        torch.save({"held": shards}, os.path.join(folder, "result.pt"))
    close_keeping_process_group(trainer)
