"""Gated DeltaNet linear attention with its fp32 SSM gate.

Contract (docs/design.md, fp32 contract): `A_log` and `dt_bias` live in an `SSMGate` registered as
`_fp32_params`, are fp32 whatever the model dtype, and the decay g = -exp(A_log) * softplus(a + dt_bias) is
computed in fp32 in `SSMGate.forward`. `layer.A_log` / `layer.dt_bias` stay readable through get-only
properties. The output norm (`norm.weight`) is fp32 the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .args import Qwen35MoeArgs
from .documents import DocumentLayout
from .fp32_contract import HOLDER_NAME, Fp32ParamsModule, at_least_fp32
from .hooks import ContextParallel, ParallelHooks
from .kernels.causal_conv import causal_conv1d_qkv
from .kernels.gated_delta_rule import gated_delta_rule
from .linear import Linear
from .norms import GatedRMSNorm


class SSMGate(Fp32ParamsModule):
    """Per value head decay parameters, kept in fp32 through any `.to(dtype)` of the model."""

    def __init__(self, num_heads: int):
        super().__init__()
        dtype = at_least_fp32(torch.get_default_dtype())
        self.A_log = nn.Parameter(torch.empty(num_heads, dtype=dtype))
        self.dt_bias = nn.Parameter(torch.empty(num_heads, dtype=dtype))

    def forward(self, a: torch.Tensor, heads: slice = slice(None)) -> torch.Tensor:
        """a (B, T, h) -> g (B, T, h), log decay in fp32, for the value heads `heads` (all by default)."""
        dtype = at_least_fp32(self.A_log.dtype)
        return -self.A_log[heads].to(dtype).exp() * F.softplus(a.to(dtype) + self.dt_bias[heads].to(dtype))


class CPAwareGatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer.

    Alone (`context_parallel` None, the default) it mixes its input's rows. Under context parallelism
    (`context_parallel`, the CP group's exchanges; hooks.py) each rank holds its zigzag share of every row, gathers
    the whole rows, runs the projections, causal conv and gated delta rule on them for its 1/cp of the heads (in
    natural order, with the rows' document boundaries: exact, and the recurrence's compute and memory split cp
    ways), and reduce-scatters the out_proj partial sums back to its tokens. Gathering the layer input (D
    channels) and scattering the output (D) moves 2 * D per token, where exchanging the projected q, k, v, z, a, b
    instead would move 2 * (Hk * Dk + Hv * Dv + Hv) + Hv * Dv (for 35B-A3B: 4,096 against 16,448)."""

    def __init__(self, args: Qwen35MoeArgs):
        super().__init__()
        self.num_k_heads = args.linear_num_key_heads
        self.num_v_heads = args.linear_num_value_heads
        self.head_k_dim = args.linear_key_head_dim
        self.head_v_dim = args.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        dim = args.hidden_size

        self.in_proj_qkv = Linear(dim, conv_dim, bias=False)
        self.in_proj_z = Linear(dim, self.value_dim, bias=False)
        self.in_proj_b = Linear(dim, self.num_v_heads, bias=False)
        self.in_proj_a = Linear(dim, self.num_v_heads, bias=False)
        # Depthwise causal conv over q, k and v; only its weight (C, 1, W) is used, by our conv kernels.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, args.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.register_module(HOLDER_NAME, SSMGate(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=args.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, dim, bias=False)
        self.context_parallel: ContextParallel | None = None  # hooks.py

    def set_parallel_hooks(self, hooks: ParallelHooks) -> None:
        """This layer's extension point (hooks.py): the CP group's exchanges."""
        self.context_parallel = hooks.context_parallel

    A_log = property(lambda self: self._fp32_params.A_log, doc="fp32 A_log of the SSM gate (read-only)")
    dt_bias = property(lambda self: self._fp32_params.dt_bias, doc="fp32 dt_bias of the SSM gate (read-only)")

    def forward(self, x: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D); `layout` marks the packed documents (under CP: of the whole rows)."""
        return self.core(x, layout, projected=True)

    def core(self, x: torch.Tensor, layout: DocumentLayout, projected: bool = False) -> torch.Tensor:
        """The layer up to its output projection: its value heads' gated, normed outputs (B, S, Hv * Dv); with
        `projected`, through it (`project`): the layer's output. Under CP it gathers the whole rows (B, S, D) and
        computes for value heads group * Hv/groups ... (group + 1) * Hv/groups of the whole rows (group: this
        rank) and their key heads."""
        # One function, the projection called from it: each function that a graph break (FLA's call) passes
        # through becomes frames that dynamo compiles separately.
        group, groups = self._head_group()
        if self.context_parallel is not None:
            x, layout = self.context_parallel.gather_sequence(x), layout.global_layout  # (B, S, D), natural order
        cu_seqlens, cu_seqlens_cpu = layout.cu_seqlens, layout.cu_seqlens_cpu
        hk, hv, dk, dv = self.num_k_heads // groups, self.num_v_heads // groups, self.head_k_dim, self.head_v_dim
        keys, values = slice(group * hk * dk, (group + 1) * hk * dk), slice(group * hv * dv, (group + 1) * hv * dv)
        heads = slice(group * hv, (group + 1) * hv)
        # Rows of in_proj_qkv / conv channels: [q of the heads | k of the heads | v of the heads].
        qkv_rows = [keys, _shift(keys, self.key_dim), _shift(values, 2 * self.key_dim)]

        batch, seq, _ = x.shape
        if cu_seqlens is not None:
            x = x.reshape(1, batch * seq, -1)  # varlen kernels take one flattened stream
        tokens = x.shape[:2]
        w_conv = _rows(self.conv1d.weight.squeeze(1), qkv_rows, groups).to(x.dtype)
        q, k, v = causal_conv1d_qkv(self.in_proj_qkv.part(x, _rows_of(qkv_rows, groups)), w_conv,
                                    (hk * dk, hk * dk, hv * dv), layout.position_ids, cu_seqlens)  # each (b, t, part)
        q, k, v = q.reshape(*tokens, hk, dk), k.reshape(*tokens, hk, dk), v.reshape(*tokens, hv, dv)
        beta = self.in_proj_b.part(x, _rows_of([heads], groups)).sigmoid()  # (b, t, hv)
        a = self.in_proj_a.part(x, _rows_of([heads], groups))
        g = self._fp32_params(a, heads)  # fp32

        o = gated_delta_rule(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu)  # (b, t, hv, dv)
        z = self.in_proj_z.part(x, _rows_of([values], groups)).reshape(*tokens, hv, dv)
        o = self.norm(o, z).reshape(batch, seq, hv * dv)
        return self.project(o) if projected else o

    def project(self, o: torch.Tensor) -> torch.Tensor:
        """core's output -> (B, T, D) through out_proj; under CP its columns of this rank's heads, and the partial
        sums reduce-scattered to this rank's tokens."""
        group, groups = self._head_group()
        values = slice(group * self.value_dim // groups, (group + 1) * self.value_dim // groups)
        out = self.out_proj.part(o, columns=None if groups == 1 else lambda w: w[:, values])
        return out if self.context_parallel is None else self.context_parallel.scatter_sequence(out)

    def _head_group(self) -> tuple[int, int]:
        """(group, groups): this rank's share of the heads, the cp-th part under CP, all of them (0, 1) alone."""
        cp = self.context_parallel
        return (0, 1) if cp is None else (cp.rank, cp.size)


def _shift(s: slice, offset: int) -> slice:
    return slice(s.start + offset, s.stop + offset)


def _rows(weight: torch.Tensor, parts: list[slice], groups: int) -> torch.Tensor:
    """The rows `parts` of a weight (the whole weight, uncopied, when there is one group)."""
    return weight if groups == 1 else torch.cat([weight[p] for p in parts])


def _rows_of(parts: list[slice], groups: int):
    """The cut of a weight's rows `parts` (Linear.part); None (the whole weight) when there is one group."""
    return None if groups == 1 else lambda weight: _rows(weight, parts, groups)
