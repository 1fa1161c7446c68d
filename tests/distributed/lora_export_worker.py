"""Worker for test_lora_export (a run of the shared launches, tests/distributed/launch.py): the debug model with LoRA
on every target, its B away from zero (the same values in every layout), written by the end-of-run export path
(`Trainer.export_hf`: the merged hf/ and the PEFT hf-adapter/) from whatever layout the overrides give, then
re-quantized into the FP8 release's layout (hf-fp8/ and its adapter, in 64 KiB shards: a weight's scales in another
rank's shard)."""

import os

import torch

from harness.checkpoint.hf_weights import ExportUnit
from tests.distributed.fsdp_step_worker import LORA, random_lora_b
from tests.distributed.trainer_runs import close_keeping_process_group, debug_trainer


def export(folder: str, *overrides: str) -> None:
    trainer = debug_trainer(folder, *LORA, "--checkpoint.export_dtype", "float32", *overrides)
    random_lora_b(trainer.model)
    trainer.export_hf()
    with ExportUnit() as unit:
        trainer.lora.export(trainer.model, trainer.model_args, os.path.join(trainer.cfg.job.dump_folder, "hf-fp8"),
                            torch.bfloat16, None, unit, max_shard_bytes=2**16, quantized="fp8")
    close_keeping_process_group(trainer)
