"""nn.Linear in the dtype of its input. The model's one mixed-precision rule: a module computes in the dtype of its
input activations and casts its weights to it where they differ. Under FSDP's bf16 policy the gathered weights
already are bf16 and the cast does nothing; the fp32-contract modules (fp32_contract.py) upcast instead.

Where no FSDP policy casts them (one GPU), the model's `mixed_precision` gives each Linear a `weight_reader`
(hooks.py), through which it reads its weight in the input's dtype instead of casting it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .hooks import WeightReader


class Linear(nn.Linear):
    """nn.Linear in its input's dtype (same parameters and state-dict keys)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight_reader: WeightReader | None = None  # hooks.py

    def weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` (cast where it differs, or read through `weight_reader`)."""
        if self.weight_reader is None:
            return self.weight.to(dtype)
        return self.weight_reader.read(self, "weight", dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight_as(x.dtype), bias)
