"""A micro-batch of host rows -> the model's keyword arguments, for the training step and validation alike.

The rows come from the data loader on the host (input_ids, labels, position_ids; harness/data/loader.py). This rank
gets its share of them on the device: all of them, or under context parallelism its zigzag chunks of every row
(docs/design.md, "Context parallelism"). Their document layout (where each packed document starts) is derived on
the host, under CP from the whole rows every CP rank holds, so that neither costs a GPU sync. With a trained MTP
layer, the layer's shifted inputs and targets are built from the whole rows too, so that under CP the shifts cross
chunks and ranks with no exchange (models/qwen35_moe/mtp.py, `mtp_rows`).
"""

from __future__ import annotations

import torch
from torch import nn

from models.qwen35_moe.documents import document_layout, to_device
from models.qwen35_moe.mtp import mtp_rows


class ModelInputs:
    """`inputs(batch, mtp=False)`: the model's keyword arguments for a micro-batch of host rows."""

    def __init__(self, model: nn.Module, device: torch.device, loss_chunk_tokens: int):
        self.model, self.device, self.loss_chunk_tokens = model, device, loss_chunk_tokens

    def __call__(self, batch: dict[str, torch.Tensor], mtp: bool = False) -> dict:
        positions = batch["position_ids"]
        if mtp:
            depth = self.model.args.mtp_num_hidden_layers
            batch = {**batch, **mtp_rows(batch["input_ids"], batch["labels"], positions, depth)}
        # Always the packed layout, also for rows that hold one document each: one path through the kernels and the
        # compiled graphs whatever the data (documents.document_layout).
        cp = self.model.context_parallel
        if cp is None:
            layout = document_layout(positions, *positions.shape, positions.device, packed=True)
        else:
            layout = cp.rows_layout(positions, packed=True, segments=True)
            batch = cp.shard_rows(batch)
        extra = {}
        if mtp:
            extra = {"mtp": True, "mtp_input_ids": to_device(batch["mtp_input_ids"], self.device),
                     "mtp_labels": to_device(batch["mtp_labels"], self.device)}
        return {"input_ids": to_device(batch["input_ids"], self.device), "labels": to_device(batch["labels"], self.device),
                "layout": layout.to(self.device), "loss_chunk_tokens": self.loss_chunk_tokens, **extra}
