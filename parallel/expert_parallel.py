"""Expert parallelism: each EP rank holds E / ep of a MoE layer's routed experts (rank r: experts r * E/ep ...
(r + 1) * E/ep - 1) and every rank routes its own tokens. Two ways to bring the tokens to their experts, both with
`routed(x, weights, ids, counts, local_experts) -> (N, D)`, each token's weighted sum over its k experts (counts:
this rank's assignments per global expert, which the all-to-all sends by; the all-gather counts the gathered ones):

`AllGatherExpertParallel` (`expert_parallel_dispatch = "all_gather"`): every rank gathers the whole EP group's
tokens and routing, runs its own experts on the assignments that chose them, and a reduce-scatter sums each token's
partial outputs on the token's rank. No host sync and no data-dependent shape (compile traces the whole layer),
but it moves (ep - 1) * N * D rows each way where the all-to-all moves about N * k * D * (ep - 1) / ep: the
smaller of the two while ep < k, and its buffers hold ep * N * k rows (the worst case of every assignment of the
group choosing this rank), so it suits small EP groups.

`ExpertParallel` (`"all_to_all"`): the tokens travel to their experts' ranks and back with two all-to-alls.
    1. an all-to-all of the per-expert token counts (E integers per rank), so each rank learns how many tokens
       every rank sends to each of its local experts;
    2. one device-to-host copy of the split sizes (the all-to-all of the tokens needs them on the host): the only
       host sync, which an activation-checkpointing recompute of the layer skips (it reuses the forward's);
    3. an all-to-all of the tokens, which arrive grouped by source rank, then by local expert; a permutation
       groups them by local expert for the grouped GEMM; the local experts run; the inverse permutation and the
       mirror all-to-all bring each token's output back to the rank and place it came from.

The collectives are differentiable (parallel/collectives.py), so gradients reach the router, the tokens and the
local experts' weights (from every rank's tokens). The parallelize function gives each SparseMoE one of these as
its `dispatch` (models/qwen35_moe/hooks.py); the experts' weights are then DTensors sharded on the expert
dimension over the EP mesh (`shard_experts`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from models.qwen35_moe.moe import RoutedExperts, combine_expert_outputs, expert_counts, gather_rows, inverse_permutation

from .collectives import all_gather, all_to_all, reduce_scatter_sum
from .torch_internals import inside_backward


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
        recomputing = inside_backward() and self._forward is not None
        if not recomputing:
            self._forward = (received, *split_sizes(counts, received))
        forward_received, send, recv = self._forward
        # Checked in the forward too (trivially): selective AC wants the recompute to run the forward's ops.
        torch._assert_async((received == forward_received).all(),
                            "expert parallelism: the recomputed routing differs from the forward's")
        return exchange(x, received, send, recv, local_experts, self.group)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor,
               local_experts: RoutedExperts) -> torch.Tensor:
        run = lambda x_sorted, sorted_counts: self.exchange(x_sorted, sorted_counts, local_experts)  # noqa: E731
        return combine_expert_outputs(x, weights, ids, counts, run)


def local_partial_outputs(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, local_experts: RoutedExperts,
                          first: int, local: int) -> torch.Tensor:
    """x (N, D), top-k weights and expert ids (N, k) -> (N, D) in fp32 (at least): each token's weighted sum over
    those of its experts that are here, `local_experts` = experts first ... first + local - 1 (zero if none is).

    Static shapes: the expert buffers have room for all N * k assignments, this rank's sorted first and the other
    ranks' after them as one extra group that is never run. Only this rank's rows, a count on the device, are
    gathered, computed and read back (combine_expert_outputs' `routed_rows`): the buffers' other rows are left
    unwritten, so the other ranks' assignments cost no memory traffic."""
    mine = (ids >= first) & (ids < first + local)
    local_ids = torch.where(mine, ids - first, local)
    counts = expert_counts(local_ids, local + 1)[:local]
    return combine_expert_outputs(x, weights, local_ids, counts, local_experts,
                                  out_dtype=torch.promote_types(x.dtype, torch.float32), routed_rows=counts.sum())


class AllGatherExpertParallel:
    """One MoE layer's all-gather dispatch over the EP group (see the module docstring). Every rank must route the
    same number of tokens (the trainer's batches are all local_batch_size x seq_len / cp)."""

    def __init__(self, mesh: DeviceMesh):
        self.group = mesh.get_group()
        self.rank, self.size = mesh.get_local_rank(), mesh.size()

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor,
               local_experts: RoutedExperts) -> torch.Tensor:
        top_k = ids.shape[1]
        tokens = all_gather(x, self.group)  # (ep * N, D)
        # The routing in one collective: expert ids are exact in the weights' float dtype (< 2^24 experts).
        routing = all_gather(torch.cat((weights, ids.to(weights.dtype)), dim=1), self.group)  # (ep * N, 2k)
        local = _num_experts(local_experts) // self.size
        partial = local_partial_outputs(tokens, routing[:, :top_k], routing[:, top_k:].detach().long(),
                                        local_experts, self.rank * local, local)
        # The ranks' fp32 parts are summed before the one rounding to x's dtype.
        return reduce_scatter_sum(partial, self.group).to(x.dtype)


def resolve_dispatch(dispatch: str, ep: int, top_k: int) -> str:
    """The dispatch "auto" stands for: the all-gather while it moves at most half the all-to-all's bytes (ep / top_k)
    and holds a few times its buffers; past that the all-to-all, whose bytes and buffers do not grow with ep."""
    if dispatch != "auto":
        return dispatch
    return "all_gather" if 2 * ep <= top_k else "all_to_all"


def _num_experts(experts: RoutedExperts) -> int:
    """All experts of the layer (the global size of the weights, a DTensor sharded over the EP mesh)."""
    return experts.gate_up_proj.shape[0]


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
    """Replace each (E, ...) weight of `experts` (and of its LoRA adapter, models/qwen35_moe/lora.py) by a DTensor
    sharded on dim 0 over the EP mesh: rank r keeps experts r * E/ep ... (r + 1) * E/ep - 1. No communication
    (slices the local tensor, on meta too)."""
    for module in experts.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.shape[0] % mesh.size():
                raise ValueError(f"{param.shape[0]} experts cannot be split evenly over {mesh.size()} EP ranks")
            sharded = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None)
            setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
