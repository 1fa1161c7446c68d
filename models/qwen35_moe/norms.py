"""RMSNorms of Qwen3.5: zero-centred (scale 1 + w) for the residual stream and q/k, gated for GDN output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fp32_contract import Fp32ParamsModule, at_least_fp32


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.to(at_least_fp32(x.dtype))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class ZeroCenteredRMSNorm(nn.Module):
    """y = norm(x) * (1 + w), in fp32, cast back to x's dtype. `w` starts at zero (identity scale)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _rms_normalize(x, self.eps)
        # The weight rounded to x's dtype first, as FSDP's bf16 policy gathers it (linear.py's rule).
        return (y * (1.0 + self.weight.to(x.dtype).to(y.dtype))).type_as(x)


class GatedRMSNorm(Fp32ParamsModule):
    """y = norm(x) * w * silu(gate), per head, in fp32, cast back to x's dtype. Unlike the residual norms,
    `w` starts at one. The Gated DeltaNet output norm: its weight is F32 in the official checkpoint and stays
    fp32 whatever the model dtype (docs/design.md, fp32 contract)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=at_least_fp32(torch.get_default_dtype())))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = _rms_normalize(x, self.eps)
        y = y * self.weight.to(y.dtype) * F.silu(gate.to(y.dtype))
        return y.type_as(x)
