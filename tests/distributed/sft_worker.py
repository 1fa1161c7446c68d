"""Worker for test_sft (a run of the shared launches, tests/distributed/launch.py): the trainer's first optimizer step
of the debug model on the debug chat corpus (train_configs/debug_sft.toml's data: conversations rendered by the chat
template, targets the assistant's tokens, whole conversations packed into rows with padding), in float64.
Rank 0 saves to <folder>/result.pt the step's losses and grad norm, the full gradients, the validation loss, and
the number of target tokens of the global batch. The one-process run also saves the reference for packing: each
conversation of the batch's rows run alone (unpacked, its own row) and its cross entropy summed over its targets
in float64 outside the model's loss."""

import os

import torch
import torch.nn.functional as F

from tests.distributed.fsdp_step_worker import full_grads
from tests.distributed.trainer_runs import REPO, close_keeping_process_group, in_float64, layout_trainer

GLOBAL_BATCH = 4
CHAT = os.path.join(REPO, "data", "debug_chat")
CHAT_FLAGS = ("--training.dataset_content", "chat", "--model.tokenizer_path", os.path.join(CHAT, "tokenizer"),
              "--training.dataset_path", os.path.join(CHAT, "train.jsonl"),
              "--validation.enable", "true", "--validation.steps", "2",
              "--validation.dataset_path", os.path.join(CHAT, "val.jsonl"))


def conversations(row: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) of each document of a packed row, cut where its position ids restart at 0."""
    starts = (row["position_ids"] == 0).nonzero().flatten().tolist() + [len(row["position_ids"])]
    return [(row["input_ids"][a:b], row["labels"][a:b]) for a, b in zip(starts, starts[1:])]


def unpacked_loss(model, rows: dict) -> tuple[float, int]:
    """The token-mean cross entropy over the targets of `rows`, each conversation run alone: float64 logits of the
    model, float64 cross entropy summed over the conversations' targets, divided by their count."""
    total, targets = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for i in range(len(rows["input_ids"])):
            for ids, labels in conversations({k: v[i] for k, v in rows.items()}):
                if (labels != -100).sum() == 0:  # padding, or a conversation with no target in this row
                    continue
                logits = model(ids[None]).logits[0].double()
                total += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
                targets += int((labels != -100).sum())
    return (total / targets).item(), targets


def step(folder: str, *overrides: str) -> None:
    in_float64(_step, folder, overrides)


def _step(folder: str, overrides: tuple[str, ...]) -> None:
    trainer, cp = layout_trainer(folder, overrides, GLOBAL_BATCH, *CHAT_FLAGS, "--training.seq_len", "128")
    world = trainer.dims.world_size
    validation = trainer.validator.validate(trainer.model)
    batch = next(iter(trainer.dataloader))
    reference = unpacked_loss(trainer.model, batch) if world == 1 else None
    targets = torch.tensor(int((batch["labels"] != -100).sum()))
    if world > 1:  # the global batch's targets: each DP rank's rows (CP ranks of one DP rank hold the same rows)
        torch.distributed.all_reduce(targets)
        targets //= cp
    out = trainer.train_step([batch]).read()
    grads = full_grads(trainer.model)
    if trainer.rank == 0:
        torch.save({"out": out, "grads": grads, "validation": validation, "targets": int(targets),
                    "row_tokens": int(batch["input_ids"].numel()) * world // cp, "unpacked": reference},
                   os.path.join(folder, "result.pt"))
    close_keeping_process_group(trainer)
