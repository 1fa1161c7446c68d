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
from .causal_conv import causal_conv1d
from .gated_delta_net_fp32 import HOLDER_NAME, Fp32ParamsModule
from .gated_delta_rule import gated_delta_rule
from .norms import GatedRMSNorm


class SSMGate(Fp32ParamsModule):
    """Per value head decay parameters, kept in fp32 through any `.to(dtype)` of the model."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.empty(num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(num_heads, dtype=torch.float32))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        """a (B, T, H) -> g (B, T, H), log decay in fp32."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())


class CPAwareGatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer. With `_cp_mesh` None (the default) it is the plain single-device layer;
    the context-parallel path is attached by the parallelize function."""

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

        self.in_proj_qkv = nn.Linear(dim, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(dim, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(dim, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, self.num_v_heads, bias=False)
        # Depthwise causal conv over q, k and v; only its weight (C, 1, W) is used, by our conv kernels.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, args.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.register_module(HOLDER_NAME, SSMGate(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, dim, bias=False)
        self._cp_mesh = None

    A_log = property(lambda self: self._fp32_params.A_log, doc="fp32 A_log of the SSM gate (read-only)")
    dt_bias = property(lambda self: self._fp32_params.dt_bias, doc="fp32 dt_bias of the SSM gate (read-only)")

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D). `cu_seqlens` over the flattened B * T tokens marks packed documents."""
        if self._cp_mesh is not None:
            raise NotImplementedError("context-parallel Gated DeltaNet is not available in this build")
        batch, seq, _ = x.shape
        if cu_seqlens is not None:
            x = x.reshape(1, batch * seq, -1)  # varlen kernels take one flattened stream
        tokens = x.shape[:2]

        qkv = causal_conv1d(self.in_proj_qkv(x), self.conv1d.weight.squeeze(1), cu_seqlens)  # (b, t, C)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(*tokens, self.num_k_heads, self.head_k_dim)
        k = k.reshape(*tokens, self.num_k_heads, self.head_k_dim)
        v = v.reshape(*tokens, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(x).sigmoid()  # (b, t, Hv)
        g = self._fp32_params(self.in_proj_a(x))  # (b, t, Hv), fp32

        o = gated_delta_rule(q, k, v, g, beta, cu_seqlens)  # (b, t, Hv, Dv)
        z = self.in_proj_z(x).reshape(*tokens, self.num_v_heads, self.head_v_dim)
        o = self.norm(o, z).reshape(batch, seq, self.value_dim)
        return self.out_proj(o)
