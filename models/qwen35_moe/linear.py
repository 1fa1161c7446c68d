"""The model's one mixed-precision rule: a module computes in the dtype of its input activations and casts its
weights to it where they differ. Under FSDP's bf16 policy the gathered weights already are bf16 and the casts
do nothing; on one GPU, where the model is not sharded at all, the fp32 weights are cast at each use (their
gradients flow back through the cast in fp32). The fp32-contract modules (gated_delta_net_fp32.py) upcast instead."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """nn.Linear in its input's dtype (same parameters and state-dict keys)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)
