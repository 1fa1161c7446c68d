"""Sparse MoE block: softmax top-k router, fused routed experts, and a sigmoid-gated shared expert."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .args import Qwen35MoeArgs
from .fp8_hold import dequantized, is_held_fp8
from .hooks import UNSHARDED, ExpertDispatch, ParallelHooks, ParamSharding, WeightReader
from .linear import Linear


class FeedForward(nn.Module):
    """SwiGLU MLP (the shared expert)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = Linear(dim, hidden_dim, bias=False)
        self.up_proj = Linear(dim, hidden_dim, bias=False)
        self.down_proj = Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopKRouter(nn.Module):
    """Softmax over all experts in fp32 (at least), top-k, renormalised to sum to one."""

    def __init__(self, dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.adapter: nn.Module | None = None  # a trained update beside the frozen weight (lora.py)

    def forward(self, x: torch.Tensor, balanced: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, D) -> probs (N, E) fp32, top-k weights (N, k) fp32, top-k expert ids (N, k).

        `balanced` (benchmarks only, `balanced_expert_ids`): the ids are a fixed round-robin instead of the top-k,
        the weights the probabilities at those ids, renormalised as the top-k's are."""
        logits = F.linear(x, self.weight.to(x.dtype))
        if self.adapter is not None:
            logits = logits + self.adapter(x)
        probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(dim=-1)  # float64 stays
        if balanced:
            ids = balanced_expert_ids(x.shape[0], self.top_k, probs.shape[-1], x.device)
            weights = probs.gather(-1, ids)
        else:
            weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, ids


def balanced_expert_ids(num_tokens: int, top_k: int, num_experts: int, device: torch.device) -> torch.Tensor:
    """(N, k) expert ids of perfectly balanced routing (Megatron's --moe-router-force-load-balancing): slot j of
    token n goes to expert (n * k + j) mod E, so every expert gets N * k / E assignments when E divides N * k (and
    a token's k ids differ when k <= E). Built on the device from the shapes alone: no host sync, static shapes."""
    return (torch.arange(num_tokens * top_k, device=device) % num_experts).view(num_tokens, top_k)


def _grouped_path(x: torch.Tensor) -> bool:
    """Whether the MoE runs its CUDA path: bf16 on CUDA, the experts as grouped GEMMs and the token gather and
    combine in the Triton kernels of kernels/moe_combine_triton.py. Elsewhere the torch path, which float64 tests check."""
    return x.is_cuda and x.dtype == torch.bfloat16


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, inverse, group, limit):
        ctx.save_for_backward(inverse, limit)
        ctx.group = group
        if limit is not None and _grouped_path(x):
            from .kernels.moe_combine_triton import gather_rows_below
            return gather_rows_below(x, index, limit)
        rows = x.index_select(0, index)
        if limit is not None:
            rows = torch.where(_below(limit, rows.shape[0]), rows, 0)
        return rows

    @staticmethod
    def backward(ctx, grad):
        inverse, limit = ctx.saved_tensors
        if ctx.group > 1 and _grouped_path(grad):
            from .kernels.moe_combine_triton import row_group_sum
            return row_group_sum(grad.contiguous(), inverse, ctx.group, limit), None, None, None, None
        if limit is not None:  # masked, not multiplied: the rows past the limit may hold NaN
            grad = torch.where(_below(limit, grad.shape[0]), grad, 0)
        grad = grad.index_select(0, inverse)
        if ctx.group > 1:
            grad = grad.view(-1, ctx.group, grad.shape[-1]).sum(1)
        return grad, None, None, None, None


def _below(limit: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows, 1) mask of the rows below the device scalar `limit`."""
    return (torch.arange(rows, device=limit.device) < limit)[:, None]


def gather_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, group: int = 1,
                limit: torch.Tensor | None = None) -> torch.Tensor:
    """x[index] for 2-D x whose backward is a gather too, not index_select's scatter-add (bf16 atomics on CUDA:
    slow, rounded at every add, in no fixed order).

    index[i] = perm[i] // group for a permutation perm of range(len(x) * group) whose inverse is `inverse`: every
    row of x is taken `group` times (group 1: index is a permutation). The gradient of row n is then the sum of
    the output gradient's rows inverse[n * group : (n + 1) * group], one reduction with one rounding.

    `limit` (device scalar): only the output rows below it are taken (the rest are zeros on the torch path and
    unwritten on the CUDA one) and only their gradients flow back."""
    return _GatherRows.apply(x, index, inverse, group, limit)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


@dataclass
class RouterStats:
    """What the balance loss needs from one forward, per MoE layer."""

    counts: torch.Tensor  # (layers, E) fp32, top-k assignments per expert (no gradient)
    prob_sums: torch.Tensor  # (layers, E) fp32, router probabilities summed over tokens (differentiable)
    num_tokens: int  # tokens routed by each layer
    top_k: int


def load_balancing_loss(stats: RouterStats, pooled_counts: torch.Tensor | None = None,
                        pooled_tokens: float | torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer balance loss E * sum_e f_e * P_e of each layer, averaged over layers.

    f_e = top-k assignments to expert e per token, P_e = mean router probability of e; a uniform router
    gives top_k. Per layer, so imbalances of different layers cannot cancel out. With `pooled_counts` /
    `pooled_tokens` (the counts and token total summed over data-parallel ranks), the result is this
    rank's share: f from the pooled batch, P from this rank's tokens over the pooled total, so the
    shares of all ranks sum to the loss of the pooled batch, whatever its split.
    """
    counts = stats.counts if pooled_counts is None else pooled_counts
    tokens = stats.num_tokens if pooled_tokens is None else pooled_tokens
    num_experts = counts.shape[-1]
    per_layer = num_experts * ((counts / tokens) * (stats.prob_sums / tokens)).sum(-1)
    return per_layer.mean()


