"""Worker for test_hf_load: build the debug model through the trainer with checkpoint.initial_load_hf (rank 0
reads, every rank keeps its shard) and save the full weights from rank 0, and how far apart the ranks' copies of
the parameters FSDP leaves whole are. Extra arguments are config overrides."""

import gc
import os
import sys

import torch

from harness.config import load_config
from harness.trainer import Trainer
from tests.distributed.fsdp_step_worker import full, replica_spread

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(out_path: str, hf_folder: str, *overrides: str) -> None:
    cfg = load_config([
        "--config", os.path.join(REPO, "train_configs", "debug_model.toml"),
        "--training.dataset_path", os.path.join(REPO, "data", "debug_corpus", "train.jsonl"),
        "--training.seq_len", "64", "--metrics.enable_tensorboard", "false",
        "--job.dump_folder", os.path.join(os.path.dirname(out_path), "dump"),
        "--checkpoint.initial_load_hf", hf_folder, *overrides,
    ])
    trainer = Trainer(cfg)
    weights = {name: full(p) for name, p in trainer.model.state_dict().items()}
    spread = replica_spread(trainer.model)
    if trainer.rank == 0:
        torch.save({"weights": weights, "replica_spread": spread}, out_path)
    trainer.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
    gc.collect()  # the process groups freed before the interpreter finalizes (harness/train.py)
