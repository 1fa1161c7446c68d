"""Worker for test_mtp_train (a run of the shared launches, tests/distributed/launch.py): the trainer's first optimizer
step of the debug model with one MTP layer (flavor debugmodel_mtp, training.mtp_loss_coef 0.1), in float64, on
four 64-token rows of the debug corpus with documents starting inside and across the 16-token chunks of CP=2, and a
target mask over a third of the labels (as chat rows have). Rank 0 saves to <folder>/result.pt the held-out
losses (validation, MTP's included) before the step, the step's losses, grad norm and full gradients. The one-process run also saves the reference MTP loss: each document of each row
run alone, its targets x_{t+2} listed by a loop over its positions, the cross entropy of the lm_head's float64
logits of the MTP output summed outside the model's loss and divided by their count."""

import os

import torch
import torch.nn.functional as F

from tests.distributed.fsdp_step_worker import documents_across_chunk_edges, full_grads
from tests.distributed.trainer_runs import CORPUS, close_keeping_process_group, in_float64, layout_trainer

GLOBAL_BATCH = 4


def with_target_mask(batch: dict) -> dict:
    """Labels at every third position ignored, as the non-target tokens of chat rows are."""
    batch["labels"][:, ::3] = -100
    return batch


def reference_mtp_loss(model, rows: dict) -> tuple[float, int]:
    """The MTP loss of `rows` (one depth): every document alone, target of position t x_{t+2} = labels[t + 1] of
    the document where t + 1 is inside it and that label is not ignored."""
    total, targets = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for i in range(len(rows["input_ids"])):
            positions = rows["position_ids"][i].tolist()
            starts = [t for t, p in enumerate(positions) if p == 0] + [len(positions)]
            for a, b in zip(starts, starts[1:]):
                ids, labels = rows["input_ids"][i, a:b], rows["labels"][i, a:b]
                wanted = [(t, int(labels[t + 1])) for t in range(b - a - 1) if labels[t + 1] != -100]
                if not wanted:
                    continue
                out = model(ids[None], mtp=True)
                logits = model.lm_head(out.mtp_hidden[0][0]).double()
                index = torch.tensor([t for t, _ in wanted])
                total += F.cross_entropy(logits[index], torch.tensor([y for _, y in wanted]), reduction="sum")
                targets += len(wanted)
    return (total / targets).item(), targets


def step(folder: str, *overrides: str) -> None:
    in_float64(_step, folder, overrides)


def _step(folder: str, overrides: tuple[str, ...]) -> None:
    trainer, _ = layout_trainer(folder, overrides, GLOBAL_BATCH, "--model.flavor", "debugmodel_mtp",
                                "--training.mtp_loss_coef", "0.1", "--validation.enable", "true",
                                "--validation.steps", "2", "--validation.dataset_path", CORPUS)
    validation = trainer.validator.validate(trainer.model)
    batch = with_target_mask(documents_across_chunk_edges(next(iter(trainer.dataloader))))
    reference = reference_mtp_loss(trainer.model, batch) if trainer.dims.world_size == 1 else None
    out = trainer.train_step([batch]).read()
    grads = full_grads(trainer.model)
    if trainer.rank == 0:
        torch.save({"out": out, "grads": grads, "reference": reference, "validation": validation},
                   os.path.join(folder, "result.pt"))
    close_keeping_process_group(trainer)
