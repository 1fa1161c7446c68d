"""nn.Linear in the dtype of its input. The model's one mixed-precision rule: a module computes in the dtype of its
input activations and casts its weights to it where they differ. Under FSDP's bf16 policy the gathered weights
already are bf16 and the cast does nothing; the fp32-contract modules (fp32_contract.py) upcast instead.

Where no FSDP policy casts them (one GPU), the model's `mixed_precision` gives each Linear a `weight_reader`
(hooks.py), through which it reads its weight in the input's dtype instead of casting it. A frozen weight held in FP8
(a LoRA run from the FP8 release: fp8_hold.py) is dequantized to the input's dtype instead.

The GEMM itself is F.linear unless the harness sets `gemm` (FP8 training, harness/float8.py: the same product with
its operands cast to float8).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .fp8_hold import dequantized, is_held_fp8
from .hooks import WeightReader

Cut = Callable[[torch.Tensor], torch.Tensor]
Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # (x, weight, bias) -> F.linear's


class Linear(nn.Linear):
    """nn.Linear in its input's dtype (same parameters and state-dict keys)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight_reader: WeightReader | None = None  # hooks.py
        self.adapter: nn.Module | None = None  # a trained update beside the frozen weight (lora.py)
        self.gemm: Gemm | None = None  # F.linear's replacement (harness/float8.py)

    def weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` (cast where it differs, read through `weight_reader`, or dequantized where it is held
        in FP8: fp8_hold.py)."""
        if is_held_fp8(self, "weight"):
            return dequantized(self, "weight", dtype)
        if self.weight_reader is None:
            return self.weight.to(dtype)
        return self.weight_reader.read(self, "weight", dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        out = self._linear(x, self.weight_as(x.dtype), bias)
        return out if self.adapter is None else out + self.adapter(x)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias) if self.gemm is None else self.gemm(x, weight, bias)

    def part(self, x: torch.Tensor, rows: Cut | None = None, columns: Cut | None = None) -> torch.Tensor:
        """Some outputs, or the partial sums over some inputs: F.linear of x with the weight's rows cut by `rows`,
        its columns by `columns` (functions of a matrix; no bias). The adapter's update is cut the same way (B's
        rows, A's columns)."""
        weight = self.weight_as(x.dtype)
        weight = weight if rows is None else rows(weight)
        out = self._linear(x, weight if columns is None else columns(weight))
        return out if self.adapter is None else out + self.adapter(x, rows, columns)
