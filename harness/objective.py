"""The objective: what a training step minimises, and what is logged of it. The trainer calls `Objective.minimise`
once per step; everything about the loss's terms, their global token counts and their weights lives here.

Minimised, over the global batch (every micro-batch of every data-parallel rank):

    loss = CE + mtp_loss_coef * mean_k MTP_k + aux_loss_coef * balance

- CE: the token mean of the cross entropy over the label tokens of the whole global batch;
- MTP_k (training.mtp_loss_coef > 0): depth k's cross entropy, the token mean over depth k's label tokens of the
  global batch (models/qwen35_moe/mtp.py); averaged over the depths;
- balance: per micro-batch, routing counts pooled over all ranks (one all-reduce of (layers, experts) counts), each
  rank contributing its own tokens' router probabilities (`load_balancing_loss`); averaged over the micro-batches of
  a step. Trained, the MTP layers' MoE count among the layers.

Every rank backpropagates its share of that loss, so the shares sum (over ranks and micro-batches) to the loss of
the whole global batch. FSDP averages gradients over its ranks instead of summing them, so each share is multiplied
by the world size. Then the global batch gives the same loss and gradients however it is split over data-parallel
ranks and micro-batches.

The cross entropies' weights (world size / global label tokens; times mtp_loss_coef / depths for the MTP depths)
are known before the forward, from one all-reduce of the label counts. The model takes them with the labels and
returns each summed cross entropy already weighted: its output projection computes the gradients in the same pass
as the loss (models/qwen35_moe/kernels/linear_cross_entropy.py), so a weight applied there spares a pass over the
lm_head's fp32 gradient (2 GiB at 35B-A3B). The model chooses no weight of its own; the values logged are read
back from the weighted sums here.

A step's result is a `StepLosses` (all-reduced once): `loss` (CE), `aux_loss` (balance), `mtp_loss` (mean_k MTP_k),
and the routing counts, of which harness/step_metrics.py logs the loads (`routing_loads`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from models.qwen35_moe.moe import RouterStats, load_balancing_loss

from .data.loader import IGNORE_INDEX


class StepLosses(NamedTuple):
    """A step's losses over the whole global batch (all-reduced) and its routing counts, on the device, unread."""

    loss: torch.Tensor  # CE, the token mean of the cross entropy over the label tokens (0-dim)
    aux_loss: torch.Tensor  # the balance loss (0-dim)
    mtp_loss: torch.Tensor  # the mean over the MTP depths of their token-mean cross entropies (0-dim; 0 without)
    routing_counts: torch.Tensor  # (layers, experts): top-k assignments, pooled over ranks and micro-batches


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


class Objective:
    """The step's loss (module docstring) for a model whose MoE balance loss is weighted by `aux_loss_coef` and
    whose MTP depths' by `mtp_loss_coef`, on `world` ranks (`distributed`: more than one process)."""

    def __init__(self, aux_loss_coef: float, mtp_loss_coef: float, world: int, distributed: bool,
                 device: torch.device):
        self.aux_loss_coef, self.mtp_loss_coef = aux_loss_coef, mtp_loss_coef
        self.world, self.distributed, self.device = world, distributed, device

    def minimise(self, model: torch.nn.Module, microbatches: list[dict]) -> StepLosses:
        """The forward and backward of every micro-batch (the model's keyword arguments, harness/batch.py), its
        gradients accumulated; returns the step's losses and routing counts."""
        n_tokens, *mtp_tokens = global_label_tokens(microbatches, self.device, self.distributed).unbind()
        ce_weight = self.world / n_tokens
        mtp_weights = None
        if mtp_tokens:
            depth_coef = self.mtp_loss_coef / len(mtp_tokens)
            mtp_weights = torch.stack(mtp_tokens).reciprocal() * (self.world * depth_coef)
        ce_total, aux_total, mtp_total = (torch.zeros((), device=self.device) for _ in range(3))
        counts = 0
        for mb in microbatches:
            out = model(**mb, ce_weight=ce_weight, mtp_ce_weights=mtp_weights)
            aux, pooled_counts = balance_loss_share(_with_mtp_layers(out), self.distributed)
            aux = aux / len(microbatches)
            counts = counts + pooled_counts
            loss = out.ce_sum + aux * (self.aux_loss_coef * self.world)
            if out.mtp_ce_sum is not None:
                loss = loss + out.mtp_ce_sum
                mtp_total += out.mtp_ce_sum.detach() / (self.world * self.mtp_loss_coef)
            loss.backward()
            ce_total += out.ce_sum.detach() / self.world  # this micro-batch's share of the global token-mean CE
            aux_total += aux.detach()
        losses = torch.stack((ce_total, aux_total, mtp_total))
        if self.distributed:
            dist.all_reduce(losses)
        return StepLosses(*losses.unbind(), counts)


def _with_mtp_layers(out) -> RouterStats:
    """The routing statistics of the main layers and, when they ran, the MTP layers' MoE after them: one balance
    loss over all."""
    stats, mtp = out.router_stats, out.mtp_router_stats
    if mtp is None:
        return stats
    return RouterStats(torch.cat((stats.counts, mtp.counts)), torch.cat((stats.prob_sums, mtp.prob_sums)),
                       stats.num_tokens, stats.top_k)
