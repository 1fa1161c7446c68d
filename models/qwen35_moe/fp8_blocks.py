"""Block-wise FP8 weights, as the official FP8 releases store them (Qwen3.5-35B-A3B-FP8 and its kind; the layout of
DeepSeek-V3's and transformers' "fp8" quantization with a `weight_block_size`).

A quantized weight W of shape (..., R, C) is stored as `weight`, float8_e4m3fn of the same shape, and
`weight_scale_inv`, one scale per block of BLOCK rows x BLOCK columns: (..., ceil(R / BLOCK), ceil(C / BLOCK)), the
blocks at the right and bottom edges cut short where R or C is not a multiple of BLOCK. The weight the model
computes with is, elementwise,

    W[..., r, c] = float(weight[..., r, c]) * float(weight_scale_inv[..., r // BLOCK, c // BLOCK])

(`dequantize_blocks`). Quantizing (`quantize_blocks`) takes each block's largest magnitude to the largest finite
e4m3 value (448): scale_inv = amax / 448, weight = round-to-nearest-even(W / scale_inv), an all-zero block a scale of
1. Leading dimensions (the routed experts stacked, (E, R, C)) are blocked independently.
"""

from __future__ import annotations

import torch

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def scale_shape(shape: tuple[int, ...] | torch.Size, block: int = BLOCK) -> tuple[int, ...]:
    """The shape of `weight_scale_inv` for a weight of `shape`."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block), -(-cols // block))


def _per_element(scale_inv: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    """Each block's scale repeated over the block's elements, cut to (..., rows, cols)."""
    return scale_inv.repeat_interleave(block, dim=-2)[..., :rows, :].repeat_interleave(block, dim=-1)[..., :cols]


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                      block: int = BLOCK) -> torch.Tensor:
    """W = weight x its block's scale_inv (module docstring), computed in fp32 (float64 for a float64 `dtype`), in
    `dtype`. ValueError if the shapes do not belong together."""
    expected = scale_shape(weight.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}; a weight of shape "
                         f"{tuple(weight.shape)} in {block} x {block} blocks needs {expected}")
    math_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    rows, cols = weight.shape[-2:]
    if rows % block or cols % block:  # blocks cut at the edges: each scale repeated over its block's elements
        return (weight.to(math_dtype) * _per_element(scale_inv.to(math_dtype), rows, cols, block)).to(dtype)
    # Whole blocks: the scales broadcast over a blocked view, no per-element scale tensor (the same products).
    blocked = weight.to(math_dtype).unflatten(-1, (-1, block)).unflatten(-3, (-1, block))  # (..., R/b, b, C/b, b)
    return (blocked * scale_inv.to(math_dtype)[..., :, None, :, None]).to(dtype).flatten(-2).flatten(-3, -2)


def dequantize_stacked(weight: torch.Tensor, scale_inv: torch.Tensor, parts: int, dtype: torch.dtype = torch.float32,
                       block: int = BLOCK) -> torch.Tensor:
    """dequantize_blocks of `parts` quantized weights of equal shape stacked along their rows (the routed experts'
    gate and up projections, fused as (E, 2I, D)), `scale_inv` their scales stacked the same way: each part's blocks
    start at its first row, so where a part's rows are not a multiple of `block` they are not the blocks of the
    stacked weight."""
    if parts == 1 or (weight.shape[-2] // parts) % block == 0:  # the same blocks either way
        return dequantize_blocks(weight, scale_inv, dtype, block)
    return torch.cat([dequantize_blocks(w, s, dtype, block)
                      for w, s in zip(weight.chunk(parts, dim=-2), scale_inv.chunk(parts, dim=-2))], dim=-2)


def quantize_blocks(weight: torch.Tensor, block: int = BLOCK,
                    scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, scale_inv in `scale_dtype`) of `weight` (..., R, C): each block's amax mapped to 448.
    The division uses the stored (rounded) scale, so dequantize_blocks inverts it up to e4m3's own rounding. Beside
    its output it holds one fp32 copy of `weight` (an export quantizes a layer's experts at once on the GPU)."""
    *lead, rows, cols = weight.shape
    w = weight.detach().to(torch.float32, copy=True)
    if rows % block or cols % block:  # zeros never raise a block's amax
        w = torch.nn.functional.pad(w, (0, -cols % block, 0, -rows % block))
    blocks = w.unflatten(-1, (-1, block)).unflatten(-3, (-1, block))  # (..., R/b, b, C/b, b), a view of w
    amax = torch.maximum(blocks.amax(dim=(-3, -1)), -blocks.amin(dim=(-3, -1)))  # no |w| copy
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    blocks.div_(scale_inv.to(torch.float32)[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    return w[..., :rows, :cols].to(FP8), scale_inv
