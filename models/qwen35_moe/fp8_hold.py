"""A frozen weight held as the FP8 release stores it: float8_e4m3fn values and one scale per 128 x 128 block
(fp8_blocks.py), dequantized where the module computes with it.

A LoRA run from an FP8 release folder holds its frozen base this way (harness/lora/run.py): 1 byte per weight plus
its scales instead of bf16's 2, and the weights the forward and the backward-to-inputs read are dequantized just in
time, one module at a time, and freed after (under full activation checkpointing a block's dequantized weights live
only while its forward, or its recompute and backward, run). The held weight stays the module's parameter (same
name, shape, and state-dict key, dtype float8_e4m3fn, no gradient); its scales are a buffer beside it,
`<name>_scale_inv`, not persistent: checkpoints and state dicts do not change (a LoRA checkpoint holds the adapters
only), and the exports read the weight dequantized (`held_fp8_weights`).

The routed experts' gate/up weight (E, 2I, D) fuses two quantized weights per expert (gate and up, (I, D) each, their
own blocks): its scales are the two grids stacked the same way, and it is dequantized part by part where I is not a
multiple of 128 (`dequantize_stacked`).

Under FSDP the held weight is sharded as any parameter (float8 DTensor shards, 1 byte a value), its scales whole on
every rank (a buffer: 1/16384 of the weight's values, in fp32). FSDP's gather casts it to its policy's param dtype
(a float8 value is exact in bf16 and fp32), so a module knows a held weight by its scales, not by its dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from .fp8_blocks import FP8, dequantize_stacked, scale_shape
from .fp8_config import SCALE_SUFFIX  # the release's name: the buffer is named as its tensor is

_STACKED = {"gate_up_proj": 2}  # weights whose rows are several quantized weights (RoutedExperts)
_SLICE_ELEMENTS = 1 << 26  # eager dequantization of stacked experts in slices: fp32 temporaries of <= 512 MiB


def held_scale_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scales' shape of the held weight `name` (a parameter name) of `shape`."""
    parts = _STACKED.get(name, 1)
    *lead, rows, cols = shape
    per_part = scale_shape((rows // parts, cols))
    return (*lead, per_part[0] * parts, per_part[1])


def hold_fp8(module: nn.Module, name: str) -> None:
    """Make `module`'s parameter `name` a held FP8 weight (float8, no gradient) with an empty scale buffer beside it,
    on the parameter's device (meta too); the values come with the loading (`load_held`)."""
    param = getattr(module, name)
    setattr(module, name, nn.Parameter(torch.empty(param.shape, dtype=FP8, device=param.device), requires_grad=False))
    scales = torch.empty(held_scale_shape(name, tuple(param.shape)), dtype=torch.float32, device=param.device)
    module.register_buffer(name + SCALE_SUFFIX, scales, persistent=False)


def is_held_fp8(module: nn.Module, name: str) -> bool:
    return hasattr(module, name + SCALE_SUFFIX)


@torch.no_grad()
def load_held(module: nn.Module, name: str, local: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    """Set a held FP8 weight: `local`, the tensor this rank holds of it (the parameter, or its FSDP shard), from
    `values`, the same part of the release's float8 values; and its scales, whole (any dtype: held in fp32)."""
    local.copy_(values)
    getattr(module, name + SCALE_SUFFIX).copy_(scales)


def dequantized(module: nn.Module, name: str, dtype: torch.dtype, weight: torch.Tensor | None = None) -> torch.Tensor:
    """`module`'s held FP8 weight `name` in `dtype` (each block's values times its scale, in fp32, then rounded
    once to `dtype`): the module's own (under FSDP, inside its forward, gathered in the policy's dtype: the same
    values), or `weight`, its values whole (an export gathers a sharded one)."""
    weight = getattr(module, name) if weight is None else weight
    scales, parts = getattr(module, name + SCALE_SUFFIX), _STACKED.get(name, 1)
    if weight.ndim == 2 or torch.compiler.is_compiling() or weight.numel() <= _SLICE_ELEMENTS:
        return dequantize_stacked(weight, scales, parts, dtype)  # compiled: one fused kernel, no temporaries
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    step = max(_SLICE_ELEMENTS // weight[0].numel(), 1)
    for first in range(0, weight.shape[0], step):
        part = slice(first, first + step)
        out[part] = dequantize_stacked(weight[part], scales[part], parts, dtype)
    return out


def held_fp8_weights(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """{parameter name (as model.named_parameters gives it): (module, attribute)} of every held FP8 weight."""
    return {f"{prefix}.{name}" if prefix else name: (module, name)
            for prefix, module in model.named_modules()
            for name, _ in module.named_parameters(recurse=False) if is_held_fp8(module, name)}