def _grouped_mm(x: torch.Tensor, weight_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, weight_t, offs=offsets)


class RoutedExperts(nn.Module):
    """All routed experts' SwiGLU weights, fused as in the HF checkpoint layout.

    gate_up_proj (E, 2I, D): rows [0, I) are the gate projection, [I, 2I) the up projection.
    down_proj (E, D, I).
    Under expert parallelism both are sharded on the expert dimension (`sharding`, hooks.py): this rank computes
    with its own E / ep experts (the rows of `counts` are then its local experts).
    `gemms` (None: torch._grouped_mm, and F.linear per expert on the loop path) is where FP8 training puts its
    GEMMs (harness/float8.py): `aligned` lays the token groups out as its grouped GEMM needs them, `grouped` and
    `linear` replace the two.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.sharding: ParamSharding = UNSHARDED  # hooks.py
        self.weight_reader: WeightReader | None = None  # hooks.py
        self.adapter: nn.Module | None = None  # lora.ExpertLowRank: per-expert updates beside the frozen weights
        self.gemms = None  # FP8 training's GEMMs (harness/float8.py: Float8ExpertGemms)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, D) sorted by expert, counts (E,) tokens per expert -> (M, D). Rows past sum(counts) belong to no
        expert here (expert parallelism's all-gather dispatch: the other ranks' assignments): their outputs are
        unspecified (zeros on the loop path, whatever the grouped GEMM leaves there on GPU)."""
        if _grouped_path(x):
            return self._grouped_mm(x, counts)
        return self._loop(x, counts)

    def _weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's experts' weights (the local shard under expert parallelism) in the compute dtype (dequantized
        where they are held in FP8: fp8_hold.py)."""
        return tuple(self._weight(name, dtype) for name in ("gate_up_proj", "down_proj"))

    def _weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if is_held_fp8(self, name):
            return dequantized(self, name, dtype)
        if self.weight_reader is not None:
            return self.weight_reader.read(self, name, dtype)
        return self.sharding.local(getattr(self, name)).to(dtype)

    def _grouped_mm(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # One grouped GEMM per projection, no host sync: offsets are the end row of each expert.
        gate_up_proj, down_proj = self._weights(x.dtype)
        offsets = counts.cumsum(0).to(torch.int32)
        grouped, restore = _grouped_mm, None
        if self.gemms is not None:  # FP8: its GEMMs, on token groups laid out as they need them (never with adapters)
            (x, offsets, restore), grouped = self.gemms.aligned(x, offsets), self.gemms.grouped
        gate_up = grouped(x, gate_up_proj.transpose(-2, -1), offsets)
        if self.adapter is not None:
            gate_up = gate_up + self.adapter.grouped(x, "gate_up", offsets, self.sharding)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        out = grouped(hidden, down_proj.transpose(-2, -1), offsets)
        if self.adapter is not None:
            out = out + self.adapter.grouped(hidden, "down", offsets, self.sharding)
        return out if restore is None else restore(out)

    @torch.compiler.disable  # eager under compile: split sizes read on the host would recompile at every routing
    def _loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Reference path (CPU, fp32): one matmul pair per expert, also for one without tokens, so that x and every
        # weight stay in the graph; under expert parallelism a rank may receive no tokens at all and must still
        # run the exchange's backward (a collective) with the others.
        gate_up_proj, down_proj = self._weights(x.dtype)
        linear = F.linear if self.gemms is None else self.gemms.linear
        sizes = counts.tolist()
        routed_rows = sum(sizes)
        outputs = []
        for e, rows in enumerate(x[:routed_rows].split(sizes)):
            gate_up = linear(rows, gate_up_proj[e])
            if self.adapter is not None:
                gate_up = gate_up + self.adapter.one(rows, "gate_up", e, self.sharding)
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
            out = linear(hidden, down_proj[e])
            outputs.append(out if self.adapter is None else out + self.adapter.one(hidden, "down", e, self.sharding))
        outputs.append(x.new_zeros(x.shape[0] - routed_rows, down_proj.shape[1]))  # rows past the last expert's
        return torch.cat(outputs)


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(num_experts,) assignments per expert of the ids (any shape). Not torch.bincount, whose output size depends
    on the data (a host sync on a GPU)."""
    flat = ids.reshape(-1)
    return flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))


