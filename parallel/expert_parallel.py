"""Expert parallelism's token exchange: each EP rank holds E / ep of a MoE layer's routed experts (rank r: experts
r * E/ep ... (r + 1) * E/ep - 1) and every rank routes its own tokens; the tokens travel to their experts' ranks
and back with two all-to-alls.

    routed = ExpertParallel(ep_mesh).exchange(x_sorted, counts, local_experts)
    # x_sorted (M, D) sorted by global expert, counts (E,): one ExpertParallel per MoE layer

1. an all-to-all of the per-expert token counts (E integers per rank), so each rank learns how many tokens
   every rank sends to each of its local experts;
2. one device-to-host copy of the split sizes (the all-to-all of the tokens needs them on the host): the only
   host sync, which an activation-checkpointing recompute of the layer skips (it reuses the forward's);
3. an all-to-all of the tokens, which arrive grouped by source rank, then by local expert; a permutation
   groups them by local expert for the grouped GEMM; the local experts run; the inverse permutation and the
   mirror all-to-all bring each token's output back to the rank and place it came from.
The token all-to-alls are differentiable (parallel/collectives.py; backward: the mirror all-to-all), so
gradients reach the router, the tokens and the local experts' weights (from every rank's tokens).

`ExpertParallel` is what the parallelize function attaches to each SparseMoE (`_ep`); the experts' weights are
then DTensors sharded on the expert dimension over the EP mesh (`shard_experts`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from models.qwen35_moe.moe import RoutedExperts, gather_rows, inverse_permutation

from .collectives import all_to_all


def local_expert_order(received_counts: torch.Tensor, total: int) -> torch.Tensor:
    """received_counts (ep, E_local): tokens from each source rank for each local expert, in the order they
    arrive (source-major). Returns the index that reorders the `total` arrived tokens expert-major."""
    ep, local = received_counts.shape
    flat = received_counts.reshape(-1)
    arrival_start = torch.cumsum(flat, 0) - flat  # where each (source, expert) block starts on arrival
    by_expert = received_counts.t().reshape(-1)  # block sizes in the wanted (expert, source) order
    starts = arrival_start.view(ep, local).t().reshape(-1)
    wanted_start = torch.cumsum(by_expert, 0) - by_expert
    offsets = torch.repeat_interleave(starts - wanted_start, by_expert, output_size=total)
    return offsets + torch.arange(total, device=received_counts.device)


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """counts (E,) this rank's tokens per global expert -> (ep, E_local) the tokens each rank sends to each of
    this rank's experts (an all-to-all of the counts)."""
    ep = dist.get_world_size(group)
    return funcol.all_to_all_single(counts.contiguous(), None, None, group).view(ep, counts.numel() // ep)


def split_sizes(counts: torch.Tensor, received: torch.Tensor) -> tuple[list[int], list[int]]:
    """The token all-to-alls' sizes on the host, rows sent to and received from each rank: the one host sync."""
    ep, local = received.shape
    send, recv = torch.stack((counts.view(ep, local).sum(1), received.sum(1))).tolist()
    return send, recv


def exchange(x: torch.Tensor, received: torch.Tensor, send: list[int], recv: list[int],
             local_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
             group: dist.ProcessGroup) -> torch.Tensor:
    """x (M, D) this rank's token copies sorted by global expert id -> (M, D) the experts' outputs for them, in
    x's order. `local_experts(tokens, local_counts)` runs this rank's experts on tokens sorted by local expert."""
    tokens = all_to_all(x, recv, send, group)
    order = local_expert_order(received, sum(recv))
    back = inverse_permutation(order)
    out = local_experts(gather_rows(tokens, order, back), received.sum(0))
    return all_to_all(gather_rows(out, back, order), send, recv, group)


class ExpertParallel:
    """One MoE layer's exchange over the EP group, as the layer calls it: `exchange(x_sorted, counts,
    local_experts)`.

    Under activation checkpointing the layer's forward runs again inside the backward on the same inputs, so
    with the same routing: that recompute reuses the forward's host split sizes instead of syncing with the host
    again (full AC would double the syncs). It still exchanges the counts (selective AC replays its saved
    collectives in order) and checks on the device, without a sync, that they are the forward's: a routing that
    changed would otherwise move tokens by stale sizes."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self.group = mesh.get_group()
        self._forward = None  # (received, send, recv) of the last forward outside a backward pass

    # Eager under torch.compile: the split sizes it reads on the host would recompile the block at every routing.
    @torch.compiler.disable
    def exchange(self, x: torch.Tensor, counts: torch.Tensor,
                 local_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        received = exchange_counts(counts, self.group)
        recomputing = torch._C._current_graph_task_id() != -1 and self._forward is not None  # inside a backward
        if not recomputing:
            self._forward = (received, *split_sizes(counts, received))
        forward_received, send, recv = self._forward
        # Checked in the forward too (trivially): selective AC wants the recompute to run the forward's ops.
        torch._assert_async((received == forward_received).all(),
                            "expert parallelism: the recomputed routing differs from the forward's")
        return exchange(x, received, send, recv, local_experts, self.group)


def scale_expert_gradients(model: nn.Module, ep: int) -> None:
    """Divide the routed experts' gradients by ep, after the backward. Each already sums the tokens of its whole
    EP group (through the exchange's backward) and FSDP averages it over the expert-FSDP ranks (world / ep):
    with this 1/ep it is the average over all ranks, as FSDP makes every other gradient. (Not FSDP's
    `set_gradient_divide_factor`: torch 2.13 divides twice on a one-rank expert-FSDP mesh in fp64 and fp16.)"""
    grads = [p.grad for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters()
             if p.grad is not None]
    if grads:
        torch._foreach_div_(grads, float(ep))


def shard_experts(experts: nn.Module, mesh: DeviceMesh) -> None:
    """Replace each (E, ...) weight of `experts` by a DTensor sharded on dim 0 over the EP mesh: rank r keeps
    experts r * E/ep ... (r + 1) * E/ep - 1. No communication (slices the local tensor, on meta too)."""
    for name, param in list(experts.named_parameters(recurse=False)):
        if param.shape[0] % mesh.size():
            raise ValueError(f"{param.shape[0]} experts cannot be split evenly over {mesh.size()} EP ranks")
        sharded = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None)
        setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
