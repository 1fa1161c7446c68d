"""Worker for test_fsdp (a run of the shared launches, tests/distributed/launch.py): a validation pass, then the
trainer's first optimizer step of the debug model on the real data pipeline, with the MoE balance loss on, then logits
without labels. Rank 0 saves to <folder>/result.pt the initial weights, the validation loss, the step's losses and grad
norm, the full gradients, (without CP) its first row's logits, and how far apart the ranks' copies of the parameters
FSDP leaves whole are.
In one process or on every rank of the launch; its arguments are config overrides, after an optional
`--skewed-routing` (see `skewed_router`) or `--one-row-microbatches` (the step accumulates over one-row
micro-batches)."""

import contextlib
import os
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from models.qwen35_moe.hooks import canonical_name
from models.qwen35_moe.moe import TopKRouter
from tests.distributed.trainer_runs import CORPUS, close_keeping_process_group, layout_trainer

GLOBAL_BATCH = 4
# LoRA on every target the model has, the router's among them (the run's "--lora" flag)
LORA = ("--lora.enable", "true", "--lora.rank", "8",
        "--lora.targets", "q_proj,k_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,in_proj_a,in_proj_b,out_proj,"
        "shared_expert,shared_expert_gate,router,experts")


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def full_grads(model) -> dict[str, torch.Tensor]:
    """{canonical name: the whole gradient} of every parameter, gathered from its shards."""
    return {canonical_name(name): full(p.grad) for name, p in model.named_parameters() if p.grad is not None}


@torch.no_grad()
def random_lora_b(model) -> None:
    """Every LoRA B away from its zero init (the same values in every layout, drawn whole from the parameter's
    name): with B zero the adapters change nothing and A's gradients are zero."""
    for name, p in model.named_parameters():
        if canonical_name(name).endswith(("lora_B", "gate_up_B", "down_B")):
            g = torch.Generator().manual_seed(sum(map(ord, canonical_name(name))))
            whole = torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05
            model.sharding.local(p).copy_(model.sharding.local_part(p, whole))


def documents_across_chunk_edges(batch: dict) -> dict:
    """The loader's rows with documents starting at 10, 30 and 47: inside the 16-token chunks of CP=2 and
    across their edges; labels masked before each start, as the packer masks them."""
    starts = (10, 30, 47)
    positions = torch.arange(64)
    for s in starts:
        positions[s:] -= positions[s].clone()
    batch["position_ids"] = positions.expand_as(batch["input_ids"]).clone()
    for s in starts:
        batch["labels"][:, s - 1] = -100
    return batch


def skewed_router(self, x):
    """TopKRouter.forward with unbalanced routing, a function of each token alone (so the same in every
    layout): experts 0 and 1 never receive a token (under EP=4 rank 0 then receives none at all), expert 2
    only tokens whose first feature is positive."""
    logits = F.linear(x, self.weight).float()
    logits[:, :2] = -1e4
    logits[:, 2] = torch.where(x[:, 0] > 0, logits[:, 2], -1e4)
    probs = logits.softmax(dim=-1)
    weights, ids = probs.topk(self.top_k, dim=-1)
    return probs, weights / weights.sum(dim=-1, keepdim=True), ids


def replica_spread(model) -> float | None:
    """The largest difference between ranks in the parameters FSDP leaves whole on every rank (the GDN layers'
    fp32 ones, the final norm's weight) and in their gradients, if any; None without FSDP."""
    params = list(model.parameters())
    if not any(isinstance(p, DTensor) for p in params):
        return None
    whole = [p for p in params if not isinstance(p, DTensor)]  # (the rest are FSDP's, EP's or the vocabulary's shards)
    mine = torch.cat([t.detach().reshape(-1) for p in whole for t in (p, p.grad) if t is not None])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return max((other - every[0]).abs().max().item() for other in every)


def step(folder: str, *overrides: str) -> None:
    skewed = bool(overrides) and overrides[0] == "--skewed-routing"
    overrides = overrides[1:] if skewed else overrides
    one_row_microbatches = bool(overrides) and overrides[0] == "--one-row-microbatches"
    overrides = overrides[1:] if one_row_microbatches else overrides
    lora = bool(overrides) and overrides[0] == "--lora"
    overrides = (*LORA, *overrides[1:]) if lora else overrides
    # float64: the layouts differ only in summation order, which float64 keeps near 1e-16, so any difference
    # beyond that is a bug. (In fp32 the GDN decay parameters' gradients, sums of nearly cancelling terms,
    # vary by up to 1e-3 relative between any two summation orders.)
    torch.set_default_dtype(torch.float64)
    try:
        with mock.patch.object(TopKRouter, "forward", skewed_router) if skewed else contextlib.nullcontext():
            _step(folder, one_row_microbatches, overrides)
    finally:
        torch.set_default_dtype(torch.float32)


def _step(folder: str, one_row_microbatches: bool, overrides: tuple[str, ...]) -> None:
    trainer, cp = layout_trainer(
        folder, overrides, GLOBAL_BATCH,
        "--training.aux_loss_coef", "0.1",  # on, and large enough to matter in the router gradients
        "--validation.enable", "true", "--validation.steps", "2", "--validation.dataset_path", CORPUS)
    if trainer.cfg.lora.enable:
        random_lora_b(trainer.model)
    initial = {canonical_name(name): full(p) for name, p in trainer.model.named_parameters()}
    validation = trainer.validator.validate(trainer.model)
    batch = next(iter(trainer.dataloader))  # DP rank r of W: global rows r, r + W, ... of the same 4 rows
    batch = documents_across_chunk_edges(batch)  # train_step shards the rows over the CP ranks
    rows = len(batch["input_ids"])
    split = [{key: value[i:i + 1] for key, value in batch.items()} for i in range(rows)]
    out = trainer.train_step(split if one_row_microbatches else [batch]).read()
    grads = full_grads(trainer.model)
    spread = replica_spread(trainer.model)
    logits = None
    if cp == 1:  # the forward without labels (evaluation): logits of this rank's first row, with the stepped weights
        with torch.no_grad():
            logits = trainer.model(batch["input_ids"][:1, :16].to(trainer.device)).logits
    if trainer.rank == 0:
        torch.save({"out": out, "initial": initial, "grads": grads, "validation": validation,
                    "vocab_parallel": trainer.model.embed_tokens.vocab_parallel is not None, "logits": logits,
                    "replica_spread": spread},
                   os.path.join(folder, "result.pt"))
    close_keeping_process_group(trainer)