def combine_expert_outputs(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor,
                           run_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                           out_dtype: torch.dtype | None = None, routed_rows: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """x (N, D), top-k weights and expert ids (N, k), counts = expert_counts(ids, E) -> (N, D): each token's k
    expert outputs, weighted and summed.

    The N * k (token, slot) assignments are sorted by expert so each expert sees a contiguous block;
    `run_experts(x_sorted, counts)` maps those rows to the experts' outputs; back in (token, slot) order the k
    outputs of a token are weighted and summed in one reduction (in `out_dtype`, by default x's). In bf16 on CUDA
    one Triton kernel (kernels/moe_combine_triton.py) reads the k outputs where they lie and sums with fp32 weights.

    `routed_rows` (device scalar): only the first routed_rows sorted assignments go to experts (those of `counts`,
    which then covers fewer experts than ids names); the rest add nothing. Their rows are neither gathered nor
    read back, and what the experts leave in them (unspecified) reaches no output or gradient."""
    num_tokens, top_k = ids.shape
    order = ids.reshape(-1).argsort(stable=True)
    slot_at = inverse_permutation(order)  # where each assignment landed
    x_sorted = gather_rows(x, order // top_k, slot_at, top_k, routed_rows)  # (N * k, D)
    routed = run_experts(x_sorted, counts)
    if _grouped_path(routed):
        from .kernels.moe_combine_triton import weighted_row_sum
        return weighted_row_sum(routed.contiguous(), slot_at, weights, out_dtype or x.dtype, routed_rows)
    per_slot = gather_rows(routed, slot_at, order)
    if routed_rows is not None:  # masked, not multiplied: the rows past the limit are unspecified
        per_slot = torch.where((slot_at < routed_rows)[:, None], per_slot, 0)
    per_slot = per_slot.view(num_tokens, top_k, -1)  # (N, k, D)
    return (per_slot * weights.unsqueeze(-1).to(per_slot.dtype)).sum(1, dtype=out_dtype)


class SparseMoE(nn.Module):
    def __init__(self, args: Qwen35MoeArgs):
        super().__init__()
        self.num_experts = args.num_experts
        self.top_k = args.num_experts_per_tok
        self.gate = TopKRouter(args.hidden_size, args.num_experts, args.num_experts_per_tok)
        self.experts = RoutedExperts(args.num_experts, args.hidden_size, args.moe_intermediate_size)
        self.shared_expert = FeedForward(args.hidden_size, args.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(args.hidden_size, 1, bias=False)
        # How the routed tokens reach the experts (hooks.py): None, the local experts; under expert parallelism
        # `experts` holds this rank's share of them and the dispatch brings the other ranks' tokens to them.
        self.dispatch: ExpertDispatch | None = None
        # Benchmarks only (force_balanced_routing): route by `balanced_expert_ids`, not the router's top-k. A plain
        # attribute, neither a parameter nor a buffer: no checkpoint key, nothing in the HF config.
        self.force_balance = False

    def force_balanced_routing(self, enabled: bool = True) -> None:
        """Balanced routing on or off for this layer: each of this call's N tokens (this rank's, flattened) is sent
        to experts (n * k + j) mod E, j < k, weighted by the router's renormalised probabilities at those experts
        (so the router still gets gradients); counts and probability sums come from those ids as usual. For
        throughput at perfectly even expert load, beside the data-driven routing: the model does not learn to route."""
        self.force_balance = bool(enabled)

    def set_parallel_hooks(self, hooks: ParallelHooks) -> None:
        """This layer's extension points (hooks.py): its dispatch and its experts' sharding."""
        self.dispatch = None if hooks.expert_dispatch is None else hooks.expert_dispatch(self)
        self.experts.sharding = hooks.sharding

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, S, D) -> output (B, S, D), expert counts (E,) and router probability sums (E,), both fp32."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, D)
        probs, weights, ids = self.gate(x, balanced=True) if self.force_balance else self.gate(x)
        counts = expert_counts(ids, self.num_experts)
        if self.dispatch is None:
            out = combine_expert_outputs(x, weights, ids, counts, self.experts)
        else:
            out = self.dispatch.routed(x, weights, ids, counts, self.experts)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return (out + shared).reshape(shape), counts.detach().float(), probs.sum(dim=0)


def force_balanced_routing(model: nn.Module, enabled: bool = True) -> int:
    """`SparseMoE.force_balanced_routing(enabled)` on every MoE layer of `model` (the MTP's too); returns how many.
    A runtime switch (config `debug.moe_force_load_balance`): checkpoint keys and the HF export do not change."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for moe in layers:
        moe.force_balanced_routing(enabled)
    return len(layers)
