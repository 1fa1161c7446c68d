"""The training loss: token-mean cross entropy over the global batch plus the MoE balance loss.

Every rank computes its share of the global loss, so the shares sum (over ranks and micro-batches) to the loss
of the whole global batch, and the gradient of the global loss is the sum of the ranks' gradients. FSDP
averages gradients over its ranks instead, so the trainer backpropagates share * FSDP degree. Then the global
batch gives the same loss and gradients however it is split over data-parallel ranks (and micro-batches, for
the cross entropy):
- cross entropy: summed over this micro-batch's label tokens (by the model, chunked: never the whole logits),
  divided by the label tokens of the global batch;
- multi-token prediction (training.mtp_loss_coef > 0): depth k's cross entropy summed over its label tokens,
  divided by the label tokens of depth k in the global batch, averaged over the depths, times the coefficient;
- balance loss: per micro-batch, routing counts pooled over all ranks (one all-reduce of (layers, experts)
  counts), each rank contributing its own tokens' router probabilities (see `load_balancing_loss`); averaged
  over the micro-batches of a step. Trained, the MTP layers' MoE count among the layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.qwen35_moe.moe import RouterStats, load_balancing_loss

from .data.loader import IGNORE_INDEX


def global_label_tokens(microbatches: list[dict[str, torch.Tensor]], device: torch.device,
                        distributed: bool) -> torch.Tensor:
    """Label tokens of the whole global batch (all micro-batches, all ranks), fp32, at least 1: (1,), or with MTP
    labels (`mtp_labels`, (B, S, depth)) (1 + depth,), the MTP depths' after the main loss's. One all-reduce."""
    def count(mb: dict[str, torch.Tensor]) -> torch.Tensor:
        main = (mb["labels"] != IGNORE_INDEX).sum().reshape(1)
        if "mtp_labels" not in mb:
            return main
        return torch.cat((main, (mb["mtp_labels"] != IGNORE_INDEX).flatten(0, -2).sum(0)))

    counts = sum(count(mb) for mb in microbatches).to(device, torch.float32)
    if distributed:
        dist.all_reduce(counts)
    return counts.clamp_min(1)


def balance_loss_share(stats: RouterStats, distributed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the balance loss of the micro-batch pooled over all ranks, and the pooled counts
    (layers, experts)."""
    if not distributed:
        return load_balancing_loss(stats), stats.counts
    counts = stats.counts.clone()
    dist.all_reduce(counts)
    # Every rank routes the same number of tokens per micro-batch (fixed local batch and sequence length).
    share = load_balancing_loss(stats, pooled_counts=counts, pooled_tokens=stats.num_tokens * dist.get_world_size())
    return share, counts


def routing_loads(counts: torch.Tensor, ep: int) -> torch.Tensor:
    """counts (layers, experts): top-k assignments per expert, pooled over a step's ranks and micro-batches ->
    (2,): the busiest expert's tokens and the busiest EP rank's tokens (ep ranks holding consecutive equal shares of
    the experts), each over an even split's, the largest over the layers. 1 is perfectly balanced; under expert
    parallelism the busiest rank sets the pace of every MoE layer (a single rank: 1)."""
    layers, experts = counts.shape
    even = counts.sum(-1, keepdim=True).clamp_min(1) / experts
    per_rank = counts.view(layers, ep, experts // ep).sum(-1)
    return torch.stack(((counts / even).amax(), (per_rank / (even * (experts // ep))).amax()))
