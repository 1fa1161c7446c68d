"""Worker for test_fsdp: one training step of the debug model on a fixed global batch, then rank 0 saves
the loss, grad norm and full gradients. Run with torchrun (2 gloo ranks) or as one plain process."""

import os
import sys

import torch

from harness.config import load_config
from harness.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(out_path: str, init_hf: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cfg = load_config([
        "--config", os.path.join(REPO, "train_configs", "debug_model.toml"),
        "--training.dataset_path", os.path.join(REPO, "data", "debug_corpus", "train.jsonl"),
        "--training.seq_len", "64", "--training.local_batch_size", str(4 // world),
        "--training.aux_loss_coef", "0", "--metrics.enable_tensorboard", "false",
        "--job.dump_folder", os.path.join(os.path.dirname(out_path), f"dump{world}"),
        "--checkpoint.initial_load_hf", init_hf,  # identical weights whatever the sharding
    ])
    trainer = Trainer(cfg)
    # The same 4 rows for every world size: rank r takes its slice of them.
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 258, (4, 64), generator=g)}
    batch["labels"] = torch.randint(0, 258, (4, 64), generator=g)
    batch["labels"][0, :20] = -100  # uneven label counts across ranks
    batch["position_ids"] = torch.cat((torch.arange(30), torch.arange(34))).expand(4, 64)
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    out = trainer.train_step([{k: v[rows] for k, v in batch.items()}])
    grads = {}
    for name, p in trainer.model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = grad.detach().clone()
    if rank == 0:
        torch.save({"out": out, "grads": grads}, out_path)
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
