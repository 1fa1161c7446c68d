"""Partial rotary position embedding of the full-attention layers.

Qwen3.5 uses interleaved M-RoPE with (temporal, height, width) position axes. For text every axis
carries the same position, and then M-RoPE is exactly ordinary RoPE over the first `rotary_dim`
channels of each head; the remaining channels pass through unrotated.
"""

from __future__ import annotations

import torch


# An opaque op under torch.compile: inductor would inline these few pointwise ops into every consumer, computing
# the powers, cosines and sines again for each head's element of q and k and once more in the backward. As an op
# they are computed once per token, and the rotation reads them (docs/performance.md, "Tried, not kept").
@torch.library.custom_op("qwen35::rope_cos_sin", mutates_args=())
def rope_cos_sin(position_ids: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B, S, rotary_dim), fp32 (angles of long contexts need fp32 precision)."""
    exponents = torch.arange(0, rotary_dim, 2, device=position_ids.device, dtype=torch.float32) / rotary_dim
    inv_freq = 1.0 / (theta**exponents)  # (rotary_dim / 2,)
    angles = position_ids.float().unsqueeze(-1) * inv_freq  # (B, S, rotary_dim / 2)
    angles = torch.cat((angles, angles), dim=-1)  # (B, S, rotary_dim)
    return angles.cos(), angles.sin()


@rope_cos_sin.register_fake
def _(position_ids: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*position_ids.shape, rotary_dim)
    return position_ids.new_empty(shape, dtype=torch.float32), position_ids.new_empty(shape, dtype=torch.float32)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim channels of x (B, S, H, D) by the angles of cos/sin (B, S, rotary_dim)."""
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
    x_rot = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat((x_rot.type_as(x), x_pass), dim=-1)
